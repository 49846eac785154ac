"""Each way a request can fail has one HTTP status: the client's fault is a 4xx, an upstream's a
502 or 504 with Retry-After; elfutils' client, which caches any error but 406 as a miss, gets
406 for an upstream's passing failure, so an outage does not blind it for ten minutes."""

from __future__ import annotations

import inspect

import pytest

from proxy import errors
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
)
from proxy.web.errors import error_response

STATUS = {
    InvalidRequest: 400,
    Unauthorized: 401,
    Forbidden: 403,
    NotFound: 404,
    RememberedNotFound: 404,
    TooLarge: 406,
    RequestTimeout: 408,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    OverLimit: 422,
    UnprocessableUpload: 422,
    Conflict: 409,
    Overloaded: 429,
    UpstreamUnavailable: 502,
    VerificationFailed: 502,
    UpstreamTimeout: 504,
    WorkerLost: 503,
    BuildBoundTooLow: 503,  # symbolize.build_memory_bytes too low: until it is raised
    SourceEvicted: 503,  # a cached file another process evicted: fetched again
    OutOfResources: 503,  # out of file descriptors: they come back
    DatabaseUnavailable: 503,  # a symbol table's row out of reach: the database comes back
    NotCached: 504,  # RFC 9111's answer to only-if-cached: nothing to retry
    InsufficientStorage: 507,  # the cache's disk is full: space comes back
    UploadBudgetFull: 507,  # uploads past upload.max_bytes: deleting them makes room
    SymgateError: 500,
}
# The upstream's failures: the same request may well succeed soon.
TRANSIENT = {UpstreamUnavailable, UpstreamTimeout, VerificationFailed}
# Passing failures of symgate's own world, retried like an upstream's.
PASSING = TRANSIENT | {InsufficientStorage}
# Our own passing failures: a full /symbolize, a worker that died, no descriptor left;
# retried by anyone.
BUSY = {Overloaded: 429, WorkerLost: 503, SourceEvicted: 503, OutOfResources: 503,
        DatabaseUnavailable: 503, BuildBoundTooLow: 503}
CURL = "curl/8.5.0"
ELFUTILS = "elfutils/0.188,Linux/x86_64,debian/12"


def test_every_failure_in_proxy_errors_has_a_status() -> None:
    defined = {cls for _name, cls in inspect.getmembers(errors, inspect.isclass)
               if issubclass(cls, SymgateError)}
    assert defined == set(STATUS)


@pytest.mark.parametrize(("error", "status"), STATUS.items(), ids=[c.__name__ for c in STATUS])
def test_status_and_body(error: type[SymgateError], status: int) -> None:
    r = error_response(error("what went wrong"), CURL, 30)
    assert r.status == status
    assert r.text == "what went wrong\n"
    # RFC 9110: a 401 says how to authenticate.
    assert ("WWW-Authenticate" in r.headers) == (status == 401)


@pytest.mark.parametrize("error", STATUS, ids=lambda c: c.__name__)
def test_retry_after_only_where_retrying_helps(error: type[SymgateError]) -> None:
    r = error_response(error("x"), CURL, 17)
    if error in PASSING:
        assert r.status in (502, 504, 507) and r.headers["Retry-After"] == "17"
    elif error in BUSY:
        assert r.status == BUSY[error] and r.headers["Retry-After"] == "17"
    else:
        assert "Retry-After" not in r.headers, error


@pytest.mark.parametrize("error", sorted(PASSING, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_elfutils_gets_406_for_an_upstreams_passing_failure(error: type[SymgateError]) -> None:
    r = error_response(error("upstream down"), ELFUTILS, 30)
    assert r.status == 406 and "Retry-After" not in r.headers
    assert r.text == "upstream down\n"


@pytest.mark.parametrize("error", sorted(set(STATUS) - PASSING, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_elfutils_gets_the_usual_status_for_everything_else(error: type[SymgateError]) -> None:
    assert error_response(error("x"), ELFUTILS, 30).status == STATUS[error]


@pytest.mark.parametrize("user_agent", ["", "Elfutils/0.188", "elfutils", "libdebuginfod",
                                        "gdb elfutils/0.188"])
def test_only_an_elfutils_user_agent_changes_the_status(user_agent: str) -> None:
    assert error_response(UpstreamTimeout("x"), user_agent, 30).status == 504
    assert error_response(UpstreamUnavailable("x"), user_agent, 30).status == 502
