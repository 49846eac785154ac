"""A symgate can be another symgate's upstream: a site cache in front of a regional one
serves elfutils' client, and a miss at the far end is a plain 404 at the near one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.web.app import body_options, create_app
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import (
    Debuginfod,
    SymgateFactory,
    eventually,
    fast_upstream,
    free_port,
    make_config,
    running_debuginfod,
    serves,
)
from tests.processes import Start, debuginfod_find

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


async def test_two_symgates_in_a_chain(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    regional = await start_symgate([debuginfod.url], data_dir=tmp_path / "regional")
    site = await start_symgate([regional.url], data_dir=tmp_path / "site")
    result = await asyncio.to_thread(debuginfod_find, site.url, tmp_path / "c", "executable",
                                     elfs.prog.build_id)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).read_bytes() == elfs.prog.executable.read_bytes()
    assert await regional.metric("symgate_requests_total", endpoint="buildid",
                                 kind="executable", outcome="miss") == 1
    status, _, _ = await site.get("/buildid/0badc0de/debuginfo")
    assert status == 404  # a miss upstream of the chain is a plain 404 at the site


async def test_two_symgates_that_are_each_others_upstream_answer_404_not_a_timeout(
    start_symgate: SymgateFactory, database_url: str, tmp_path: Path
) -> None:
    """A misconfigured tier: A asks B, B asks A. The request that comes back to A (its own
    name in Via) is answered from A's cache alone, so it never joins A's own fetch and waits
    on itself: the client gets a plain 404, as two looped elfutils debuginfods give."""
    port_b = free_port()
    a = await start_symgate([fast_upstream(f"http://127.0.0.1:{port_b}")],
                            data_dir=tmp_path / "a")
    b_config = make_config(tmp_path / "b", database_url.replace("symgate.sqlite", "b.sqlite"),
                           [fast_upstream(a.url)])
    b_runner = web.AppRunner(create_app(b_config, CollectorRegistry()), access_log=None,
                             **body_options())
    await b_runner.setup()
    await web.TCPSite(b_runner, "127.0.0.1", port_b).start()
    try:
        status, _, body = await a.get("/buildid/" + "ee" * 20 + "/debuginfo")
        assert status == 404, body
        assert await a.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                              outcome="not_found") == 2  # the client's, and the loop's
        assert await a.metric("symgate_upstream_requests_total",
                              upstream=f"http://127.0.0.1:{port_b}", result="not_found") == 1
    finally:
        await b_runner.cleanup()


async def test_a_loop_that_comes_back_to_another_worker_is_seen(
    serve: Start, database_url: str, tmp_path: Path
) -> None:
    """A loop of caches whose request comes back to another worker of `serve --workers 2`
    than the one that sent it: that worker must see its server's name in Via, or it follows
    the other worker's fetch, which waits for the loop's answer (a timeout, not a 404)."""
    port_b = free_port()
    a_url, _ = await serve(f"http://127.0.0.1:{port_b}", workers=2)
    b_config = make_config(tmp_path / "b", database_url.replace("symgate.sqlite", "b.sqlite"),
                           [fast_upstream(a_url, first_byte_timeout_s=1, retries=0)])
    b_runner = web.AppRunner(create_app(b_config, CollectorRegistry()), access_log=None,
                             **body_options())
    await b_runner.setup()
    await web.TCPSite(b_runner, "127.0.0.1", port_b).start()
    try:
        # B keeps one connection to A, so the loop comes back to one worker; a connection of
        # its own per request lands the client on either: half of them on the other.
        for i in range(8):
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)
                                             ) as s, \
                    s.get(f"{a_url}/buildid/{i:02x}{'ee' * 19}/debuginfo") as r:
                assert r.status == 404, (i, await r.text())
    finally:
        await b_runner.cleanup()


async def test_the_far_cache_tells_the_near_one_its_real_failure_for_an_elfutils_client(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """An elfutils client gets 406 for an upstream's failure (its client would cache any
    other error as a miss). Its User-Agent, relayed, made the regional cache answer the site
    406 too: the site took it for a misconfiguration, neither resting on the regional cache
    as its upstream's Retry-After asked nor saying what failed."""
    regional = await start_symgate([fast_upstream(faults.url_for("busy"), retries=0)],
                                   data_dir=tmp_path / "regional")
    site = await start_symgate([fast_upstream(regional.url, retries=0)],
                               data_dir=tmp_path / "site")
    status, _, body = await site.get(f"/buildid/{elfs.prog.build_id}/debuginfo",
                                     headers={"User-Agent": "elfutils/0.188,Linux/x86_64"})
    assert status == 406  # to the client itself, still
    assert b"answered 502 (Retry-After: 120 s)" in body, body
    assert await site.metric("symgate_upstream_breaker_state", upstream=regional.url) == 2


async def test_a_miss_behind_a_federating_debuginfod_at_its_hop_limit_is_not_remembered(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A federating elfutils debuginfod (debuginfod.elfutils.org is one) answers 404 without
    asking its upstreams once X-Forwarded-For has --forwarded-ttl-limit (8) hops. A client
    that sent 7 made symgate's request carry 8: that 404 says nothing of the file, yet it was
    remembered for every client (60 s, doubling), and any client could keep a file from
    everybody by asking for it so."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("DEBUGINFOD_URLS", debuginfod.url)
    monkeypatch.setenv("DEBUGINFOD_CACHE_PATH", str(tmp_path / "federating-cache"))
    with running_debuginfod(empty, empty, "-t", "0", "-g", "0") as federating:
        path = f"/buildid/{elfs.prog.build_id}/debuginfo"
        await eventually(lambda: serves(federating.url + path))
        sg = await start_symgate([federating.url])
        hops = ", ".join(f"10.0.0.{i}" for i in range(7))
        status, _, _ = await sg.get(path, headers={"X-Forwarded-For": hops})
        assert status == 404  # the federating server's answer, passed on
        status, _, body = await sg.get(path)
        assert status == 200 and body == elfs.prog.debug.read_bytes()
