"""POST /symbolize: a pprof profile in, the same profile with native frames symbolized out.

The work is symbolize.pipeline's; this handler reads the body, decides the tenant's scope and
policy, and turns the pipeline's report into headers and metrics. Tenants are told apart by
X-Scope-OrgID, as in Pyroscope and other Grafana backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import get_args

from aiohttp import HttpVersion11, web
from aiohttp.abc import AbstractStreamWriter

from proxy.config import Fallback, SymbolizeConfig, TenantConfig
from proxy.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType
from proxy.symbols.workers import Reception
from proxy.web.artifacts import hop_of
from proxy.web.content_encoding import coding_of, inflate_measured, measure_body
from proxy.web.errors import CountedWhenSent
from proxy.web.logs import annotate
from proxy.web.state import STATE, AppState
from symbolize.outcome import MODULE_OFFSET, NAMED
from symbolize.pipeline import Limits, Symbolized, SymbolProvider, Work, symbolize_profile
from symbolize.rewrite import Report

ACCEPTED_TYPES = ("application/octet-stream", "application/x-protobuf",
                  "application/vnd.google.protobuf", "")


async def expect_continue(request: web.Request) -> None:
    """`Expect: 100-continue` (curl sends it past a KiB or a MiB, by version) is answered by
    read_body, when the body is wanted: aiohttp's own handler invited every body before the
    handler ran, and a profile refused without its body (415, 413 by its Content-Length, 401,
    429) was sent whole for nothing."""
    expect = request.headers.get("Expect", "")
    if request.version == HttpVersion11 and expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"unknown Expect: {expect}")


async def read_body(request: web.Request, limit: int, timeout_s: float,
                    held: Reception | None = None) -> bytes:
    """The whole body, within `timeout_s` (408) and `limit` bytes (413); counted into the
    place it is `held` in, and cut (408) if that place is taken back for coming too slowly."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
    if request.version == HttpVersion11 \
            and request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's own handler: no body sent yet
    # read(n) returns what is buffered, not n bytes: read to the end, stopping past the limit.
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s or None):
            while chunk := await _chunk(request, held, size):
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body is larger than {limit} bytes")
                chunks.append(chunk)
                if held is not None:
                    held.received = size
    except TimeoutError as e:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s "
                             f"({size} bytes came)") from e
    if held is not None:
        held.whole = True
    return b"".join(chunks)


async def _chunk(request: web.Request, held: Reception | None, size: int) -> bytes:
    """What comes of the body next (b"" at its end); RequestTimeout once its place is taken
    back (workers._Places)."""
    if held is None:
        return await request.content.read(1 << 20)
    if not held.revoked.done():
        buffered = request.content.read_nowait(1 << 20)
        if buffered or request.content.at_eof():
            return buffered  # no task to make for what is there already
        reading = asyncio.ensure_future(request.content.read(1 << 20))
        try:
            await asyncio.wait((reading, held.revoked), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not reading.done():
                reading.cancel()
        if reading.done() and not reading.cancelled():
            return reading.result()
    raise RequestTimeout(f"the request body came too slowly ({size} bytes in "
                         f"{time.monotonic() - held.since:.1f} s) while other profiles waited "
                         "for its place: send it faster, or later")


async def read_profile(request: web.Request, cfg: SymbolizeConfig, wbits: int | None,
                       held: Reception | None = None) -> bytes:
    """The request's body, inflated where it came with a Content-Encoding (`wbits`): to no
    more than a gzipped profile may inflate to (symbolize.pprof.codec), in a thread."""
    body = await read_measured(request, cfg, wbits, held)
    return await inflate(body, cfg, wbits)


async def read_measured(request: web.Request, cfg: SymbolizeConfig, wbits: int | None,
                        held: Reception | None = None) -> bytes:
    """The request's body as sent, where it came with a Content-Encoding (`wbits`) measured
    (413 past the limit) but not kept inflated: `inflate` does that once it is worked on."""
    body = await read_body(request, cfg.max_request_bytes, cfg.body_timeout_s, held)
    if wbits is not None:
        await measure_body(body, wbits, cfg.max_decompressed_bytes, _LIMIT,
                           gone=lambda: request.transport is None)
    return body


async def inflate(body: bytes, cfg: SymbolizeConfig, wbits: int | None) -> bytes:
    """A body read_measured gave, inflated."""
    if wbits is None:
        return body
    return await inflate_measured(body, wbits, cfg.max_decompressed_bytes, _LIMIT)


_LIMIT = "symbolize.max_decompressed_bytes"


def report_headers(report: Report, state: str) -> dict[str, str]:
    def fmt(counts: Counter[str]) -> str:
        return ", ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"

    return {
        "X-Symgate-Symbolize": state,
        "X-Symgate-Mappings-Symbolized": str(report.mappings_symbolized),
        "X-Symgate-Mappings-Unsymbolized": fmt(report.mappings_skipped),
        "X-Symgate-Locations-Symbolized": str(report.locations_symbolized),
        "X-Symgate-Locations-Unresolved": fmt(report.locations_unresolved),
    }


# A format's whole symbolization: the request's body in, the answer's and the report out.
Run = Callable[[bytes, SymbolProvider, Limits, Work],
               Awaitable[tuple[bytes | memoryview, Symbolized]]]


@dataclass(frozen=True, slots=True)
class Format:
    """What one kind of profile is sent as, and how it goes through the pipeline."""

    accepted: tuple[str, ...]  # Content-Types
    content_type: str  # of the answer
    hint: str  # what to send, for a 415
    run: Run


async def _pprof(body: bytes, provider: SymbolProvider, limits: Limits, work: Work
                 ) -> tuple[bytes | memoryview, Symbolized]:
    done = await symbolize_profile(body, provider, limits, work)
    return done.body, done


PPROF = Format(ACCEPTED_TYPES, "application/octet-stream",
               "a pprof profile as application/octet-stream or application/x-protobuf", _pprof)


async def symbolize(request: web.Request) -> web.StreamResponse:
    return await symbolize_as(request, PPROF)


async def symbolize_as(request: web.Request, fmt: Format) -> web.StreamResponse:
    state = request.app[STATE]
    annotate(request, endpoint="symbolize")
    cfg = state.config.symbolize
    ctype = request.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if ctype not in fmt.accepted:
        raise UnsupportedMediaType(f"unsupported Content-Type {ctype!r}: send {fmt.hint}")
    wbits = coding_of(request)
    # Admitted before the body is read: a full server answers 429 at once, and holds only the
    # bodies of the profiles it admitted. A worker slot is taken only once the body is in.
    tenant = state.tenancy.tenant_of(request)
    settings = state.tenancy.settings(tenant)
    annotate(request, tenant=tenant or None)
    if not cfg.enabled or (settings is not None and not settings.symbolize):
        # Passed through untouched: no work, so no place among the admitted to take, but one
        # among those passed through (their bodies are held whole).
        async with state.symbols.workers.passing() as held:
            body = await read_profile(request, cfg, wbits, held)
        annotate(request, outcome="disabled")
        # Counted once sent, as a symbolized answer is: a client gone mid-answer is `aborted`.
        return respond(body, fmt.content_type, {"X-Symgate-Symbolize": "disabled"})
    limits = replace(limits_of(cfg), fallback=fallback_of(request, cfg, settings))
    async with state.symbols.workers.admitted() as (held, take_slot):
        # A bomb is refused here, before it takes a slot; the body is inflated in its slot.
        body = await read_measured(request, cfg, wbits, held)
        hop, may_fetch = hop_of(request, state.via_name,
                                state.config.server.forwarded_ttl_limit)
        req = state.tenancy.scope(tenant, hop, may_fetch)
        # A client that left meanwhile gives its place up rather than have its profile
        # worked on for nobody (proxy.web.errors answers it as a client closed request), as
        # does one that leaves while it is worked on.
        def gone() -> bool:
            return request.transport is None

        async with take_slot(gone):
            # Inflated only now, as a gzipped body is (pipeline.py): a waiting profile holds
            # what it was sent, not the up to max_decompressed_bytes it inflates to.
            body = await inflate(body, cfg, wbits)
            with state.symbols.workers.for_request() as work:
                answer, done = await state.symbols.workers.while_there(gone, fmt.run(
                    body, state.symbols.provider(req), limits, work))
    count(state, done)
    result = "symbolized" if done.changed else \
        "named" if done.report.locations_unresolved[NAMED] else "unchanged"
    annotate(request, outcome=result, mappings_symbolized=done.report.mappings_symbolized,
             locations_symbolized=done.report.locations_symbolized)
    # Nothing filled in: the client gets its own bytes back, untouched.
    return respond(answer, fmt.content_type, report_headers(done.report, result))


def respond(answer: bytes | memoryview, content_type: str, headers: dict[str, str]
            ) -> web.StreamResponse:
    """The answer as a response, counted once it is out (or cut off): a view of a worker's
    mapped answer is let go of then."""
    return _SentView(answer if isinstance(answer, memoryview) else memoryview(answer),
                     content_type, headers)


class _SentView(CountedWhenSent, web.StreamResponse):
    """An answer written when aiohttp prepares the response, and counted then: counted on the
    handler's return, a profile whose client left mid-answer was `symbolized`, not `aborted`.
    A worker's answer is mapped from the memory file it wrote (proxy.symbols.workers), and let
    go of once sent: aiohttp keeps a kept-alive connection's last response until the next
    request comes, and with it the mapping and its descriptor, 39 MB for a profile of a
    million locations."""

    def __init__(self, view: memoryview, content_type: str, headers: dict[str, str]) -> None:
        super().__init__(headers=headers)
        self.content_type = content_type
        self.content_length = view.nbytes
        self._view = view

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        cut: BaseException | None = None
        try:
            writer = await super().prepare(request)
            if request.transport is None:  # gone before a byte went: aiohttp writes nowhere
                raise ConnectionResetError("Connection lost")
            await self.write(self._view)
            await super().write_eof()
        except BaseException as e:
            cut = e
            raise
        finally:
            with contextlib.suppress(BufferError):  # a transport still holds part of it
                self._view.release()
            self.sent(request, cut)
        return writer


def fallback_of(request: web.Request, cfg: SymbolizeConfig, settings: TenantConfig | None
              ) -> bool:
    """Whether frames left unsymbolized are named `module+0xoffset`: the request's
    ?fallback=, else its tenant's setting, else the global one."""
    asked = request.query.getall("fallback", [])
    if len(asked) > 1 or (asked and asked[0] not in get_args(Fallback)):
        raise InvalidRequest(f"fallback must be one of {', '.join(get_args(Fallback))}")
    chosen = asked[0] if asked else (settings.fallback if settings is not None
                                     and settings.fallback is not None else cfg.fallback)
    return chosen == MODULE_OFFSET


def limits_of(cfg: SymbolizeConfig) -> Limits:
    # 0: no bound, as for the other limits of the configuration (a deadline of 0 answered
    # every profile before any table, even an open one, was looked at: nothing, ever; a
    # max_mappings of 0 refused every profile with a build ID)
    return Limits(cfg.max_decompressed_bytes, cfg.max_mappings or sys.maxsize,
                  cfg.deadline_s or None,
                  max_profile_mappings=cfg.max_profile_mappings or None,
                  max_profile_locations=cfg.max_profile_locations or None,
                  max_profile_functions=cfg.max_profile_functions or None,
                  max_profile_samples=cfg.max_profile_samples or None)


def count(state: AppState, done: Symbolized) -> None:
    m = state.symbolize_metrics
    report = done.report
    if report.mappings_symbolized:
        m.mappings.labels("symbolized").inc(report.mappings_symbolized)
    for reason, n in report.mappings_skipped.items():
        m.mappings.labels(reason).inc(n)
    if report.locations_symbolized:
        m.locations.labels("symbolized").inc(report.locations_symbolized)
    for reason, n in report.locations_unresolved.items():
        m.locations.labels(reason).inc(n)
    if done.layout_guesses:
        m.layout_guesses.inc(done.layout_guesses)
