"""aiohttp handlers: parse the request, call the service, turn the result into a response.

Every failure becomes a response in one place, `error_response`.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from proxy.artifacts.flight import FlightFailed
from proxy.artifacts.index import CachedArtifact
from proxy.artifacts.service import Hit, RememberedNotFound, Streaming
from proxy.errors import (
    InvalidRequest,
    NotCached,
    NotFound,
    SymgateError,
    TooLarge,
)
from proxy.keys import ArtifactKey, Kind
from proxy.metrics import Outcome
from proxy.web.errors import error_response
from proxy.web.logs import annotate
from proxy.web.state import STATE, AppState

log = logging.getLogger(__name__)
# Bytes a fetch must have received before its response starts (see Flight.wait_streamable).
STREAM_AFTER_BYTES = 1024 * 1024


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
