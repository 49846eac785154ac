"""Assembles the aiohttp application from a Config: components, background jobs, routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy import __version__
from proxy.artifacts.index import ArtifactCache
from proxy.artifacts.misses import NegativeCache
from proxy.artifacts.service import ArtifactService
from proxy.config import Config
from proxy.metrics import ProxyMetrics, SymbolizeMetrics
from proxy.sources.base import Source
from proxy.sources.debuginfod import Upstream
from proxy.sources.localdir import LocalDirectory
from proxy.store import migrate
from proxy.store.disk import DiskStore
from proxy.store.repository import Repository, create_engine
from proxy.symbols.resolver import SymbolService
from proxy.web import artifacts, ops
from proxy.web.state import STATE, AppState
from proxy.web.symbolize import symbolize

log = logging.getLogger(__name__)
ACCESS_FLUSH_S = 5.0
NEGATIVE_SWEEP_S = 300.0


def add_routes(app: web.Application) -> None:
    for method in ("GET", "HEAD"):
        app.router.add_route(method, "/buildid/{build_id}/{kind:source}{detail:/.*}",
                             artifacts.buildid)
        app.router.add_route(method, "/buildid/{build_id}/{kind:section}/{detail}",
                             artifacts.buildid)
        app.router.add_route(method, "/buildid/{build_id}/{kind}", artifacts.buildid)
    app.router.add_post("/symbolize", symbolize)
    app.router.add_get("/metrics", ops.metrics)
    app.router.add_get("/healthz", ops.healthz)
    app.router.add_get("/", ops.status_page)


def create_app(config: Config, registry: CollectorRegistry | None = None) -> web.Application:
    app = web.Application()
    add_routes(app)
    app.cleanup_ctx.append(_lifecycle(config, registry or CollectorRegistry()))
    return app


def _lifecycle(
    config: Config, registry: CollectorRegistry
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        if config.database.migrate_on_start:
            await asyncio.to_thread(migrate.upgrade, config.database_url)
        metrics = ProxyMetrics(registry)
        repo = Repository(create_engine(config.database_url))
        cache = ArtifactCache(DiskStore(config.cache_dir), repo, metrics, config.cache.max_bytes)
        await cache.load()
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=config.cache.max_concurrent_fetches * 2,
                                           ttl_dns_cache=300),
            # Sites whose one way out is an HTTP proxy set HTTPS_PROXY as usual.
            trust_env=True,
            headers={"User-Agent": f"symgate/{__version__}"},
        )
        upstreams: list[Source] = [
            LocalDirectory(u.path, u.rescan_s, metrics) if u.path is not None
            else Upstream(u, session, metrics)
            for u in config.upstreams
        ]
        local_dirs = [u for u in upstreams if isinstance(u, LocalDirectory)]
        for local in local_dirs:
            await local.start()
        by_url = {u.name: u for u in upstreams}
        tenant_upstreams: dict[str, list[Source]] = {
            name: [by_url.get(u.url) or Upstream(u, session, metrics) for u in tenant.upstreams]
            for name, tenant in config.tenants.items() if tenant.upstreams
        }
        service = ArtifactService(
            cache=cache, negatives=NegativeCache(repo, config.negative), upstreams=upstreams,
            policy=config.fetch.policy,
            max_concurrent_fetches=config.cache.max_concurrent_fetches, metrics=metrics,
        )
        symbolize_metrics = SymbolizeMetrics(registry)
        symbols = SymbolService(
            artifacts=service, repo=repo, root=config.server.data_dir / "symtabs",
            debug_dirs=config.symbolize.debug_dirs, workers=config.symbolize.build_workers,
            metrics=symbolize_metrics,
        )
        await symbols.start()
        app[STATE] = AppState(config, registry, metrics, repo, session, service, symbols,
                              symbolize_metrics, tenant_upstreams)
        jobs = [
            asyncio.create_task(_every(ACCESS_FLUSH_S, cache.flush_access)),
            asyncio.create_task(_every(NEGATIVE_SWEEP_S, service.negatives.expire)),
        ]
        log.info("symgate %s: cache %s, database %s, upstreams %s", __version__,
                 config.cache_dir, _safe_url(config.database_url),
                 " ".join(u.url for u in config.upstreams))
        try:
            yield
        finally:
            for job in jobs:
                job.cancel()
            await service.cancel_all()
            await symbols.close()
            for local in local_dirs:
                await local.stop()
            with contextlib.suppress(Exception):
                await cache.flush_access()
            await session.close()
            await repo.close()

    return lifecycle


async def _every(seconds: float, job: Callable[[], Awaitable[object]]) -> None:
    while True:
        await asyncio.sleep(seconds)
        try:
            await job()
        except Exception:  # a failed background job is logged and tried again next time
            log.exception("background job %s failed", getattr(job, "__qualname__", job))


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
