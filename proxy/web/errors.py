"""The one mapping from failures to HTTP statuses."""

from __future__ import annotations

from aiohttp import web

from proxy.errors import (
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
