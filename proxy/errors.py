"""The few failures a request can end in, each with its outcome.

proxy/web/errors.py maps each to one HTTP status; nothing else chooses a status.
"""

from __future__ import annotations

import errno
from typing import ClassVar

from symbolize.outcome import Outcome, TryAgain


class SymgateError(Exception):
    """Base of every failure that is answered to a client rather than crashing."""

    outcome: ClassVar[Outcome] = Outcome.INTERNAL

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class InvalidRequest(SymgateError):
    """The client's request is malformed: a bad build ID, a bad source path, a bad header."""

    outcome = Outcome.REJECTED


class Unauthorized(SymgateError):
    """The request names a tenant that has tokens, without one of them."""

    outcome = Outcome.REJECTED


class Forbidden(SymgateError):
    """The request's token is known, but does not allow what it asks (an upload)."""

    outcome = Outcome.REJECTED


class NotFound(SymgateError):
    """No source has the artifact."""

    outcome = Outcome.NOT_FOUND


class RememberedNotFound(NotFound):
    """A 404 answered from the remembered misses, without asking any upstream."""

    def __init__(self, reason: str = "not found (remembered miss)") -> None:
        super().__init__(reason)


class TooLarge(SymgateError):
    """The artifact is larger than the client's X-DEBUGINFOD-MAXSIZE."""

    outcome = Outcome.REJECTED


class PayloadTooLarge(SymgateError):
    """A request body is larger than allowed, before or after decompression."""

    outcome = Outcome.REJECTED


class UnsupportedMediaType(SymgateError):
    """A request body of a type the endpoint does not read (not a pprof profile's)."""

    outcome = Outcome.REJECTED


class OverLimit(SymgateError):
    """A well-formed request asks for more work than one request may (e.g. too many mappings)."""

    outcome = Outcome.REJECTED


class UnprocessableUpload(SymgateError):
    """An upload that is not the file its URL names: no ELF build-ID note, or another one."""

    outcome = Outcome.REJECTED


class Conflict(SymgateError):
    """An upload of another file under a key that already has one: delete that first."""

    outcome = Outcome.REJECTED


class UpstreamUnavailable(SymgateError):
    """No upstream could answer: connect errors, resets, 5xx, an open circuit breaker, or a
    file resting after its failure. `retry_after_s`: how long the upstream itself asked to be
    left alone (its Retry-After), or the file's rest has left, which its clients are not told
    to come back before."""

    outcome = Outcome.UPSTREAM_ERROR

    def __init__(self, reason: str, retry_after_s: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after_s = retry_after_s


class UpstreamTimeout(UpstreamUnavailable):
    """An upstream did not answer, or stopped sending, within its time limits."""

    outcome = Outcome.TIMEOUT


class VerificationFailed(SymgateError):
    """An upstream sent bytes that are not what was asked for (wrong build ID, truncated)."""

    outcome = Outcome.MALFORMED


class NotCached(SymgateError):
    """Cache-Control: only-if-cached asked for an artifact that is not in the cache."""

    outcome = Outcome.NOT_CACHED


class InsufficientStorage(SymgateError, TryAgain):
    """The disk (or quota) holding the cache or its database is full: answered 507 with
    Retry-After, since space comes back as eviction and operators free it. A profile that
    needs a file or a table it cannot store is refused whole, like one whose worker died."""

    outcome = Outcome.UNAVAILABLE


class UploadBudgetFull(SymgateError):
    """The uploads together would pass upload.max_bytes: answered 507 until some are deleted
    (no Retry-After: time alone does not free it)."""

    outcome = Outcome.REJECTED


class RequestTimeout(SymgateError):
    """The client did not send its request body within the time allowed."""

    outcome = Outcome.REJECTED


class Overloaded(SymgateError):
    """More requests of a kind are in work and waiting than the server takes: retry later."""

    outcome = Outcome.REJECTED


class DatabaseUnavailable(SymgateError, TryAgain):
    """The database did not answer (gone, refusing, or slower than database.timeout_s) where
    an answer needs it (a symbol table's row): 503 with Retry-After, as it comes back."""

    outcome = Outcome.UNAVAILABLE


class OutOfResources(SymgateError, TryAgain):
    """The server ran out of something of its own that comes back by itself (file
    descriptors): answered 503 with Retry-After, not as an internal error. A profile that
    needs a file it could not fetch for it is refused whole, not answered with the mapping
    bare (`unavailable`) in a 200 that a backend keeps for good."""

    outcome = Outcome.UNAVAILABLE


def out_of_descriptors(error: OSError) -> OutOfResources | None:
    """The OutOfResources that `error` is when it says the descriptor table is full (the
    process's or the system's), else None: a passing condition, not a fault of the server."""
    if error.errno in (errno.EMFILE, errno.ENFILE):
        return OutOfResources("the server is out of file descriptors; retry later")
    return None


class BuildBoundTooLow(SymgateError, TryAgain):
    """symbolize.build_memory_bytes is less than a build process maps before it builds
    anything: no build can succeed, whatever the file. No file is blamed (remembered as
    malformed), and no profile is answered with its mappings bare (a 200 is kept for good):
    503 with Retry-After, until the operator raises the bound."""

    outcome = Outcome.UNAVAILABLE


class WorkerLost(SymgateError, TryAgain):
    """The worker process doing the request's work died (killed, or crashed in native code)."""

    outcome = Outcome.UNAVAILABLE


class SourceEvicted(SymgateError, TryAgain):
    """A cached file that the request's work was to read left the cache before it was read
    (another serving process on the data dir evicted it): 503 with Retry-After; the next
    request fetches it again."""

    outcome = Outcome.UNAVAILABLE
