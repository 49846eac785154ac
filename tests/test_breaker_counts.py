"""No sequence of client requests can open the circuit breaker of a healthy upstream: what a
client malformed is refused before it reaches the upstream, and the upstream's answers to odd
but valid requests are answers, not failures (issue 11, item 7). Nor can one file the upstream
fails for, asked for again and again: the breaker opens on `breaker_failures` different files
(or failures to connect at all) with no success between, and a file that failed is answered
502 from memory for `failed_file_rest_s`, not asked of the upstream again."""

from __future__ import annotations

import asyncio
import collections

import aiohttp
import pytest
from aiohttp import web

from proxy.config import CacheConfig, FetchConfig, SymbolizeConfig
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import (
    Debuginfod,
    Symgate,
    SymgateFactory,
    eventually,
    fast_upstream,
    free_port,
    serve_loopback,
)

_EMOJI = "%F0%9F%98%80"  # 4 bytes of UTF-8, 12 characters once percent-encoded

ODD_PATHS = (
    # build IDs
    "/buildid/zz/debuginfo", "/buildid/a/debuginfo", "/buildid/abc/debuginfo",
    "/buildid/" + "ab" * 65 + "/debuginfo", "/buildid/%00ab/debuginfo",
    "/buildid/ab%0a/debuginfo", "/buildid/%20ab/debuginfo", "/buildid/0x12/debuginfo",
    "/buildid/%D9%A0%D9%A1/debuginfo", "/buildid/AB/debuginfo", "/buildid//debuginfo",
    # artifact types
    "/buildid/ab/unknown", "/buildid/ab/debuginfo/extra", "/buildid/ab/source",
    "/buildid/ab/section", "/buildid/ab/DEBUGINFO", "/buildid/ab/",
    # source paths
    "/buildid/ab/source/", "/buildid/ab/source//", "/buildid/ab/source/.",
    "/buildid/ab/source/..", "/buildid/ab/source/a/../../../etc/passwd",
    "/buildid/ab/source/%00", "/buildid/ab/source/a%00b", "/buildid/ab/source//etc//passwd",
    "/buildid/ab/source/%ff%fe", "/buildid/ab/source/a%3Fb", "/buildid/ab/source/a%23b",
    "/buildid/ab/source/a%2Fb", "/buildid/ab/source/a%5Cb", "/buildid/ab/source/%7F",
    "/buildid/ab/source/" + "a" * 4090, "/buildid/ab/source/" + "a" * 5000,
    "/buildid/ab/source/" + _EMOJI * 340, "/buildid/ab/source/" + _EMOJI * 600,
    "/buildid/ab/source/" + "%25" * 2600, "/buildid/ab/source/" + "a/" * 2040,
    # section names
    "/buildid/ab/section/.", "/buildid/ab/section/..", "/buildid/ab/section/%2e",
    "/buildid/ab/section/%2e%2e", "/buildid/ab/section/", "/buildid/ab/section/a/b",
    "/buildid/ab/section/a%2Fb", "/buildid/ab/section/" + "x" * 300,
    "/buildid/ab/section/" + "x" * 5000, "/buildid/ab/section/%00",
    "/buildid/ab/section/.debug_info%0a", "/buildid/ab/section/%C3%A9",
    "/buildid/ab/section/.debug%20info", "/buildid/ab/section/%ff",
    "/buildid/ab/section/.text?x=1", "/buildid/ab/section/" + _EMOJI * 400,
)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_malformed_and_odd_requests_never_open_the_breaker(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    # One counted failure would open it, and for the whole test.
    up = fast_upstream(debuginfod.url, retries=0, breaker_failures=1,
                       breaker_cooldown_s=3600)
    sg = await start_symgate([up])
    statuses: dict[str, int] = {}
    for path in ODD_PATHS:
        for method in ("GET", "HEAD"):
            status, _, _ = await sg.request(method, path)
            statuses[f"{method} {path[:80]}"] = status
    server_errors = {p: s for p, s in statuses.items() if s >= 500}
    assert not server_errors, server_errors
    assert await sg.metric("symgate_upstream_breaker_state", upstream=debuginfod.url) == 0
    assert await sg.metric("symgate_upstream_breaker_trips_total",
                           upstream=debuginfod.url) == 0
    # And the upstream is still asked: a valid cold miss is served.
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_trial_cancelled_by_a_race_lets_the_next_request_try_again(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    gate = faults.url_for("gate")
    sg = await start_symgate(
        [fast_upstream(gate, retries=0, breaker_failures=1, breaker_cooldown_s=0.2,
                       first_byte_timeout_s=10), faults.url_for("late")],
        fetch=FetchConfig(policy="race"))
    first, second, third = (f"/buildid/{elfs.prog.build_id}/debuginfo",
                            f"/buildid/{elfs.prog.build_id}/executable",
                            f"/buildid/{elfs.other.build_id}/debuginfo")
    assert (await sg.get(first))[0] == 200  # the gate's 503 opened its breaker
    assert await sg.metric("symgate_upstream_breaker_state", upstream=gate) == 2
    await asyncio.sleep(0.3)  # past the cool-down
    faults.gate_open, faults.gate_delay = True, 5.0
    # The gate gets its trial, but the prompt upstream wins and the trial is cancelled.
    assert (await sg.get(second))[0] == 200 and faults.count("gate") == 2
    # A trial given up is no trial in flight: the next request may try again.
    assert (await sg.get(third))[0] == 200
    assert faults.count("gate") == 3



@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_trial_cancelled_in_its_backoff_lets_the_next_request_try_again(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A retry let through as the half-open breaker's trial, then cancelled in its backoff by
    a race the other upstream won, kept the trial for good: the upstream, back again, was
    never asked again."""
    gate = faults.url_for("gate")
    sg = await start_symgate(
        [fast_upstream(gate, retries=1, retry_backoff_s=60, breaker_failures=1,
                       breaker_cooldown_s=0), faults.url_for("hold")],
        fetch=FetchConfig(policy="race"))
    first = asyncio.ensure_future(sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))
    # The gate's 503 opened its breaker; its retry is the trial, waiting out its backoff.
    await eventually(lambda: _breaker_is(sg, gate, 1))
    faults.release.set()  # the other upstream answers: the race is won, the retry cancelled
    assert (await first)[0] == 200 and faults.count("gate") == 1
    faults.gate_open = True
    assert (await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo"))[0] == 200
    assert faults.count("gate") == 2


async def _breaker_is(sg: Symgate, upstream: str, state: int) -> bool:
    return await sg.metric("symgate_upstream_breaker_state", upstream=upstream) == state


class _SlowMetadata:
    """An upstream whose /metadata answers start and then wait for `release`, holding their
    connections (a glob over a large index is slow); its artifacts are served at once."""

    def __init__(self, elfs: ElfSet, hold: int) -> None:
        self.elfs = elfs
        self.hold = hold  # queries held once this many have come
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self.queries = 0
        self.fetches = 0

    async def metadata(self, request: web.Request) -> web.StreamResponse:
        self.queries += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"results": [')
        if self.queries >= self.hold:
            self.held.set()
        await self.release.wait()
        await response.write(b'], "complete": true}')
        return response

    async def artifact(self, request: web.Request) -> web.Response:
        self.fetches += 1
        if request.match_info["build_id"] != self.elfs.prog.build_id:
            return web.Response(status=404)
        return web.Response(body=self.elfs.prog.debug.read_bytes(),
                            content_type="application/octet-stream")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_slow_metadata_queries_neither_hold_a_fetch_nor_open_the_breaker(
    start_symgate: SymgateFactory, elfs: ElfSet
) -> None:
    """A client's /metadata queries, as many as symgate lets reach an upstream at once and
    each held there, leave a fetch its connection: waiting for one, it timed out and the
    upstream, never asked, was charged with the timeout and its breaker opened."""
    slow = _SlowMetadata(elfs, hold=2)  # the query pool of max_concurrent_fetches = 1
    app = web.Application()
    app.router.add_get("/metadata", slow.metadata)
    app.router.add_get("/buildid/{build_id}/{kind}", slow.artifact)
    runner, url = await serve_loopback(app)
    try:
        # One counted failure would open it, and for the whole test.
        up = fast_upstream(url, retries=0, breaker_failures=1, breaker_cooldown_s=3600,
                           first_byte_timeout_s=1, read_timeout_s=60)
        sg = await start_symgate([up], cache=CacheConfig(max_concurrent_fetches=1),
                                 symbolize=SymbolizeConfig(enabled=False))
        flood = [asyncio.ensure_future(sg.get("/metadata?key=glob&value=/usr/*"))
                 for _ in range(4)]
        await slow.held.wait()
        status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
        assert status == 200 and body == elfs.prog.debug.read_bytes()
        assert slow.fetches == 1
        assert await sg.metric("symgate_upstream_breaker_state", upstream=url) == 0
        slow.release.set()
        assert {s for s, _, _ in await asyncio.gather(*flood)} == {200}
    finally:
        slow.release.set()
        await runner.cleanup()


class _FailingFiles:
    """An upstream that fails for the build IDs in `failing`, each in its way, and passes
    every other request to a real elfutils debuginfod: one server, healthy but for a few
    files, as a client that knows those files finds it."""

    def __init__(self, real: str) -> None:
        self.real = real
        self.failing: dict[str, str] = {}  # build ID -> "500", "timeout", "reset", "redirect"
        self.asked: collections.Counter[str] = collections.Counter()
        # Where "redirect" sends a file: a port nothing listens on, another origin.
        self.dead_end = f"127.0.0.1:{free_port()}"
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> _FailingFiles:
        app = web.Application()
        app.router.add_get("/buildid/{build_id}/{kind}{rest:.*}", self._handle)
        self._session = aiohttp.ClientSession()
        self._runner, self.url = await serve_loopback(app)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None and self._session is not None
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        build_id = request.match_info["build_id"]
        self.asked[build_id] += 1
        how = self.failing.get(build_id)
        if how == "500":
            return web.Response(status=500, text="internal error")
        if how == "timeout":  # a huge file behind a slow path: no answer in time
            await asyncio.sleep(3600)
        if how == "reset":  # a path that crashes the server, or that a proxy drops
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if how == "redirect":  # to a mirror of this file's that is down
            raise web.HTTPFound(f"http://{self.dead_end}{request.path}")
        assert self._session is not None
        async with self._session.get(self.real + request.path_qs) as r:
            headers = {k: v for k, v in r.headers.items()
                       if k.lower() == "content-type" or k.lower().startswith("x-debuginfod")}
            return web.Response(status=r.status, body=await r.read(), headers=headers)


def _bad(i: int) -> str:
    return f"{i:02x}" * 20


async def _statuses(sg: Symgate, build_id: str, n: int, gap_s: float = 0.0) -> set[int]:
    """`n` requests of one file, each `gap_s` after the one before (not after its answer):
    with no gap all at once, with one some joining a fetch under way, some starting another."""
    async def one(i: int) -> int:
        await asyncio.sleep(i * gap_s)
        return (await sg.get(f"/buildid/{build_id}/debuginfo"))[0]

    return set(await asyncio.gather(*(one(i) for i in range(n))))


async def _healthy_served(sg: Symgate, elfs: ElfSet) -> None:
    for elf in (elfs.prog, elfs.other):
        status, _, body = await sg.get(f"/buildid/{elf.build_id}/debuginfo")
        assert status == 200 and body == elf.debug.read_bytes()


async def _breaker(sg: Symgate, upstream: str) -> tuple[float, float]:
    """(state, trips) of the upstream's breaker."""
    return (await sg.metric("symgate_upstream_breaker_state", upstream=upstream),
            await sg.metric("symgate_upstream_breaker_trips_total", upstream=upstream))


@pytest.mark.parametrize("how", ["500", "timeout", "reset", "redirect"])
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_one_client_hammering_one_failing_file_never_opens_the_breaker(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, how: str
) -> None:
    """Each request of the file reaches the upstream (no rest), and fails there, with its
    retry: the count alone must hold. It opened the breaker at the second, and every other
    client's cold misses were 502 for the whole cool-down."""
    async with _FailingFiles(debuginfod.url) as up:
        up.failing[_bad(1)] = how
        sg = await start_symgate([fast_upstream(
            up.url, retries=1, breaker_failures=2, breaker_cooldown_s=3600,
            failed_file_rest_s=0,
            # Short only where the timeout is the failure: on a loaded CI runner, a redirect's
            # refused connection came after 0.3 s once, a 504 among the 502s.
            first_byte_timeout_s=0.3 if how == "timeout" else 10,
            redirect_hosts=(up.dead_end,))])
        failed = {504} if how == "timeout" else {502}
        assert await _statuses(sg, _bad(1), 8) == failed  # at once: one fetch
        n, gap = (4, 0.2) if how == "timeout" else (16, 0.02)
        assert await _statuses(sg, _bad(1), n, gap) == failed
        assert up.asked[_bad(1)] >= 4  # two fetches at least, each with its retry
        assert await _breaker(sg, up.url) == (0, 0)
        await _healthy_served(sg, elfs)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_failing_file_is_answered_from_memory_while_it_rests(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """The hammering client costs the upstream one fetch of its file (with its retry), and
    nobody else anything."""
    async with _FailingFiles(debuginfod.url) as up:
        up.failing[_bad(1)] = "500"
        sg = await start_symgate([fast_upstream(
            up.url, retries=1, breaker_failures=2, breaker_cooldown_s=3600,
            failed_file_rest_s=3600)])
        assert await _statuses(sg, _bad(1), 8) == {502}
        assert up.asked[_bad(1)] == 2
        assert await _statuses(sg, _bad(1), 16, 0.02) == {502}
        status, headers, body = await sg.get(f"/buildid/{_bad(1)}/debuginfo")
        assert status == 502 and b"not asked for this file" in body \
            and b"answered 500" in body, body
        assert int(headers["Retry-After"]) > 3000  # the rest left, not the default 30 s
        assert up.asked[_bad(1)] == 2
        assert await _breaker(sg, up.url) == (0, 0)
        await _healthy_served(sg, elfs)
        # Another failing file is still asked: the rest is the file's, not the upstream's.
        up.failing[_bad(2)] = "500"
        status, _, body = await sg.get(f"/buildid/{_bad(2)}/debuginfo")
        assert status == 502 and b"answered 500" in body and up.asked[_bad(2)] == 2


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_a_failing_files_rest_ends(
    start_symgate: SymgateFactory, debuginfod: Debuginfod
) -> None:
    async with _FailingFiles(debuginfod.url) as up:
        up.failing[_bad(1)] = "500"
        sg = await start_symgate([fast_upstream(up.url, retries=0, failed_file_rest_s=1.0)])
        path = f"/buildid/{_bad(1)}/debuginfo"
        status, _, body = await sg.get(path)
        assert status == 502 and b"answered 500" in body and up.asked[_bad(1)] == 1
        status, _, body = await sg.get(path)
        assert status == 502 and b"not asked for this file" in body and up.asked[_bad(1)] == 1

        async def asked_again() -> bool:
            await sg.get(path)
            return up.asked[_bad(1)] == 2

        await eventually(asked_again)
        # Its rest over, the file is asked; the upstream now has it gone (404): remembered.
        del up.failing[_bad(1)]
        await eventually(lambda: _answered(sg, path, 404))
        assert up.asked[_bad(1)] == 3


async def _answered(sg: Symgate, path: str, status: int) -> bool:
    return (await sg.get(path))[0] == status


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_threshold_different_failing_files_open_it_unless_a_success_comes_between(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    async with _FailingFiles(debuginfod.url) as up:
        for i in range(5):
            up.failing[_bad(i)] = "500"
        sg = await start_symgate([fast_upstream(
            up.url, retries=1, breaker_failures=3, breaker_cooldown_s=3600,
            failed_file_rest_s=0)])

        async def fail(*files: int) -> None:
            for i in files:
                assert (await sg.get(f"/buildid/{_bad(i)}/debuginfo"))[0] == 502

        await fail(0, 1, 0, 1, 0)
        status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
        assert status == 200  # another client's file: the count starts again
        await fail(2, 3, 2)
        assert await _breaker(sg, up.url) == (0, 0)
        await fail(4)  # the third different file since the success
        assert await _breaker(sg, up.url) == (2, 1)
        status, _, body = await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo")
        assert status == 502 and b"circuit breaker open" in body
        assert up.asked[elfs.other.build_id] == 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
async def test_an_upstream_that_cannot_be_reached_opens_it_whatever_the_file(
    start_symgate: SymgateFactory, elfs: ElfSet
) -> None:
    """Refused connections say the upstream is down, whatever file was wanted: each counts,
    and none makes a file rest (it has not been asked)."""
    down = f"http://127.0.0.1:{free_port()}"
    sg = await start_symgate([fast_upstream(down, retries=0, breaker_failures=2,
                                            breaker_cooldown_s=3600, failed_file_rest_s=3600)])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    for _ in range(2):
        status, _, body = await sg.get(path)
        assert status == 502 and b"ClientConnectorError" in body, body
    assert await _breaker(sg, down) == (2, 1)
    status, _, body = await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo")
    assert status == 502 and b"circuit breaker open" in body, body
