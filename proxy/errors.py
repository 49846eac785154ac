"""The few failures a request can end in. proxy.http maps each to one HTTP status."""

from __future__ import annotations


class SymgateError(Exception):
    """Base of every failure that is answered to a client rather than crashing."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InvalidRequest(SymgateError):
    """The client's request is malformed: a bad build ID, a bad source path, a bad header."""


class NotFound(SymgateError):
    """No upstream has the artifact (possibly remembered from an earlier miss)."""


class TooLarge(SymgateError):
    """The artifact is larger than the client's X-DEBUGINFOD-MAXSIZE."""


class PayloadTooLarge(SymgateError):
    """A request body is larger than allowed, before or after decompression."""


class UnsupportedMediaType(SymgateError):
    """A request body of a type the endpoint does not read (not a pprof profile's)."""


class OverLimit(SymgateError):
    """A well-formed request asks for more work than one request may (e.g. too many mappings)."""


class UpstreamUnavailable(SymgateError):
    """No upstream could answer: connect errors, resets, 5xx, or an open circuit breaker."""


class UpstreamTimeout(UpstreamUnavailable):
    """An upstream did not answer, or stopped sending, within its time limits."""


class VerificationFailed(SymgateError):
    """An upstream sent bytes that are not what was asked for (wrong build ID, truncated)."""


class NotCached(SymgateError):
    """Cache-Control: only-if-cached asked for an artifact that is not in the cache."""
