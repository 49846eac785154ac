"""Everything a running server holds, built once from the Config and stored on the app."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from sqlalchemy import text

from proxy.artifacts.catalogue import Catalogue
from proxy.artifacts.service import ArtifactService
from proxy.artifacts.uploads import Uploads
from proxy.config import Config
from proxy.metrics import ProxyMetrics, SymbolizeMetrics
from proxy.store.repository import Repository
from proxy.symbols.resolver import SymbolResolver
from proxy.web.hot_files import HotFiles
from proxy.web.send_timeout import SendTimeouts
from proxy.web.status_page import RecentMisses
from proxy.web.tenancy import Tenancy


@dataclass
class AppState:
    config: Config
    registry: CollectorRegistry
    metrics: ProxyMetrics
    repo: Repository
    session: aiohttp.ClientSession
    service: ArtifactService
    symbols: SymbolResolver
    symbolize_metrics: SymbolizeMetrics
    tenancy: Tenancy
    catalogue: Catalogue
    uploads: Uploads
    send_timeouts: SendTimeouts
    recent_misses: RecentMisses = field(default_factory=RecentMisses)
    hot: HotFiles = field(default_factory=HotFiles)
    started: float = field(default_factory=time.time)
    # This server's name in Via headers: a request that names it has come round a loop. The
    # replica's (every process on the data dir), not the process's: with serve --workers N a
    # request that comes back to another worker would follow the very fetch it waits on.
    via_name: str = field(default_factory=lambda: f"symgate-{uuid.uuid4().hex[:16]}")

    async def ping_database(self) -> None:
        # Bounded here too: /healthz must answer a probe in time even when SQLite is locked.
        async with asyncio.timeout(self.config.database.timeout_s or None):
            async with self.repo.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))


STATE = web.AppKey("state", AppState)
