"""No sequence of client requests can open the circuit breaker of a healthy upstream: what a
client malformed is refused before it reaches the upstream, and the upstream's answers to odd
but valid requests are answers, not failures (issue 11, item 7)."""

from __future__ import annotations

import asyncio

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
