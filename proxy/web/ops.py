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
                         upstreams=[u.name for u in state.tenancy.shared_sources],
                         started=state.started, recent=state.recent_misses,
                         max_bytes=state.config.cache.max_bytes, degraded=health.conditions)
    return web.Response(text=html, content_type="text/html")


async def healthz(request: web.Request) -> web.Response:
    """503 while the database is unreachable; 200 "degraded" with the reasons while the server
    works but not fully (its disk is full: hits are served, misses are refused with 507)."""
    state = request.app[STATE]
    health = state.service.cache.health
    try:
        await state.ping_database()
    except Exception as e:  # any failure to reach SQL is "unhealthy", whatever its type
        health.fail(DATABASE, f"unreachable: {type(e).__name__}")
        return web.Response(status=503, text=f"database unreachable: {type(e).__name__}\n")
    health.ok(DATABASE)
    state.service.cache.recheck_space()
    if conditions := health.conditions:
        return web.Response(text="degraded\n" + "".join(
            f"{c.name}: {c.reason}\n" for c in conditions))
    return web.Response(text="ok\n")
