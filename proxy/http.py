"""aiohttp handlers: parse the request, call the service, turn the result into a response.

Every failure becomes a response in one place, `error_response`.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .cache import CachedArtifact
from .errors import (
    InvalidRequest,
    NotCached,
    NotFound,
    OverLimit,
    PayloadTooLarge,
    SymgateError,
    TooLarge,
    UnsupportedMediaType,
    UpstreamTimeout,
    UpstreamUnavailable,
    VerificationFailed,
)
from .flight import FlightFailed
from .keys import ArtifactKey, Kind
from .logs import annotate
from .metrics import Outcome
from .service import Hit, RememberedNotFound, Streaming
from .state import STATE, AppState
from .status import render as render_status

log = logging.getLogger(__name__)
# Bytes a fetch must have received before its response starts (see Flight.wait_streamable).
STREAM_AFTER_BYTES = 1024 * 1024


def error_response(
    error: SymgateError, user_agent: str, retry_after_s: int
) -> web.Response:
    """The one mapping from failures to HTTP statuses."""
    headers: dict[str, str] = {}
    transient = isinstance(error, UpstreamUnavailable | VerificationFailed)
    if isinstance(error, InvalidRequest):
        status = 400
    elif isinstance(error, NotFound):
        status = 404
    elif isinstance(error, TooLarge):
        status = 406
    elif isinstance(error, NotCached):
        status = 504  # what RFC 9111 prescribes for only-if-cached; nothing is retried
    elif isinstance(error, PayloadTooLarge):
        status = 413
    elif isinstance(error, UnsupportedMediaType):
        status = 415
    elif isinstance(error, OverLimit):
        status = 422
    elif transient and user_agent.startswith("elfutils/"):
        # elfutils' client caches every error but 406 as a miss for 10 minutes; a passing
        # upstream outage must not blind gdb and perf users for that long.
        status = 406
    elif isinstance(error, UpstreamTimeout):
        status = 504
    elif transient:
        status = 502
    else:
        status = 500
    if status in (502, 503, 504) and not isinstance(error, NotCached):
        headers["Retry-After"] = str(retry_after_s)
    return web.Response(status=status, text=error.reason + "\n", headers=headers)


def _outcome(error: SymgateError) -> Outcome:
    if isinstance(error, RememberedNotFound):
        return Outcome.NEGATIVE_HIT
    if isinstance(error, NotFound):
        return Outcome.NOT_FOUND
    if isinstance(error, InvalidRequest):
        return Outcome.BAD_REQUEST
    if isinstance(error, NotCached):
        return Outcome.NOT_CACHED
    return Outcome.ERROR


def _artifact_headers(
    size: int | None, filename: str, archive: str | None
) -> dict[str, str]:
    headers = {"Content-Type": "application/octet-stream", "Cache-Control": "public",
               "X-DEBUGINFOD-FILE": filename}
    if size is not None:
        headers["X-DEBUGINFOD-SIZE"] = str(size)
    if archive:
        headers["X-DEBUGINFOD-ARCHIVE"] = archive
    return headers


def _max_size(request: web.Request) -> int | None:
    raw = request.headers.get("X-DEBUGINFOD-MAXSIZE")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise InvalidRequest("invalid X-DEBUGINFOD-MAXSIZE: not a number")
    return int(raw)


def _check_size(size: int | None, max_size: int | None) -> None:
    if max_size is not None and size is not None and size > max_size:
        raise TooLarge(f"file is {size} bytes, larger than X-DEBUGINFOD-MAXSIZE {max_size}")


def _forwarded_for(request: web.Request, limit: int) -> tuple[str, bool]:
    """The X-Forwarded-For to send upstream, and whether this hop may still go upstream."""
    incoming = request.headers.get("X-Forwarded-For", "")
    hops = [h.strip() for h in incoming.split(",") if h.strip()]
    return ", ".join([*hops, request.remote or "unknown"]), len(hops) < limit


async def buildid(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    m = request.match_info
    kind = m["kind"] if m["kind"] in Kind.__members__.values() else "invalid"
    try:
        key = ArtifactKey.parse(m["build_id"], m["kind"], m.get("detail", ""))
        max_size = _max_size(request)
        chain, may_fetch = _forwarded_for(request, state.config.server.forwarded_ttl_limit)
        only_if_cached = "only-if-cached" in request.headers.get("Cache-Control", "")
        result = await state.service.find(key, chain, may_fetch=may_fetch,
                                          cache_only=only_if_cached)
        if isinstance(result, Hit):
            _check_size(result.artifact.record.size, max_size)
            state.metrics.requests.labels("buildid", kind, Outcome.HIT).inc()
            annotate(request, kind=kind, outcome=Outcome.HIT.value,
                     upstream=result.artifact.record.upstream)
            return _LeasedFileResponse(state, key, result.artifact)
        try:
            _check_size(result.meta.size, max_size)
            state.metrics.requests.labels("buildid", kind, Outcome.MISS).inc()
            annotate(request, kind=kind, outcome=Outcome.MISS.value,
                     upstream=result.meta.upstream)
            return await _send_streaming(request, state, key, result)
        finally:
            result.reader.close()
    except SymgateError as e:
        outcome = _outcome(e)
        state.metrics.requests.labels("buildid", kind, outcome).inc()
        annotate(request, kind=kind, outcome=outcome.value, error=e.reason)
        if outcome is not Outcome.BAD_REQUEST:
            state.recent_misses.add(request.path.removeprefix("/buildid/"), outcome.value,
                                    e.reason)
        return error_response(e, request.headers.get("User-Agent", ""),
                              state.config.server.retry_after_s)


class _LeasedFileResponse(web.FileResponse):
    """A FileResponse that holds the cache lease while aiohttp sends the file.

    aiohttp prepares a FileResponse itself once the handler returns, so the lease has to live
    here rather than in the handler.
    """

    def __init__(self, state: AppState, key: ArtifactKey, artifact: CachedArtifact) -> None:
        rec = artifact.record
        super().__init__(artifact.path,
                         headers=_artifact_headers(rec.size, rec.filename, rec.archive))
        self._symgate = state
        self._key = key

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        with self._symgate.service.cache.lease(self._key):
            writer = await super().prepare(request)
        if request.method != "HEAD":
            self._symgate.metrics.served_bytes.labels("cache").inc(self.content_length or 0)
        return writer


async def _send_streaming(
    request: web.Request, state: AppState, key: ArtifactKey, streaming: Streaming
) -> web.StreamResponse:
    meta = streaming.meta
    flight = streaming.flight
    size = meta.size
    if request.method == "HEAD" and size is None:
        await flight.wait_finished()  # HEAD must tell the real size: wait for the whole file
    else:
        await flight.wait_streamable(STREAM_AFTER_BYTES)
    if flight.error is not None:
        raise flight.error
    if size is None and flight.succeeded:
        size = flight.written
    headers = _artifact_headers(size, meta.filename or key.default_filename, meta.archive)
    if meta.last_modified:
        headers["Last-Modified"] = meta.last_modified
    response = web.StreamResponse(headers=headers)
    if size is not None:
        response.content_length = size
    await response.prepare(request)
    if request.method == "HEAD":
        await response.write_eof()
        return response
    sent = 0
    try:
        async for chunk in streaming.reader.chunks():
            await response.write(chunk)
            sent += len(chunk)
    except FlightFailed as e:
        state.metrics.aborted_responses.inc()
        annotate(request, outcome="aborted", error=e.error.reason)
        log.warning("cutting off %s after %d bytes: %s", request.path, sent, e)
        # The status line is gone already; the only honest signal left is a broken
        # connection, never a short body that a client could take for the whole file.
        if request.transport is not None:
            request.transport.abort()
        return response
    finally:
        state.metrics.served_bytes.labels("upstream").inc(sent)
    await response.write_eof()
    return response


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = generate_latest(state.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def status_page(request: web.Request) -> web.Response:
    state = request.app[STATE]
    html = render_status(registry=state.registry,
                         upstreams=[u.name for u in state.service.upstreams],
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
