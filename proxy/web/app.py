"""Assembles the aiohttp application from a Config: components, background jobs, routes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry

from proxy import __version__
from proxy.artifacts.board import FlightBoard
from proxy.artifacts.catalogue import Catalogue
from proxy.artifacts.index import ArtifactCache
from proxy.artifacts.misses import RememberedMisses
from proxy.artifacts.purges import PurgeNotices
from proxy.artifacts.service import ArtifactService
from proxy.artifacts.uploads import Uploads
from proxy.config import Config, parse_listen
from proxy.expiry import Expiry
from proxy.health import Health
from proxy.keys import ArtifactKey
from proxy.metrics import ProxyMetrics, ServerCollector, SymbolizeMetrics
from proxy.sources.base import Source
from proxy.sources.debuginfod import Sessions, Upstream, upstream_names
from proxy.sources.env_routes import EnvironmentRoutes
from proxy.sources.localdir import LocalDirectory
from proxy.sources.redirects import GuardedResolver
from proxy.store import migrate
from proxy.store.budget import database_budget
from proxy.store.disk import DiskStore
from proxy.store.replica import replica_id
from proxy.store.repository import ArtifactRecord, Repository, create_engine
from proxy.symbols.build_pool import BuildPool
from proxy.symbols.open_tables import OpenTables
from proxy.symbols.resolver import SymbolResolver
from proxy.symbols.table_store import TableStore
from proxy.symbols.workers import SymbolizeWorkers, worker_pool
from proxy.web import artifacts, logs, ops, upload
from proxy.web.connections import ConnectionGuard, default_max_connections, raise_fd_limit
from proxy.web.errors import Handler, error_edge
from proxy.web.fast_hits import FastHits
from proxy.web.file_sends import reset_on_close
from proxy.web.grace import STOP_SIGNALS, unfinished
from proxy.web.heap import TRIM_EVERY_S, trim_heap
from proxy.web.jobs import Jobs
from proxy.web.metadata import metadata
from proxy.web.otlp import symbolize_otlp
from proxy.web.send_timeout import SendTimeouts
from proxy.web.startup import CannotStart, make_data_dirs, reason
from proxy.web.state import STATE, AppState
from proxy.web.symbolize import expect_continue, symbolize
from proxy.web.tenancy import Tenancy

if TYPE_CHECKING:
    from proxy.bucket.tier import SharedTier

log = logging.getLogger(__name__)


_ROOTS = ("/buildid", "//buildid")


def add_routes(app: web.Application, enable_uploads: bool = True) -> None:
    # A client that joins a base URL configured with a final slash to "/buildid/..." as it
    # is (Pyroscope's debuginfod_url does) asks for //buildid/...: the same file. Routed as
    # a path of its own ("//buildid", not "/"), it costs the usual paths no lookup.
    for root in _ROOTS:
        for method in ("GET", "HEAD"):
            # The one-segment kinds (debuginfo, executable: nearly every request) are tried
            # first; no path of the other two routes has that shape.
            app.router.add_route(method, root + "/{build_id}/{kind}", artifacts.buildid)
            app.router.add_route(method, root + "/{build_id}/{kind:source}{detail:/(?s:.*)}",
                                 artifacts.buildid)
            # A section's name is all that follows, as for elfutils: `a/b` is one.
            app.router.add_route(method, root + "/{build_id}/{kind:section}/{detail:(?s:.+)}",
                                 artifacts.buildid)
            # elfutils answers a trailing slash as if it were not there.
            app.router.add_route(method, root + "/{build_id}/{kind}/", artifacts.buildid)
    for method in ("GET", "HEAD"):
        # Any other path under /buildid (no build ID, no kind, a segment too many) is a
        # malformed request: aiohttp's 404 for it was a miss that clients remember.
        app.router.add_route(method, "/{lead:/?}buildid{rest:(?s:/.*)?}", artifacts.malformed)
    app.router.add_get("/metadata", metadata)
    if enable_uploads:
        for root in _ROOTS:
            for method, handler in (("PUT", upload.put), ("DELETE", upload.delete)):
                app.router.add_route(method, root + "/{build_id}/{kind:debuginfo|executable}",
                                     handler, expect_handler=upload.expect_continue)
    app.router.add_post("/symbolize", symbolize, expect_handler=expect_continue)
    app.router.add_post("/symbolize/otlp", symbolize_otlp, expect_handler=expect_continue)
    app.router.add_get("/metrics", ops.metrics)
    app.router.add_get("/healthz", ops.healthz)
    app.router.add_get("/", ops.status_page)


def _budgeted(timeout_s: float) -> Middleware:
    """Each request's queries share database.timeout_s in all (proxy.store.budget): against
    a database that never answers, a request that makes several waited for each."""
    @web.middleware
    async def budgeted(request: web.Request, handler: Handler) -> web.StreamResponse:
        with database_budget(timeout_s or None):
            return await handler(request)

    return budgeted


def create_app(config: Config, registry: CollectorRegistry | None = None, *,
               one_of_several: bool = False) -> web.Application:
    """`one_of_several`: one of several serving processes (proxy.web.supervisor), whose
    metrics go to prometheus-client's multiprocess files (/metrics then shows all of them)
    and whose cache figures are the whole cache's."""
    app = web.Application(middlewares=[error_edge, _budgeted(config.database.timeout_s)])
    add_routes(app, config.upload.enabled)
    registry = registry or CollectorRegistry()
    exposed = registry
    if one_of_several:
        exposed = CollectorRegistry()
        ServerCollector(exposed, os.environ["PROMETHEUS_MULTIPROC_DIR"])
    app.cleanup_ctx.append(_lifecycle(config, registry, exposed, one_of_several))
    return app


def client_session(config: Config, limit: int) -> aiohttp.ClientSession:
    """A session for upstream requests, with a pool of at most `limit` connections (0: no
    limit); `symgate inspect` asks the upstreams through one too, as the server does."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=limit, ttl_dns_cache=300,
            # Redirect targets are connected to only at addresses their rules allow.
            resolver=GuardedResolver([*config.upstreams, *(
                u for t in config.tenants.values() for u in t.upstreams)])),
        # Sites whose one way out is an HTTP proxy set HTTPS_PROXY as usual: the sources
        # apply it (proxy.sources.env_routes), looked up once rather than per request.
        trust_env=False,
        # symgate asks for every client of the site: a cookie one answer set would go with
        # later requests of anyone, to any port of that host and any host its domain covers.
        cookie_jar=aiohttp.DummyCookieJar(),
        headers={"User-Agent": f"symgate/{__version__}"},
    )


def _sources(
    config: Config, sessions: Sessions, metrics: ProxyMetrics
) -> tuple[list[Source], dict[str, list[Source]]]:
    """The global sources, and each tenant's own (a global one where the URL is the same)."""
    routes = EnvironmentRoutes()
    shared: list[Source] = [
        LocalDirectory(u.path, u.rescan_s, metrics) if u.path is not None
        else Upstream(u, sessions, metrics, routes, name=name)
        for u, name in zip(config.upstreams, upstream_names(config.upstreams), strict=True)
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
                or Upstream(u, sessions, metrics, routes, scope=name, name=own, place=place)
                for place, (u, own) in enumerate(
                    zip(tenant.upstreams, upstream_names(tenant.upstreams, name), strict=True),
                    start=1)]
    return shared, private


def _lifecycle(
    config: Config, registry: CollectorRegistry, exposed: CollectorRegistry,
    one_of_several: bool,
) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        if config.database.migrate_on_start or not one_of_several:
            # Not migrated (--no-migrate): its revision checked all the same. A process of
            # several had both done by the supervisor's fork.
            await asyncio.to_thread(
                migrate.upgrade if config.database.migrate_on_start else migrate.check,
                config.database_url, timeout_s=config.database.timeout_s)
        metrics = ProxyMetrics(registry)
        try:
            replica = replica_id(config.cache_dir)
        except (OSError, ValueError) as e:
            raise CannotStart(f"cannot read or make this cache's replica id: {e}") from None
        # What is started is stopped again, in the reverse order, however the start ends: a
        # stop signal cancels it midway (serve()), and what it had opened must not be left to
        # the garbage collector's warnings or hold the process's exit.
        async with contextlib.AsyncExitStack() as started:
            # As serve() sets it, for an app run otherwise (the tests'): the failures the
            # loop reports, an outage's abandoned database answers among them (logs).
            loop = asyncio.get_running_loop()
            started.callback(loop.set_exception_handler, loop.get_exception_handler())
            loop.set_exception_handler(logs.loop_exception_handler)
            repo = Repository(create_engine(config.database_url, config.database.timeout_s),
                              replica=replica, timeout_s=config.database.timeout_s)
            started.push_async_callback(repo.close)
            metrics.replica.labels(replica=replica).set(1)
            store = DiskStore(config.cache_dir, config.server.data_dir / "symtabs")
            started.callback(store.close)
            cache = ArtifactCache(store, repo, metrics, config.cache.max_bytes,
                                  shared=one_of_several)
            # Purges from now on are applied; those before are in what load() reads (their
            # rows are gone). Taken before load, so a purge made while it runs is not missed.
            purges = PurgeNotices(repo, cache)
            await purges.start()
            await cache.load()

            stopping: list[float] = []  # when the stop began, once it has

            async def flush_access() -> None:
                # What is left of one database.timeout_s since the stop began: a flush under
                # way when it began (Jobs.stop) has had its time, and against a database that
                # does not answer the stop took two timeouts.
                timeout_s = config.database.timeout_s or None
                if timeout_s is not None and stopping:
                    timeout_s -= time.monotonic() - stopping[0]
                try:
                    with database_budget(timeout_s):
                        await cache.flush_access()
                except Exception as e:
                    log.warning("stopping: hit counts and rows not written (%s: %s)",
                                type(e).__name__, e)

            started.push_async_callback(flush_access)
            board = FlightBoard(store.flights)
            started.callback(board.close)
            board.clear_stale()
            # Fetches and /metadata queries each have a pool of connections of their own. A
            # fetch holds a fetch slot (cache.max_concurrent_fetches) and a connection per
            # source it asks at once, so its pool needs no limit of its own; a limit there
            # made a fetch wait for a connection within its first-byte limit, timed out and
            # charged to an upstream it never reached: a client's flood of slow /metadata
            # queries opened the breakers of healthy upstreams. Queries, which no slot
            # bounds, have the limit.
            session = client_session(config, limit=0)
            started.push_async_callback(session.close)
            queries = client_session(config, limit=config.cache.max_concurrent_fetches * 2)
            started.push_async_callback(queries.close)
            shared, private = _sources(config, Sessions(session, queries), metrics)
            local_dirs = [s for s in shared if isinstance(s, LocalDirectory)]
            for local in local_dirs:
                await local.start()
                started.push_async_callback(local.stop)
            expiry = Expiry.from_config(config)
            misses = RememberedMisses(repo, expiry, memo_s=config.negative.memo_s,
                                      memo_entries=config.negative.memo_entries)
            tier = _shared_tier(config, repo, metrics, cache.health, replica)
            if tier is not None:
                started.push_async_callback(tier.close)
            service = ArtifactService(
                cache=cache, misses=misses, policy=config.fetch.policy,
                max_concurrent_fetches=config.cache.max_concurrent_fetches,
                max_artifact_bytes=config.cache.max_artifact_bytes, metrics=metrics,
                board=board, tier=tier, doubt_s=config.negative.not_found_ttl_s,
                forwarded_ttl_limit=config.server.forwarded_ttl_limit,
            )
            await service.warm_up()
            symbolize_metrics = SymbolizeMetrics(registry)
            for tree in config.symbolize.debug_dirs:
                if not tree.is_dir():  # a typo, a relative path, a mount not there yet
                    log.warning("symbolize.debug_dirs: %s is not a directory: nothing is "
                                "found in it until it is one", tree)
            processes = worker_pool(config.symbolize)
            symbols = SymbolResolver(
                artifacts=service, tables=TableStore(repo, store, expiry, tier),
                open_tables=OpenTables(config.symbolize.open_tables),
                pool=BuildPool(processes, config.symbolize.build_workers,
                               timeout_s=config.symbolize.build_timeout_s,
                               memory_bytes=config.symbolize.build_memory_bytes),
                workers=SymbolizeWorkers(config.symbolize, processes),
                debug_dirs=config.symbolize.debug_dirs, metrics=symbolize_metrics,
                enabled=config.symbolize.enabled,
            )
            await symbols.start(worker=config.symbolize.worker_at_start)
            started.push_async_callback(symbols.close)
            # Before the symbol tables close: builds wait on the fetches it holds.
            started.push_async_callback(service.cancel_all)
            app[STATE] = AppState(config, exposed, metrics, repo, session, service, symbols,
                                  symbolize_metrics, Tenancy(config, shared, private),
                                  Catalogue(repo, local_dirs),
                                  Uploads(service, repo, config.upload),
                                  SendTimeouts(config.server.send_timeout_s,
                                               metrics.send_timeouts.inc),
                                  via_name=_via_name(config, replica))
            cache.evicted.append(app[STATE].hot.forget)
            # A version another process removed (an upload deleted or replaced): its bytes too.
            cache.forgotten.append(app[STATE].hot.forget)
            jobs = Jobs()
            # Awaited before what they use closes: pushed after it, so undone before it.
            started.push_async_callback(jobs.stop)
            jobs.start(config.server.access_flush_s, cache.flush_access)
            # Tables of files evicted while the database was down, once it is back.
            jobs.start(config.server.access_flush_s, symbols.drop_owed)
            # Other processes on this data dir add files this one's index never sees.
            jobs.start(config.server.access_flush_s, cache.enforce_shared_budget)
            jobs.start(config.negative.sweep_s, misses.expire)
            # Purges made on other replicas, or by the CLI, while this process has the file.
            jobs.start(config.cache.purge_poll_s, purges.poll)
            # Which tenants have uploads, on any replica: their requests look there first.
            jobs.start(config.cache.purge_poll_s, service.refresh_uploaders)
            jobs.start(TRIM_EVERY_S, trim_heap)
            if tier is not None and config.storage is not None:
                def path_of(rec: ArtifactRecord) -> Path:
                    return store.artifact_path(rec.scope, ArtifactKey.from_id(rec.key))

                async def sync_bucket() -> None:
                    await tier.sync(path_of)

                jobs.start(config.storage.sync_s, sync_bucket)
            stderr = logs.stderr_lines()
            stderr.on_dropped = metrics.log_lines_dropped.inc
            started.callback(setattr, stderr, "on_dropped", None)  # undone first
            log.info("symgate %s: replica %s, cache %s, database %s, upstreams %s",
                     __version__, replica, config.cache_dir, _safe_url(config.database_url),
                     " ".join(u.name for u in shared))
            yield
            stopping.append(time.monotonic())

    return lifecycle


def _shared_tier(config: Config, repo: Repository, metrics: ProxyMetrics, health: Health,
                 replica: str) -> SharedTier | None:
    """The bucket behind this replica's disk, when [storage] names one."""
    if config.storage is None:
        return None
    from proxy.bucket.objects import Bucket
    from proxy.bucket.tier import SharedTier

    try:
        bucket = Bucket(config.storage, metrics, health)
    except Exception as e:  # obstore's own kinds: an unusable URL or setting
        raise CannotStart(f"cannot use the bucket {config.storage.url}: {e}") from None
    log.info("shared bucket %s%s", config.storage.url,
             f" at {config.storage.endpoint}" if config.storage.endpoint else "")
    return SharedTier(bucket, repo, config.storage, metrics, replica)


def _via_name(config: Config, replica: str) -> str:
    """This server's name in Via, by which a request come round a loop of caches is known:
    the replica's, or with [storage] the cluster's. A replica's miss waits for the fetch
    another replica holds the key's lease for: a loop back to any replica of the cluster
    would wait on the very fetch that waits for it."""
    if config.storage is None:
        return f"symgate-{replica}"
    bucket = f"{config.storage.endpoint} {config.storage.url}".encode()
    return f"symgate-{hashlib.sha256(bucket).hexdigest()[:16]}"


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


async def serve(config: Config, access_log: logging.Logger | None,
                access_log_class: type[logs.AccessLogger], *, port: int | None = None,
                reuse_port: bool = False, serving: Callable[[], None] | None = None,
                worker: int | None = None) -> None:
    """Run `symgate serve` until SIGTERM, SIGINT or SIGHUP. Faults at start raise CannotStart.

    The port is bound before anything else starts, so a busy port is reported before the
    database is touched, and "listening on" is said only once connections are accepted
    (`serving` is called then). As one `worker` of several (proxy.web.supervisor), the port
    is the supervisor's, shared with SO_REUSEPORT, and metrics are the multiprocess kind.
    """
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(logs.loop_exception_handler)
    fd_limit = raise_fd_limit()
    max_connections = config.server.max_connections or default_max_connections(fd_limit)
    host, listen_port = parse_listen(config.server.listen, "server.listen")
    port = listen_port if port is None else port
    make_data_dirs(config)
    sink = logs.AccessSink(logs.stderr_lines()) if access_log is not None else None
    if sink is not None:
        access_log_class = logs.bind(access_log_class, sink)
    runner = web.AppRunner(
        create_app(config, one_of_several=worker is not None), handle_signals=False,
        access_log=access_log, access_log_class=access_log_class,
        # aiohttp's keep-alive timer closes a kept-alive connection whose next request head
        # is not complete in time: between requests, it is the header timeout.
        keepalive_timeout=config.server.header_timeout_s,
        shutdown_timeout=_CUT_S, **body_options())

    def protocol() -> asyncio.BaseProtocol:
        assert runner.server is not None  # set up before the socket starts serving
        return runner.server()

    guard = ConnectionGuard(protocol, max_connections, config.server.retry_after_s,
                            config.server.header_timeout_s, config.server.send_timeout_s)
    try:
        server = await loop.create_server(guard, host, port, reuse_address=True,
                                          reuse_port=reuse_port or None, backlog=1024,
                                          start_serving=False)
    except OSError as e:
        raise CannotStart(f"cannot listen on {config.server.listen}: "
                          f"{reason(e)}") from None
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        if not await _started(runner, stop, config):
            log.info("stopped while starting")
            return
        guard.quick = FastHits(runner.app[STATE], None if access_log is None
                               else access_log_class(access_log, ""))
        guard.send_timeouts = runner.app[STATE].send_timeouts
        guard.watch(runner.app[STATE].metrics)
        await server.start_serving()
        if serving is not None:
            serving()
        bound = server.sockets[0].getsockname()
        where = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
        log.info("symgate %s%s listening on http://%s/ (up to %d connections; open files "
                 "limit %d)", __version__, "" if worker is None else f" worker {worker}",
                 where, max_connections, fd_limit)
        await stop.wait()
        log.info("stopping: responses under way have %.1f s to finish (a second stop signal "
                 "cuts them now)", config.server.shutdown_grace_s)
        cut = asyncio.Event()
        stopped_at = loop.time()

        def cut_now() -> None:
            # A Ctrl-C or a hangup reaches the terminal's whole process group, and the
            # supervisor passes it on as SIGTERM too: one stop arrives twice at once.
            if not cut.is_set() and loop.time() - stopped_at >= _SAME_STOP_S:
                log.info("stopping now: responses under way are cut")
                cut.set()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, cut_now)
        server.close()  # no new connections; idle kept-alive ones are closed by the drain
        guard.close_quick()  # and those aiohttp was never told of
        assert runner.server is not None
        # aiohttp's connections sending a quick file are the guard's to finish, then close.
        await asyncio.gather(_drain(runner.server, config.server.shutdown_grace_s,
                                    guard.sending_for_aiohttp(), cut),
                             guard.finish_sends(config.server.shutdown_grace_s, cut))
    finally:
        server.close()
        await runner.cleanup()
        if sink is not None:
            sink.flush()


async def _started(runner: web.AppRunner, stop: asyncio.Event, config: Config) -> bool:
    """Set the application up, unless a stop signal comes first: False then, with what it had
    started stopped again. A start can take minutes (a local directory of 100,000 files
    walked): a deploy's SIGTERM meanwhile waited for all of it, past a service manager's
    patience, and the server said it was listening just to stop."""
    setup = asyncio.ensure_future(runner.setup())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait((setup, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not setup.done():
        setup.cancel()
        await asyncio.gather(setup, return_exceptions=True)  # a fault meanwhile: no matter
        return False
    try:
        setup.result()
    except Exception as e:
        raise startup_error(config, e) from None
    return True


def body_options() -> dict[str, Any]:
    """How the server reads request bodies (AppRunner's options): the tests' servers are
    run with them too.

    No body is inflated by aiohttp, on the loop: it inflates a refused one as well as it drains
    it (a gzip bomb held the loop 10 s). The handlers that take bodies inflate them in threads,
    bounded (proxy.web.content_encoding)."""
    return {"auto_decompress": False, "lingering_time": _LINGER_S}


# How long the rest of a refused body is read and thrown away, so that the client, still
# sending, reads the answer rather than a reset. aiohttp's 10 s held a connection that long for
# a client that sends slowly; a client on a fast path is done well within this.
_LINGER_S = 1.0

# Stop signals this close to the first are the same stop (cut_now in serve()).
_SAME_STOP_S = 1.0

# Past the grace, aiohttp's shutdown(timeout) of a connection waits this long for its handler,
# then cancels it and waits as long again before closing the connection regardless.
_CUT_S = 0.05


async def _drain(server: web.Server, grace_s: float,
                 sending: set[asyncio.BaseProtocol], cut: asyncio.Event) -> None:
    """Let requests under way finish for up to `grace_s` (until `cut` is set, if sooner),
    then cut them: aiohttp's own
    shutdown(timeout) waits the timeout twice over (once for the handler, once more for its
    cancellation), so the grace is kept here. The connections in `sending` are left alone:
    idle to aiohttp, each is sending a file and closes once it is out."""
    # server.pre_shutdown(), but for them: idle connections close now, busy ones after their
    # response.
    ours = [conn for conn in server.connections if conn not in sending]
    for conn in ours:
        conn.close()
    waits = [asyncio.create_task(conn.shutdown(grace_s)) for conn in ours]
    if not waits:
        return
    late = await unfinished(waits, grace_s, cut)
    for conn, wait in zip(ours, waits, strict=True):
        if wait in late and conn.transport is not None:
            # Its response is cut: aiohttp closes the connection (a FIN) before the handler
            # sees its cancellation, which finds no transport left to cut_off with a reset,
            # and a hit's body short by a FIN is a partial file to libcurl, kept by elfutils'
            # client as a miss for ten minutes.
            reset_on_close(conn.transport.get_extra_info("socket"))
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    await asyncio.gather(*(conn.shutdown(_CUT_S) for conn in server.connections
                           if conn not in sending), return_exceptions=True)


def startup_error(config: Config, e: Exception) -> Exception:
    """A failure while the components start, as one line where it is a known fault."""
    from sqlalchemy.exc import SQLAlchemyError

    where = _safe_url(config.database_url) if _parses(config.database_url) \
        else "the configured URL"
    if isinstance(e, migrate.UnknownRevision):
        return CannotStart(f"cannot use the database at {where}: {e}")
    if isinstance(e, SQLAlchemyError):
        text = str(getattr(e, "orig", None) or e).splitlines()[0]
        # A table missing (no schema), or a column (one from before a later migration:
        # SQLite's "no such column", PostgreSQL's "column ... does not exist").
        if "no such table" in text or "no such column" in text or (
                ("relation" in text or "column" in text) and "does not exist" in text):
            return CannotStart(f"the database at {where} has no symgate schema, or an old one: "
                               "run `symgate db upgrade` (or let serve migrate: without "
                               "--no-migrate, and database.migrate_on_start = true)")
        return CannotStart(f"cannot use the database at {where}: {text}")
    if isinstance(e, TimeoutError):  # connecting, past database.timeout_s: says nothing more
        return CannotStart(f"cannot reach the database at {where}: no answer within "
                           f"database.timeout_s ({config.database.timeout_s:g} s)")
    if isinstance(e, OSError):
        if e.filename:
            return CannotStart(f"cannot start: {reason(e)}")
        return CannotStart(f"cannot reach the database at {where}: {reason(e)}")
    return e


def _parses(url: str) -> bool:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url)
    except ArgumentError:
        return False
    return True
