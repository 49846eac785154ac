"""POST /symbolize: a pprof profile in, the same profile with native frames symbolized out.

Tenants are told apart by X-Scope-OrgID, as in Pyroscope and other Grafana backends.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from aiohttp import web

from proxy.errors import (
    InvalidRequest,
    OverLimit,
    PayloadTooLarge,
    SymgateError,
    UnsupportedMediaType,
)
from proxy.symbols.resolver import Outcome
from proxy.web.errors import error_response
from proxy.web.logs import annotate
from proxy.web.state import STATE, AppState
from symbolize.pprof.codec import ProfileError, ProfileTooLarge, decode, encode
from symbolize.rewrite import MappingSymbols, Report, candidates, rewrite

ACCEPTED_TYPES = ("application/octet-stream", "application/x-protobuf",
                  "application/vnd.google.protobuf", "")


async def _read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    # read(n) returns what is buffered, not n bytes: read to the end, stopping past the limit.
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(1 << 20):
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _headers(report: Report, state: str) -> dict[str, str]:
    def fmt(counts: Counter[str]) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"

    return {
        "X-Symgate-Symbolize": state,
        "X-Symgate-Mappings-Symbolized": str(report.mappings_symbolized),
        "X-Symgate-Mappings-Unsymbolized": fmt(report.mappings_skipped),
        "X-Symgate-Locations-Symbolized": str(report.locations_symbolized),
        "X-Symgate-Locations-Unresolved": fmt(report.locations_unresolved),
    }


async def symbolize(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    started = time.perf_counter()
    try:
        response = await _symbolize(request, state)
    except SymgateError as e:
        state.symbolize_metrics.profiles.labels("rejected").inc()
        annotate(request, outcome="rejected", error=e.reason)
        return error_response(e, "", state.config.server.retry_after_s)
    finally:
        state.symbolize_metrics.duration.observe(time.perf_counter() - started)
    return response


async def _symbolize(request: web.Request, state: AppState) -> web.Response:
    cfg = state.config.symbolize
    ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if ctype not in ACCEPTED_TYPES:
        raise UnsupportedMediaType(f"unsupported Content-Type {ctype!r}: send a pprof profile "
                                   "as application/octet-stream or application/x-protobuf")
    body = await _read_body(request, cfg.max_request_bytes)
    tenant_id = request.headers.get("X-Scope-OrgID", "")
    tenant = state.config.tenants.get(tenant_id)
    metrics = state.symbolize_metrics
    if not cfg.enabled or (tenant is not None and not tenant.symbolize):
        metrics.profiles.labels("disabled").inc()
        annotate(request, outcome="disabled", tenant=tenant_id)
        return web.Response(body=body, content_type="application/octet-stream",
                            headers={"X-Symgate-Symbolize": "disabled"})
    try:
        decoded = await asyncio.to_thread(decode, body, cfg.max_decompressed_bytes)
    except ProfileTooLarge as e:
        raise PayloadTooLarge(str(e)) from None
    except ProfileError as e:
        raise InvalidRequest(str(e)) from None
    profile = decoded.profile
    report = Report()
    wanted = candidates(profile, report)
    build_ids = set(wanted.values())
    if len(build_ids) > cfg.max_mappings:
        raise OverLimit(f"profile has {len(build_ids)} build IDs to symbolize; the limit is "
                        f"{cfg.max_mappings} per request")
    needs_layout = {bid: False for bid in build_ids}
    for m in profile.mapping:
        if m.id in wanted and (m.memory_start or m.file_offset):
            needs_layout[wanted[m.id]] = True
    upstreams = state.tenant_upstreams.get(tenant_id)
    forwarded_for = request.remote or "unknown"
    tasks = {
        bid: asyncio.ensure_future(state.symbols.symbols_for(
            bid, needs_layout=needs_layout[bid], forwarded_for=forwarded_for,
            upstreams=upstreams))
        for bid in build_ids
    }
    if tasks:
        await asyncio.wait(tasks.values(), timeout=cfg.deadline_s)
    symbols: dict[str, MappingSymbols] = {}
    reasons: dict[str, str] = {}
    for bid, task in tasks.items():
        if not task.done():
            task.cancel()  # the shared build goes on (shielded) and warms the next request
            reasons[bid] = "deadline"
            continue
        if task.exception() is not None:  # logged where it happened; one mapping, not all
            reasons[bid] = "error"
            continue
        outcome: Outcome = task.result()
        if outcome.symbols is not None:
            symbols[bid] = outcome.symbols
        else:
            reasons[bid] = outcome.reason
    for _mid, bid in wanted.items():
        if bid in reasons:
            report.mappings_skipped[reasons[bid]] += 1
    wanted_with_symbols = {mid: bid for mid, bid in wanted.items() if bid in symbols}
    if wanted_with_symbols:
        try:
            await asyncio.to_thread(rewrite, profile, wanted_with_symbols, symbols,
                                    state.symbols.function_ids, report)
        except ProfileError as e:  # a location that is not a Location message
            raise InvalidRequest(str(e)) from None
    _count(state, report)
    annotate(request, outcome="symbolized" if report.changed else "unchanged",
             mappings_symbolized=report.mappings_symbolized,
             locations_symbolized=report.locations_symbolized,
             tenant=tenant_id or None)
    if not report.changed:
        # Nothing filled in: the client gets its own bytes back, untouched.
        metrics.profiles.labels("unchanged").inc()
        return web.Response(body=body, content_type="application/octet-stream",
                            headers=_headers(report, "unchanged"))
    out = await asyncio.to_thread(encode, profile, decoded.gzipped)
    metrics.profiles.labels("symbolized").inc()
    return web.Response(body=out, content_type="application/octet-stream",
                        headers=_headers(report, "symbolized"))


def _count(state: AppState, report: Report) -> None:
    m = state.symbolize_metrics
    if report.mappings_symbolized:
        m.mappings.labels("symbolized").inc(report.mappings_symbolized)
    for reason, n in report.mappings_skipped.items():
        m.mappings.labels(reason).inc(n)
    if report.locations_symbolized:
        m.locations.labels("symbolized").inc(report.locations_symbolized)
    for reason, n in report.locations_unresolved.items():
        m.locations.labels(reason).inc(n)
