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
from proxy.artifacts.misses import RememberedMisses
from proxy.artifacts.service import ArtifactService
from proxy.config import Config
from proxy.expiry import Expiry
from proxy.metrics import ProxyMetrics, SymbolizeMetrics
from proxy.sources.base import Source
from proxy.sources.debuginfod import Upstream
from proxy.sources.localdir import LocalDirectory
from proxy.store import migrate
from proxy.store.disk import DiskStore
from proxy.store.repository import Repository, create_engine
from proxy.symbols.build_pool import BuildPool
from proxy.symbols.open_tables import OpenTables
from proxy.symbols.resolver import SymbolResolver
from proxy.symbols.table_store import TableStore
from proxy.symbols.workers import SymbolizeWorkers
from proxy.web import artifacts, ops
from proxy.web.errors import error_edge
from proxy.web.state import STATE, AppState
from proxy.web.symbolize import symbolize
from proxy.web.tenancy import Tenancy

log = logging.getLogger(__name__)


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
    app = web.Application(middlewares=[error_edge])
    add_routes(app)
    app.cleanup_ctx.append(_lifecycle(config, registry or CollectorRegistry()))
    return app


def _sources(
    config: Config, session: aiohttp.ClientSession, metrics: ProxyMetrics
) -> tuple[list[Source], dict[str, list[Source]]]:
    """The global sources, and each tenant's own (a global one where the URL is the same)."""
    shared: list[Source] = [
        LocalDirectory(u.path, u.rescan_s, metrics) if u.path is not None
        else Upstream(u, session, metrics)
        for u in config.upstreams
    ]
    # A tenant's upstream is the global one only when configured the same in every respect:
    # the same URL with the tenant's own credentials is the tenant's own, private source.
    configured = list(zip(config.upstreams, shared, strict=True))
    private: dict[str, list[Source]] = {}
    for name, tenant in config.tenants.items():
        if tenant.upstreams:
            # The config allows servers only here: a tenant's directory would be a shared one.
            private[name] = [
                next((s for cfg, s in configured if cfg == u), None)
                or Upstream(u, session, metrics, scope=name)
                for u in tenant.upstreams]
    return shared, private


def _lifecycle(
    config: Config, registry: CollectorRegistry
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        if config.database.migrate_on_start:
            await asyncio.to_thread(migrate.upgrade, config.database_url)
        metrics = ProxyMetrics(registry)
        repo = Repository(create_engine(config.database_url))
        store = DiskStore(config.cache_dir, config.server.data_dir / "symtabs")
        cache = ArtifactCache(store, repo, metrics, config.cache.max_bytes)
        await cache.load()
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=config.cache.max_concurrent_fetches * 2,
                                           ttl_dns_cache=300),
            # Sites whose one way out is an HTTP proxy set HTTPS_PROXY as usual.
            trust_env=True,
            headers={"User-Agent": f"symgate/{__version__}"},
        )
        shared, private = _sources(config, session, metrics)
        local_dirs = [s for s in shared if isinstance(s, LocalDirectory)]
        for local in local_dirs:
            await local.start()
        expiry = Expiry.from_config(config)
        misses = RememberedMisses(repo, expiry, memo_s=config.negative.memo_s,
                                  memo_entries=config.negative.memo_entries)
        service = ArtifactService(
            cache=cache, misses=misses, policy=config.fetch.policy,
            max_concurrent_fetches=config.cache.max_concurrent_fetches,
            max_artifact_bytes=config.cache.max_artifact_bytes, metrics=metrics,
        )
        symbolize_metrics = SymbolizeMetrics(registry)
        symbols = SymbolResolver(
            artifacts=service, tables=TableStore(repo, store, expiry),
            open_tables=OpenTables(config.symbolize.open_tables),
            pool=BuildPool(config.symbolize.build_workers),
            workers=SymbolizeWorkers(config.symbolize),
            debug_dirs=config.symbolize.debug_dirs, metrics=symbolize_metrics,
        )
        await symbols.start()
        app[STATE] = AppState(config, registry, metrics, repo, session, service, symbols,
                              symbolize_metrics, Tenancy(config, shared, private))
        jobs = [
            asyncio.create_task(_every(config.server.access_flush_s, cache.flush_access)),
            asyncio.create_task(_every(config.negative.sweep_s, misses.expire)),
        ]
        log.info("symgate %s: cache %s, database %s, upstreams %s", __version__,
                 config.cache_dir, _safe_url(config.database_url),
                 " ".join(u.name for u in shared))
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
