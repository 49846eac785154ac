"""The error edge: the one mapping from failures to HTTP statuses, and the middleware that
turns every exception a handler raises into that status, the access-log fields, the metrics
and the status page's recent misses. Handlers parse, call and respond; they do not catch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from proxy.errors import (
    BuildBoundTooLow,
    Conflict,
    DatabaseUnavailable,
    Forbidden,
    InsufficientStorage,
    InvalidRequest,
    NotCached,
    NotFound,
    OutOfResources,
    OverLimit,
    Overloaded,
    PayloadTooLarge,
    RememberedNotFound,
    RequestTimeout,
    SourceEvicted,
    SymgateError,
    TooLarge,
    Unauthorized,
    UnprocessableUpload,
    UnsupportedMediaType,
    UploadBudgetFull,
    UpstreamTimeout,
    UpstreamUnavailable,
    VerificationFailed,
    WorkerLost,
    out_of_descriptors,
)
from proxy.headers import MAX_RETRY_AFTER_S
from proxy.metrics import ABORTED, Served
from proxy.web.file_sends import cut_connection
from proxy.web.hot_files import ARTIFACT_VARY, private_to_asker
from proxy.web.logs import LOG_FIELDS, annotate
from proxy.web.state import STATE
from symbolize.otlp import TooManyLocations
from symbolize.outcome import Outcome
from symbolize.pipeline import TablesGone, TooManyBuildIds, TooMuchWork
from symbolize.pprof.codec import ProfileError, ProfileTooLarge, TooManyEntries

log = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Most specific first: the first class an error is an instance of gives its status.
STATUS: tuple[tuple[type[SymgateError], int], ...] = (
    (InvalidRequest, 400),
    (Unauthorized, 401),
    (Forbidden, 403),
    (NotFound, 404),
    (TooLarge, 406),
    (PayloadTooLarge, 413),
    (RequestTimeout, 408),
    (UnsupportedMediaType, 415),
    (OverLimit, 422),
    (UnprocessableUpload, 422),
    (Conflict, 409),
    (Overloaded, 429),
    (NotCached, 504),  # what RFC 9111 prescribes for only-if-cached; nothing is retried
    (UpstreamTimeout, 504),
    (UpstreamUnavailable, 502),
    (VerificationFailed, 502),
    (InsufficientStorage, 507),
    (UploadBudgetFull, 507),  # RFC 4918: the server cannot store what it must to answer
    (WorkerLost, 503),
    (BuildBoundTooLow, 503),
    (SourceEvicted, 503),
    (OutOfResources, 503),
    (DatabaseUnavailable, 503),
    (SymgateError, 500),
)


_STATUS_OF_TYPE = dict(STATUS)


def as_symgate_error(error: Exception) -> SymgateError:
    """The symbolization pipeline's own failures, and aiohttp's about a request's body, in the
    server's words."""
    if isinstance(error, SymgateError):
        return error
    if isinstance(error, ProfileTooLarge):
        return PayloadTooLarge(str(error))
    if isinstance(error, (TooManyBuildIds, TooMuchWork, TooManyLocations, TooManyEntries)):
        return OverLimit(str(error))
    if isinstance(error, ProfileError):
        return InvalidRequest(str(error))
    if isinstance(error, TablesGone):
        return SourceEvicted(str(error))
    if isinstance(error, OSError) and (full := out_of_descriptors(error)) is not None:
        # No descriptor for a profile's memory file (proxy.symbols.shared_bodies) or its
        # answer's mapping: a passing condition of the server, as for a /buildid hit (a 503
        # with Retry-After), never a 500.
        return full
    if isinstance(error, web.RequestPayloadError):
        # aiohttp's, for a body it cannot read as its headers say: a broken chunked encoding.
        # (A Content-Encoding is symgate's to inflate: proxy.web.content_encoding.)
        return InvalidRequest(f"the request body is unreadable: {error}")
    return SymgateError("internal error")


def status_of(error: SymgateError, user_agent: str = "") -> int:
    if ((error.outcome in (Outcome.TIMEOUT, Outcome.UPSTREAM_ERROR, Outcome.MALFORMED)
         or isinstance(error, InsufficientStorage))
            and user_agent.startswith("elfutils/")
            # Not to another symgate that relays an elfutils client's User-Agent (with its
            # own appended): it gives its client the 406 itself, and needs the real status
            # (and Retry-After) to retry, rest its breaker and tell what failed.
            and not user_agent.rsplit(" ", 1)[-1].startswith("symgate/")):
        # elfutils' client caches every error but 406 as a miss for 10 minutes; a passing
        # upstream outage (or full disk) must not blind gdb and perf users for that long.
        return 406
    return _STATUS_OF_TYPE.get(type(error)) or next(
        status for cls, status in STATUS if isinstance(error, cls))


def _retry_after(error: SymgateError, default_s: int) -> int:
    """The server's Retry-After, or the longer wait the upstream itself asked for: a client
    sent back sooner meets the same refusal, and adds to the load it was refused for."""
    asked = error.retry_after_s if isinstance(error, UpstreamUnavailable) else None
    if asked is None:
        return default_s
    return max(default_s, min(math.ceil(asked), MAX_RETRY_AFTER_S))


def error_response(error: SymgateError, user_agent: str, retry_after_s: int, *,
                   artifact: bool = False) -> web.Response:
    """`artifact`: the answer to a /buildid request, which varies on the tenant as a file's
    does (hot_files.ARTIFACT_VARY): one tenant's miss is not another's."""
    status = status_of(error, user_agent)
    headers: dict[str, str] = {"Vary": ARTIFACT_VARY} if artifact else {}
    if status in (429, 502, 503, 504, 507) and not isinstance(error, (NotCached,
                                                                       UploadBudgetFull)):
        headers["Retry-After"] = str(_retry_after(error, retry_after_s))
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="symgate"'
    return web.Response(status=status, text=error.reason + "\n", headers=headers)


def outcome_label(error: SymgateError) -> str:
    """The `outcome` a failed request is counted and logged under."""
    return Served.NEGATIVE_HIT if isinstance(error, RememberedNotFound) else error.outcome


@web.middleware
async def error_edge(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.perf_counter()
    try:
        response = await handler(request)
    except web.HTTPException:  # aiohttp's own answers (no such route, wrong method)
        raise
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or not task.cancelling():
            raise
        # The server stopping, past its grace (proxy.web.app._drain), cut the request before
        # its handler answered (a miss whose upstream had not, a profile being worked on).
        # Raised on, it had no access line and no count, as if it had never been; the
        # connection is cut all the same, and the status is for the log alone.
        cut_off(request, "the server stopped")
        _count(request, time.perf_counter() - started)
        task.uncancel()  # taken in: what runs on (aiohttp's logging) is not cancelled
        return web.Response(status=503)
    except Exception as e:
        if request.writer is not None and request.writer.output_size > 0:
            _cut_off(request, e, time.perf_counter() - started)
            raise
        if isinstance(e, ConnectionError):
            # The client left while its request was read: nobody to answer, and no fault of
            # ours to log. Raising would have aiohttp log a traceback for it; the status is
            # nginx's "client closed request", for the access log alone.
            _cut_off(request, e, time.perf_counter() - started)
            return web.Response(status=CLIENT_CLOSED_REQUEST)
        error = as_symgate_error(e)
        if type(error) is SymgateError:
            log.exception("%s %s failed", request.method, request.path)
        response = _answer(request, error)
    if isinstance(response, CountedWhenSent):
        request[_STARTED] = started  # counted by the response, once its body is out or cut
        return response
    _count(request, time.perf_counter() - started)
    return response


def _answer(request: web.Request, error: SymgateError) -> web.Response:
    """The response to a failed request, its outcome annotated for the log and the count."""
    state = request.app[STATE]
    outcome = outcome_label(error)
    annotate(request, outcome=outcome, error=error.reason)
    fields = _fields(request)
    # A tenant's misses name its private build IDs, source paths and servers: the page at /
    # is public. Any tenant's, not only one with sources of its own: one without shares the
    # shared scope's misses, but what it asks for is its own business.
    if (fields.get("endpoint") == "buildid" and error.outcome is not Outcome.REJECTED
            and not fields.get("tenant")):
        state.recent_misses.add(request.path.lstrip("/").removeprefix("buildid/"), outcome,
                                error.reason)
    buildid = fields.get("endpoint") == "buildid"
    response = error_response(error, request.headers.get("User-Agent", ""),
                              state.config.server.retry_after_s, artifact=buildid)
    if buildid:
        response.headers.update(private_to_asker(request))
    return response


def refuse_before_handler(request: web.Request, error: SymgateError, started: float
                          ) -> web.Response:
    """A request refused by its route's expect handler (`Expect: 100-continue`), which aiohttp
    runs before any middleware: answered, logged and counted as error_edge would have, not
    left out of requests_total and logged without its outcome."""
    response = _answer(request, error)
    _count(request, time.perf_counter() - started)
    return response


_STARTED: web.RequestKey[float] = web.RequestKey("symgate.started", float)


class CountedWhenSent:
    """A response whose body aiohttp sends after the handler has returned (a cached file,
    with sendfile): it counts its request itself, once that body is out or cut off, by
    calling sent(). Counted on the handler's return, a hit whose client left mid-body (or
    was cut by the end of the shutdown grace) was a `hit`, where a download cut the same way
    is `aborted`, as the outcome is documented."""

    def sent(self, request: web.BaseRequest, cut: BaseException | None) -> None:
        """Count (and log) the request: `cut` is what ended its body short, if anything."""
        if cut is not None:
            annotate(request, outcome=ABORTED, error=cut_reason(cut))
            # Cut as cut_off cuts, with a reset: closed by aiohttp, a body cut short (a file
            # found short on disk, which the next request fetches anew) ended with a FIN, a
            # partial file that elfutils' client keeps as a miss for ten minutes.
            if request.transport is not None:
                cut_connection(request.transport)
        if isinstance(request, web.Request) and (started := request.get(_STARTED)) is not None:
            _count(request, time.perf_counter() - started)


def cut_reason(cut: BaseException) -> str:
    """What ended a body short, in an access line: the error's text ("[Errno 110]
    Connection timed out", a send cut for not reading), else its class. The quick path's
    (proxy.web.fast_hits) and aiohttp's say it alike."""
    return str(cut) or type(cut).__name__


def cut_off(request: web.BaseRequest, reason: str, sent: int | None = None) -> None:
    """A response that cannot end as it began (a failure, or a client gone, after the status
    line): no second response can be written into the body, so the connection is cut and the
    client sees a broken transfer, never a short body that looks whole. Logged as aborted, with
    the body's bytes that went out where the caller knows them."""
    annotate(request, outcome=ABORTED, error=reason,
             **({"sent": sent} if sent is not None else {}))
    if request.transport is not None:
        cut_connection(request.transport)


def _cut_off(request: web.Request, error: Exception, seconds: float) -> None:
    if not isinstance(error, ConnectionError):  # a client that left is not our failure
        log.exception("%s %s failed mid-response", request.method, request.path)
    cut_off(request, str(error) or type(error).__name__)
    _count(request, seconds)


def _fields(request: web.Request) -> dict[str, object]:
    fields: dict[str, object] = request.get(LOG_FIELDS, {})
    return fields


def _count(request: web.Request, seconds: float) -> None:
    """One count per request, by what its handler annotated and how it ended."""
    fields = _fields(request)
    endpoint, outcome = fields.get("endpoint"), str(fields.get("outcome", ""))
    state = request.app[STATE]
    if endpoint == "buildid":
        state.metrics.count_buildid(str(fields.get("kind", "invalid")), outcome)
    elif endpoint in ("metadata", "upload"):
        state.metrics.requests.labels(endpoint, str(fields.get("kind", "invalid")), outcome).inc()
    elif endpoint == "symbolize":
        state.symbolize_metrics.profiles.labels(outcome).inc()
        state.symbolize_metrics.duration.observe(seconds)
