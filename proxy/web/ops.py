"""Endpoints for operators: /metrics, /healthz and the status page at /."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.health import DATABASE
from proxy.web.state import STATE
from proxy.web.status_page import render as render_status


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = generate_latest(state.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def status_page(request: web.Request) -> web.Response:
    state = request.app[STATE]
    health = state.service.cache.health
    state.service.cache.recheck_space()
    html = render_status(registry=state.registry,
                         upstreams=[u.label for u in state.tenancy.shared_sources],
                         started=state.started, recent=state.recent_misses,
                         max_bytes=state.config.cache.max_bytes, degraded=health.conditions)
    return web.Response(text=html, content_type="text/html")


async def healthz(request: web.Request) -> web.Response:
    """200 "ok"; or 200 "degraded" with one `name: reason` line each while the server works but
    not fully (database unreachable: hits and misses are still served, rows written later; disk
    full: hits are served, misses refused with 507). Still 200: a probe that pulled or restarted
    every replica during a database blip would turn a degraded service into an outage."""
    state = request.app[STATE]
    health = state.service.cache.health
    try:
        await state.ping_database()
    except Exception as e:  # any failure to reach SQL is "unreachable", whatever its type
        health.fail(DATABASE, f"unreachable: {type(e).__name__}")
    else:
        if state.repo.file_gone():
            # Its connections answer (the file they opened is still open), but what they
            # write is lost at a restart, which finds another file or none.
            health.fail(DATABASE, f"the file {state.repo.sqlite_file} was deleted or "
                        "replaced while in use; restart symgate")
        # Reached, but not written to while rows wait for it: a read-only SQLite file answers
        # a ping (a read) and refuses every write. Those rows' flush says when it is well.
        elif not state.service.cache.rows_pending:
            health.ok(DATABASE)
    state.service.cache.recheck_space()
    if conditions := health.conditions:
        return web.Response(text="degraded\n" + "".join(
            f"{c.name}: {c.reason}\n" for c in conditions))
    return web.Response(text="ok\n")
