"""Endpoints for operators: /metrics, /healthz and the status page at /."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.web.state import STATE
from proxy.web.status_page import render as render_status


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = generate_latest(state.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def status_page(request: web.Request) -> web.Response:
    state = request.app[STATE]
    html = render_status(registry=state.registry,
                         upstreams=[u.name for u in state.tenancy.shared_sources],
                         started=state.started, recent=state.recent_misses,
                         max_bytes=state.config.cache.max_bytes)
    return web.Response(text=html, content_type="text/html")


async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        await state.ping_database()
    except Exception as e:  # any failure to reach SQL is "unhealthy", whatever its type
        return web.Response(status=503, text=f"database unreachable: {type(e).__name__}\n")
    return web.Response(text="ok\n")
