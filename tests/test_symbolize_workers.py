"""/symbolize under load and abuse: its CPU work runs in worker processes, never on the event
loop that serves /buildid; a worker that dies costs its request a 503, not the server; work
bounds and the admission gate refuse before the work (422, 429 + Retry-After); and a gzip bomb
is refused without being inflated into memory."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gzip
import os
import signal
import socket
import struct
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from proxy.config import TenantConfig
from proxy.inflating import GZIP
from proxy.symbols.workers import WorkerPool
from proxy.web.content_encoding import inflate_measured, inflated, measure_body
from proxy.web.state import STATE
from symbolize.pprof.profile_raw_pb2 import RawProfile
from tests.elfs import Elf, ElfSet
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, Symgate, SymgateFactory, eventually, fast_upstream
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID, libc_tree
from tests.processes import stopped
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import (
    BASES,
    parse,
    peak_rss,
    post,
    reset_peak_rss,
    symbolize_config,
)

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

T = TypeVar("T")


def _profile(elfs: ElfSet) -> bytes:
    return make_profile([(place(elfs.prog, BASES["prog"]),
                          code_addresses(elfs.prog)[:5])]).SerializeToString()


def _workers(sg: Symgate) -> list[int]:
    return sg.runner.app[STATE].symbols.workers.pool.pids()


async def _started(sg: Symgate) -> list[int]:
    """The symbolize workers' pids, a worker started (with the server, or by this job)."""
    await sg.runner.app[STATE].symbols.workers.pool.start()
    return _workers(sg)



async def test_profiles_are_rewritten_off_the_event_loop(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """With every symbolize worker frozen, a profile waits while /buildid hits are answered:
    the rewrite is the workers' alone, and the loop stays free."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(workers=1))
    hit = f"/buildid/{elfs.prog.build_id}/executable"
    assert (await sg.get(hit))[0] == 200
    state = sg.runner.app[STATE]
    with stopped(await _started(sg)):
        pending = asyncio.ensure_future(post(sg, _profile(elfs)))
        await eventually(lambda: state.symbols.workers.pool.in_flight > 0)
        for _ in range(3):
            status, _, body = await sg.get(hit)
            assert status == 200 and body == elfs.prog.executable.read_bytes()
        assert not pending.done()
    status, headers, _ = await pending
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"


async def test_a_worker_killed_mid_profile_is_a_503_and_the_pool_recovers(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(workers=1))
    await _killed_mid_job(sg, elfs, sg.runner.app[STATE].symbols.workers.pool,
                          await _started(sg))


async def _killed_mid_job(sg: Symgate, elfs: ElfSet, pool: WorkerPool, pids: list[int]
                          ) -> None:
    """A profile whose job is in `pool`, whose processes `pids` are killed meanwhile: 503
    with Retry-After, and the next profile symbolized by new processes."""
    with stopped(pids):
        pending = asyncio.ensure_future(post(sg, _profile(elfs)))
        await eventually(lambda: pool.in_flight > 0)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    status, headers, text = await pending
    assert status == 503 and "Retry-After" in headers and b"worker process died" in text
    status, headers, _ = await post(sg, _profile(elfs))
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert set(pool.pids()).isdisjoint(pids)


async def test_a_sample_checker_killed_mid_check_is_a_503_and_recovers(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """The samples are checked in processes of their own, beside the rewrite: one that dies
    fails its profile as a rewriting worker's death does, whatever the rewrite made of it."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(workers=1))
    checks = sg.runner.app[STATE].symbols.workers.checks
    assert (await post(sg, _profile(elfs)))[0] == 200  # the table built, a checker started
    pids = checks.pids()
    assert pids and set(pids).isdisjoint(_workers(sg))
    await _killed_mid_job(sg, elfs, checks, pids)


async def test_a_worker_that_died_idle_costs_no_request_a_503(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(workers=1))
    pool = sg.runner.app[STATE].symbols.workers.pool
    pids = await _started(sg)
    killed = pool._executor
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    # Once the pool has seen it (ProcessPoolExecutor marks itself broken), the next job is
    # taken by new workers: it never ran in the broken pool. A job still running from the
    # server's start (its warm-up) may have noticed first and retired the executor already.
    await eventually(lambda: bool(getattr(killed, "_broken", False))
                                   or pool._executor is not killed)
    status, headers, _ = await post(sg, _profile(elfs))
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert set(_workers(sg)).isdisjoint(pids)


@pytest.mark.parametrize(("bound", "what"), [
    ("max_profile_mappings", b"3 mappings"), ("max_profile_locations", b"6 locations"),
    ("max_profile_functions", b"3 functions"), ("max_profile_samples", b"6 samples")])
async def test_a_profile_past_a_work_bound_is_422_before_anything_is_fetched(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, bound: str,
    what: bytes,
) -> None:
    sg = await start_symgate([faults.url_for("ok")], symbolize=symbolize_config(**{bound: 2}))
    placed = [(replace(place(elfs.prog, BASES["prog"]), build_id=f"{i:02x}" * 20),
               [0x1100, 0x1200])
              for i in range(3)]
    profile = make_profile(placed)
    for fid in (1, 2, 3):
        profile.function.add(id=fid, name=0)
    status, _, text = await post(sg, profile.SerializeToString())
    assert status == 422 and what in text and b"the limit is 2" in text, text
    assert faults.count("ok") == 0


async def test_past_the_slots_a_profile_gets_429_at_once_and_hits_stay_served(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    faults.release.set()
    sg = await start_symgate([faults.url_for("hold")], symbolize=symbolize_config(
        max_concurrent=1, max_waiting=1, deadline_s=60.0))
    hit = f"/buildid/{elfs.other.build_id}/executable"
    assert (await sg.get(hit))[0] == 200
    faults.release.clear()
    workers = sg.runner.app[STATE].symbols.workers
    # One profile in work, held by its debuginfo, and one waiting for the slot.
    first = asyncio.ensure_future(post(sg, _profile(elfs)))
    await eventually(lambda: faults.count("hold") > 1)
    second = asyncio.ensure_future(post(sg, _profile(elfs)))
    await eventually(lambda: workers.admitted_count == 2)
    status, headers, text = await post(sg, _profile(elfs))
    assert status == 429 and int(headers["Retry-After"]) > 0 and b"try again later" in text
    status, _, body = await sg.get(hit)
    assert status == 200 and body == elfs.other.executable.read_bytes()
    assert not first.done() and not second.done()
    faults.release.set()
    for pending in (first, second):
        status, headers, _ = await pending
        assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="rejected") == 1


async def test_a_profile_whose_client_left_while_it_waited_gives_its_place_up(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """aiohttp runs a handler on after its client hangs up: profiles whose clients had given
    up held every waiting place, then the slot, and were worked on for nobody, while the
    clients that were there got 429s."""
    faults.release.set()
    held = fast_upstream(faults.url_for("hold"), first_byte_timeout_s=60)  # as long as needed
    sg = await start_symgate([held], symbolize=symbolize_config(
        max_concurrent=1, max_waiting=2, deadline_s=60.0))
    assert (await sg.get(f"/buildid/{elfs.other.build_id}/executable"))[0] == 200
    faults.release.clear()
    workers = sg.runner.app[STATE].symbols.workers
    first = asyncio.ensure_future(post(sg, _profile(elfs)))  # in work, held by its debuginfo
    await eventually(lambda: faults.count("hold") > 1)
    body = _profile(elfs)
    host, port = sg.url.removeprefix("http://").split(":")
    left = []
    for _ in range(2):  # the waiting places, taken by clients that then hang up
        _reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /symbolize HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/octet-stream\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        left.append(writer)
    await eventually(lambda: workers.queued_count == 2)
    for writer in left:
        writer.transport.abort()
    await eventually(lambda: workers.admitted_count == 1)
    # Their places are free for clients that wait for an answer.
    second = asyncio.ensure_future(post(sg, _profile(elfs)))
    await eventually(lambda: workers.queued_count == 1)
    faults.release.set()
    for pending in (first, second):
        status, headers, _ = await pending
        assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert workers.admitted_count == 0
    for outcome, count in (("symbolized", 2), ("aborted", 2), ("internal", 0)):
        assert await sg.metric("symgate_symbolize_profiles_total", outcome=outcome) == count


async def test_a_profile_whose_client_left_while_its_tables_were_fetched_gives_its_slot_up(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that gave up on a cold profile (a client timeout shorter than the deadline)
    kept its worker slot until the fetch and build ended, up to deadline_s, then had its
    profile rewritten for nobody: warm profiles waited behind it. Its slot is given up now,
    while the fetch goes on for the next profile that needs it."""
    faults.release.set()
    held = fast_upstream(faults.url_for("hold"), first_byte_timeout_s=60)  # as long as needed
    sg = await start_symgate([held], symbolize=symbolize_config(
        max_concurrent=1, max_waiting=1, deadline_s=0))
    warm = make_profile([(place(elfs.other, BASES["prog"]),
                          code_addresses(elfs.other)[:5])]).SerializeToString()
    assert (await post(sg, warm))[0] == 200  # its table built
    faults.release.clear()
    before = faults.count("hold")
    workers = sg.runner.app[STATE].symbols.workers
    host, port = sg.url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    cold = _profile(elfs)
    writer.write(b"POST /symbolize HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/octet-stream\r\nContent-Length: %d\r\n\r\n" % len(cold) + cold)
    await eventually(lambda: faults.count("hold") > before)  # in its slot, its files held
    writer.transport.abort()
    await eventually(lambda: workers.admitted_count == 0)
    # The upstream still holds the cold profile's debug file: the slot is free for the warm.
    status, headers, _ = await post(sg, warm)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    fetches = faults.count("hold")
    faults.release.set()
    status, headers, _ = await post(sg, cold)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    await sg.built()
    assert faults.count("hold") == fetches  # the fetch the leaver started, not another
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 2
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="aborted") == 1
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="symbolized") == 3
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], \
        [r.getMessage() for r in caplog.records]


async def test_a_body_that_trickles_gives_its_place_up_to_a_profile_that_would_be_refused(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A place is taken before the body is read (a full server answers 429 at once), and a
    body had body_timeout_s to come: a client that trickled bodies on max_concurrent +
    max_waiting connections kept every other profile at 429, for as long as it went on. A body
    coming slower than min_body_rate now gives its place up (408) to a profile that would be
    refused; a profile whose body is in never does."""
    faults.release.set()
    held = fast_upstream(faults.url_for("hold"), first_byte_timeout_s=60)
    # 1 MiB/s: a trickle is behind past its first 64 KiB's 63 ms.
    sg = await start_symgate([held], symbolize=symbolize_config(
        max_concurrent=1, max_waiting=1, deadline_s=60.0, min_body_rate=1 << 20))
    assert (await sg.get(f"/buildid/{elfs.other.build_id}/executable"))[0] == 200
    faults.release.clear()
    workers = sg.runner.app[STATE].symbols.workers
    first = asyncio.ensure_future(post(sg, _profile(elfs)))  # in work, held by its debuginfo
    await eventually(lambda: faults.count("hold") > 1)
    host, port = sg.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /symbolize HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/octet-stream\r\nContent-Length: 100000\r\n\r\n" + b"\x0a" * 10)
    await eventually(lambda: workers.admitted_count == 2)
    await asyncio.sleep(0.2)  # three times what 10 bytes may lag at 1 MiB/s
    second = asyncio.ensure_future(post(sg, _profile(elfs)))
    answer = await asyncio.wait_for(reader.read(), 30)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"came too slowly" in answer
    writer.close()
    await eventually(lambda: workers.queued_count == 1)
    # Both places hold whole bodies now (one in work, one waiting for the slot): refused.
    status, _headers, refused = await post(sg, _profile(elfs))
    assert status == 429, refused
    faults.release.set()
    for pending in (first, second):
        status, headers, _ = await pending
        assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert workers.admitted_count == 0


async def _expecting(sg: Symgate, head: bytes
                     ) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
    """The first answer to a POST /symbolize head sent with `Expect: 100-continue`, its body
    held back as curl holds it."""
    host, port = sg.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /symbolize HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                 b"Content-Type: application/octet-stream\r\n" + head + b"\r\n")
    await writer.drain()
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30), reader, writer


async def test_a_profile_refused_before_its_body_is_never_asked_for_its_body(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """aiohttp answered `Expect: 100-continue` with a 100 before the handler ran: curl then
    sent a body the server had already refused, a 413 or a 429 after the upload."""
    faults.release.set()
    sg = await start_symgate([faults.url_for("hold")], symbolize=symbolize_config(
        max_concurrent=1, max_waiting=0, deadline_s=60.0, max_request_bytes=1 << 20))
    head, _, writer = await _expecting(sg, b"Content-Length: %d\r\n" % (2 << 20))
    assert head.startswith(b"HTTP/1.1 413 "), head
    writer.close()
    faults.release.clear()
    first = asyncio.ensure_future(post(sg, _profile(elfs)))  # the one place, held
    await eventually(lambda: faults.count("hold") > 1)
    head, _, writer = await _expecting(sg, b"Content-Length: %d\r\n" % len(_profile(elfs)))
    assert head.startswith(b"HTTP/1.1 429 "), head
    writer.close()
    faults.release.set()
    assert (await first)[0] == 200
    # Admitted: asked for its body, and answered.
    head, reader, writer = await _expecting(sg, b"Content-Length: %d\r\n"
                                            % len(_profile(elfs)))
    assert head == b"HTTP/1.1 100 Continue\r\n\r\n", head
    writer.write(_profile(elfs))
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    assert answer.startswith(b"HTTP/1.1 200 ") and b"X-Symgate-Mappings-Symbolized: 1" in answer
    writer.close()


async def _trickle(sg: Symgate, body: bytes, headers: dict[str, str] | None = None
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A POST /symbolize that announces `body` and sends only its first bytes, then stalls."""
    host, port = sg.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    more = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
    writer.write(b"POST /symbolize HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream"
                 b"\r\n" + more + b"Content-Length: %d\r\n\r\n" % len(body) + body[:3])
    await writer.drain()
    return reader, writer


async def test_an_upload_that_trickles_in_holds_no_slot_and_gets_408(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")], symbolize=symbolize_config(
        max_concurrent=1, max_waiting=1, body_timeout_s=2.0))
    workers = sg.runner.app[STATE].symbols.workers
    reader, writer = await _trickle(sg, _profile(elfs))
    await eventually(lambda: workers.admitted_count == 1)
    # The one worker slot is free for a profile whose body is in, while the slow one trickles.
    status, headers, _ = await asyncio.wait_for(post(sg, _profile(elfs)), 30)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    head = await asyncio.wait_for(reader.read(), 30)
    assert head.startswith(b"HTTP/1.1 408"), head[:100]
    writer.close()
    assert workers.admitted_count == 0


async def test_a_client_that_hangs_up_mid_upload_is_no_server_error(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    workers = sg.runner.app[STATE].symbols.workers
    _reader, writer = await _trickle(sg, _profile(elfs))
    await eventually(lambda: workers.admitted_count == 1)
    writer.transport.abort()
    await eventually(lambda: workers.admitted_count == 0)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], \
        [r.getMessage() for r in caplog.records]
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="internal") == 0
    status, _, _ = await post(sg, _profile(elfs))
    assert status == 200


async def test_pass_through_takes_a_place_of_its_own_and_a_zero_bound_is_no_bound(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate(
        [faults.url_for("ok")],
        symbolize=symbolize_config(max_concurrent=1, max_waiting=0, max_profile_mappings=0,
                                   max_profile_locations=0),
        tenants={"off": TenantConfig(symbolize=False)})
    workers = sg.runner.app[STATE].symbols.workers
    _reader, writer = await _trickle(sg, _profile(elfs))  # the one place, held
    await eventually(lambda: workers.admitted_count == 1)
    status, headers, body = await post(sg, _profile(elfs), **{"X-Scope-OrgID": "off"})
    assert status == 200 and headers["X-Symgate-Symbolize"] == "disabled"
    assert body == _profile(elfs)
    assert (await post(sg, _profile(elfs)))[0] == 429
    writer.close()
    await eventually(lambda: workers.admitted_count == 0)
    # Passed-through bodies are held whole too: as many at once as may be admitted, apart.
    _reader, writer = await _trickle(sg, _profile(elfs), {"X-Scope-OrgID": "off"})
    await eventually(lambda: workers.passing_count == 1)
    assert (await post(sg, _profile(elfs), **{"X-Scope-OrgID": "off"}))[0] == 429
    assert workers.admitted_count == 0
    writer.close()
    await eventually(lambda: workers.passing_count == 0)
    # 0 is no bound, as for the configuration's other limits, not "refuse everything".
    status, headers, _ = await post(sg, _profile(elfs))
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"


def _gzip_bomb(inflated: int, checked: bool = True) -> bytes:
    """A real gzip file of `inflated` zero bytes, about a thousandth of that long, made
    without holding it: one mebibyte of zeros compressed once, its block repeated (a full
    flush makes each block stand alone). Not `checked`: its trailer's CRC left 0, for a bomb
    too big to sum in a test that never reads it to its end."""
    chunk = 1 << 20
    zeros = bytes(chunk)
    packer = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = packer.compress(zeros) + packer.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(inflated // chunk if checked else 0):
        crc = zlib.crc32(zeros, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    trailer = (crc.to_bytes(4, "little") + (inflated & 0xFFFFFFFF).to_bytes(4, "little"))
    return header + block * (inflated // chunk) + b"\x03\x00" + trailer


async def test_gzip_bombs_are_refused_without_being_inflated(
    start_symgate: SymgateFactory, debuginfod: Debuginfod
) -> None:
    bomb = _gzip_bomb(1 << 30)
    assert len(bomb) < 1100 * 1024
    assert zlib.decompressobj(wbits=31).decompress(bomb, 8 << 20) == bytes(8 << 20)
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(workers=1))
    pids = await _started(sg)  # the one the server starts, and perhaps this one's
    before = {pid: peak_rss(pid) for pid in pids}
    results = await asyncio.gather(*(post(sg, bomb) for _ in range(4)))
    for status, _, text in results:
        assert status == 413 and b"decompresses to more than" in text
    # The limit is 256 MiB: inflating up to it, as the counting pass never does, would show.
    grown = {pid: peak_rss(pid) - rss for pid, rss in before.items()}
    assert max(grown.values()) < 64 * 1024 * 1024, grown


async def test_a_profile_waiting_for_a_slot_holds_its_body_as_sent_not_inflated(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A body sent with Content-Encoding: gzip was inflated as soon as it was read, before it
    waited for a slot: six waiting 60 KiB bodies held 60 MiB each, 16 of them 4 GiB under the
    default limits. It is measured as it comes (a bomb is refused without a slot) and inflated
    in its slot, as a body gzipped in itself is. Measured in 1 MiB pieces, six at once in
    threads of their own grew the process by 15-35 MiB; in small ones, by under 2."""
    faults.release.clear()
    sg = await start_symgate([faults.url_for("hold")], symbolize=symbolize_config(
        max_concurrent=1, max_waiting=6, deadline_s=60.0,
        max_decompressed_bytes=64 << 20))
    workers = sg.runner.app[STATE].symbols.workers
    first = asyncio.ensure_future(post(sg, _profile(elfs)))  # the slot, held by its debuginfo
    await eventually(lambda: faults.count("hold") > 1)
    # One past the limit is refused as it waits, without a slot.
    status, _, text = await post(sg, _gzip_bomb(128 << 20), **{"Content-Encoding": "gzip"})
    assert status == 413 and b"inflates to more than" in text and not first.done(), text
    reset_peak_rss()  # the server is this process (tests/harness.py)
    before = peak_rss(os.getpid())
    bomb = _gzip_bomb(60 << 20)
    waiting = [asyncio.ensure_future(post(sg, bomb, **{"Content-Encoding": "gzip"}))
               for _ in range(6)]
    await eventually(lambda: workers.queued_count == 6)
    grown = peak_rss(os.getpid()) - before
    faults.release.set()
    assert (await first)[0] == 200
    for pending in waiting:
        status, _, text = await pending
        assert status == 400 and b"not a pprof profile" in text, text
    assert grown < 8 << 20, grown


async def test_a_gzipped_body_is_measured_without_copying_what_is_left_of_it() -> None:
    """Each piece inflated left the rest of the body as the inflater's unconsumed tail, a new
    copy of it: measured in 64 KiB pieces, a 27 MB profile (200 MB inflated) was copied 3200
    times over, 3.6 s of a thread's memcpy (under the GIL) to measure it where 1 MiB pieces
    took 0.46 s, and each copy a second body in memory. Fed a slice at a time, what is copied
    is at most a slice."""
    body = gzip.compress(os.urandom(16 << 20), 1)  # incompressible: inflates to its size
    tracemalloc.start()
    try:
        await measure_body(body, GZIP, 32 << 20, "limit")
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak


async def test_a_gzipped_body_of_many_members_is_inflated_in_few_thread_hops() -> None:
    """What measure_body passed was inflated a piece a thread hop: gzip's members are each a
    piece of their own, so a body of 150,000 one-byte members (3 MB, which measures in half a
    second) took as many hops, 38 s of a worker slot, and a 31 MB one minutes. Now as it was
    measured: a hop takes as many pieces as come to COUNTED_HOP bytes."""
    body = gzip.compress(b"a", 1) * 20_000
    loop = asyncio.get_running_loop()
    hops = _CountingExecutor(max_workers=2)
    loop.set_default_executor(hops)
    await measure_body(body, GZIP, 1 << 20, "limit")
    measured = hops.submitted
    assert await inflate_measured(body, GZIP, 1 << 20, "limit") == b"a" * 20_000
    assert measured <= 2 and hops.submitted - measured <= 2, (measured, hops.submitted)


async def test_a_gzip_bomb_whose_client_left_is_measured_no_further(
    start_symgate: SymgateFactory, debuginfod: Debuginfod
) -> None:
    """aiohttp runs a handler on after its client hangs up: under a large limit, a bomb was
    measured to its end for nobody, 8 GiB in a thousand thread hops, seconds of a core. It
    stops at the next hop, and the profile is counted aborted."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(
        max_decompressed_bytes=64 << 30))
    bomb = _gzip_bomb(8 << 30, checked=False)
    hops = _CountingExecutor(max_workers=2)
    asyncio.get_running_loop().set_default_executor(hops)
    host, port = sg.url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /symbolize HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/octet-stream\r\nContent-Encoding: gzip\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(bomb) + bomb)
    await writer.drain()
    await eventually(lambda: hops.submitted >= 1)  # its body in, and being measured
    writer.transport.abort()

    async def counted() -> bool:
        return await sg.metric("symgate_symbolize_profiles_total", outcome="aborted") == 1

    await eventually(counted)
    assert hops.submitted < 100, hops.submitted


async def test_an_uploaded_body_of_many_gzip_members_is_inflated_in_few_thread_hops() -> None:
    """An upload's body (inflated as it streams) a piece a thread hop, as inflate_measured
    was: a hop now takes pieces up to about a mebibyte."""
    body = gzip.compress(b"a", 1) * 20_000

    async def chunks() -> AsyncIterator[bytes]:
        for at in range(0, len(body), 1 << 16):
            yield body[at: at + (1 << 16)]

    loop = asyncio.get_running_loop()
    hops = _CountingExecutor(max_workers=2)
    loop.set_default_executor(hops)
    got = b"".join([part async for part in inflated(chunks(), GZIP)])
    assert got == b"a" * 20_000
    # One hop a chunk (and the one that finds it spent): not one a member.
    assert hops.submitted <= 2 * (len(body) // (1 << 16) + 1), hops.submitted


class _CountingExecutor(ThreadPoolExecutor):
    """The event loop's default executor, counting what is given to its threads."""

    submitted = 0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


async def test_a_sent_answer_leaves_no_mapping_behind_on_a_kept_alive_connection(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """An answer is a view of the memory file the worker wrote it into. aiohttp keeps a
    kept-alive connection's last response until its next request: the view is let go of once
    the answer is sent, and with it the mapping and its descriptor."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    for _ in range(3):  # over one pooled connection, as the harness's client keeps it
        status, headers, body = await post(sg, _profile(elfs))
        assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
        assert all(loc.line for loc in parse(body).location)  # sent whole
    # And many at once, over as many connections, some of them gzipped.
    bodies = [_profile(elfs) for _ in range(12)]
    bodies = [zlib.compress(b, wbits=31) if i % 3 == 0 else b for i, b in enumerate(bodies)]
    answers = await asyncio.gather(*(post(sg, b) for b in bodies))
    assert all(status == 200 and all(loc.line for loc in parse(body).location)
               for status, _h, body in answers)
    mine = os.getpid()  # the serving process is this one; its workers map nothing of it
    held = [target for fd in os.listdir(f"/proc/{mine}/fd")
            if "symgate-answer" in (target := _readlink(f"/proc/{mine}/fd/{fd}"))]
    with open(f"/proc/{mine}/maps") as f:
        mapped = [line for line in f if "symgate-answer" in line]
    assert not held and not mapped, (held, mapped)


@pytest.mark.parametrize("enabled, counted_as", [(True, "symbolized"), (False, "disabled")])
async def test_a_profile_whose_client_left_mid_answer_is_counted_aborted(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, enabled: bool,
    counted_as: str
) -> None:
    """It was counted `symbolized` on the handler's return, before a byte of its answer went
    (`disabled` with symbolizing off, the profile going back as it came): a dashboard of
    profiles answered counted answers nobody got."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(enabled=enabled))
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    profile.string_table.append("x" * (24 << 20))  # an answer past what the sockets hold
    body = profile.SerializeToString()
    host, port = sg.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST /symbolize HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                 f"application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body)
    await writer.drain()
    assert (await reader.readline()).startswith(b"HTTP/1.1 200"), "no answer"
    # Gone with most of the answer unread: a reset, as a client killed mid-download.
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()

    async def counted() -> float:
        return sum([await sg.metric("symgate_symbolize_profiles_total", outcome=outcome)
                    for outcome in ("aborted", counted_as, "unchanged")])

    await eventually(counted)
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="aborted") == 1
    assert await sg.metric("symgate_symbolize_profiles_total", outcome=counted_as) == 0
    # And the server answers the next one whole, counted once.
    raw = _profile(elfs)
    status, headers, got = await post(sg, raw)
    assert status == 200 and headers["X-Symgate-Symbolize"] == counted_as
    assert got == raw if not enabled else headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert await sg.metric("symgate_symbolize_profiles_total", outcome=counted_as) == 1


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


async def test_a_worker_killed_mid_build_is_a_503_and_the_next_profile_builds_the_table(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    """A build that dies with its worker is not the build ID's outcome: a 200 with the mapping
    left bare would be kept by a profiling backend for good, never sent again."""
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    tree = libc_tree(tmp_path / "debug")
    sg = await start_symgate([], symbolize=symbolize_config(workers=1, debug_dirs=(tree,)))
    state = sg.runner.app[STATE]
    libc = place(Elf("libc.so.6", LIBC_ID, LIBC, LIBC_DEBUG, ()), BASES["libmix.so"])
    body = make_profile([(libc, [libc.text.vaddr + i * 4096 for i in range(50)])]
                        ).SerializeToString()
    pids = await _started(sg)
    pending = asyncio.ensure_future(post(sg, body))
    # Resolving, with a job in the pool: libc's build, a few tenths of a second of it.
    await eventually(lambda: state.symbols.busy
                                   and state.symbols.workers.pool.in_flight > 0)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    status, headers, text = await pending
    assert status == 503 and "Retry-After" in headers, (status, headers, text)
    status, headers, _ = await post(sg, body)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers


def _writing_an_answer(pids: list[int]) -> list[int]:
    """Which of these workers hold a finish's answer file open (proxy.symbols.shared_bodies):
    the ones rewriting a profile now."""
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for name in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if "symgate-answer" in os.readlink(f"/proc/{pid}/fd/{name}"):
                        found.append(pid)
                        break
    return found


async def test_a_rewrite_its_profile_was_refused_during_keeps_its_slot_until_it_ends(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """A corrupt sample found while the rewrite runs refuses the profile at once, but the
    rewrite goes on in its worker (a process's job cannot be taken back): until it ends it is
    one of the `workers` profile jobs the pool holds at once, or refused profiles could fill
    the processes kept for builds, past the admission gate."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(workers=1))
    workers = sg.runner.app[STATE].symbols.workers
    assert (await post(sg, _profile(elfs)))[0] == 200  # the table built, a checker started
    addresses = code_addresses(elfs.prog)
    big = make_profile([(place(elfs.prog, BASES["prog"]), (addresses * 400)[:100_000])])
    corrupt = RawProfile.FromString(big.SerializeToString())
    corrupt.sample[2] = b"\x0a\x05\x01"
    checkers = workers.checks.pids()
    assert checkers
    with stopped(checkers):  # the check waits: the rewrite is reached
        refused = asyncio.ensure_future(post(sg, corrupt.SerializeToString()))
        rewriting: list[int] = []
        for _ in range(20000):
            if rewriting := _writing_an_answer(workers.pool.pids()):
                break
            assert not refused.done(), refused.result()
            await asyncio.sleep(0.001)
        for pid in rewriting:
            os.kill(pid, signal.SIGSTOP)
    try:
        status, _, text = await refused
        assert status == 400 and b"sample 2" in text, text
        after = asyncio.ensure_future(post(sg, _profile(elfs)))
        done, _ = await asyncio.wait([after], timeout=1.5)
        assert not done, "a profile's job went to the pool beside a refused one's still there"
    finally:
        for pid in rewriting:
            os.kill(pid, signal.SIGCONT)
    status, headers, _ = await after
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"


async def _libc_server(start_symgate: SymgateFactory, tmp_path: Path
                       ) -> tuple[Symgate, Path, bytes]:
    """A server with one build worker over libc's debug tree, started; its symtabs folder,
    and a profile of 50 libc addresses, whose table takes a build long enough to be caught
    writing."""
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    tree = libc_tree(tmp_path / "debug")
    sg = await start_symgate([], symbolize=symbolize_config(workers=1, debug_dirs=(tree,)))
    libc = place(Elf("libc.so.6", LIBC_ID, LIBC, LIBC_DEBUG, ()), BASES["libmix.so"])
    body = make_profile([(libc, [libc.text.vaddr + i * 4096 for i in range(50)])]
                        ).SerializeToString()
    await _started(sg)
    return sg, sg.config.server.data_dir / "symtabs", body


async def _builder_writing(symtabs: Path) -> int:
    """The pid of the builder once it writes a table's file (`<build ID>.[<part>.]<pid>.tmp`)."""
    for _ in range(20000):  # bounded: until the builder writes
        if writing := list(symtabs.rglob("*.tmp")):
            return int(writing[0].name.removesuffix(".tmp").rpartition(".")[2])
        await asyncio.sleep(0.0005)
    raise AssertionError("no table was written")


async def test_a_build_worker_killed_mid_write_leaves_no_half_written_table(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    """What a killed builder was writing (`<build ID>.<its pid>.tmp`, libc's a few MB) goes
    with it, not at the server's next start: an OOM killer that takes the builder of one big
    file at each try would otherwise fill the disk with them while the server runs on."""
    sg, symtabs, body = await _libc_server(start_symgate, tmp_path)
    pending = asyncio.ensure_future(post(sg, body))
    writer = await _builder_writing(symtabs)
    os.kill(writer, signal.SIGKILL)
    status, headers, text = await pending
    assert status == 503, (status, headers, text)
    assert not list(symtabs.rglob("*.tmp"))
    status, headers, _ = await post(sg, body)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers


@contextlib.contextmanager
def _orphans_kept_unreaped() -> Iterator[None]:
    """Orphans of this process's descendants become its children (PR_SET_CHILD_SUBREAPER)
    and stay zombies until reaped: dead, though a look by pid finds them, as a process
    killed is until the kernel has torn it down."""
    libc = ctypes.CDLL(None, use_errno=True)
    subreaper = 36  # PR_SET_CHILD_SUBREAPER
    assert libc.prctl(subreaper, 1, 0, 0, 0) == 0
    try:
        yield
    finally:
        libc.prctl(subreaper, 0, 0, 0, 0)


async def test_a_worker_killed_as_its_builder_writes_leaves_no_half_written_table(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    """A worker killed while its builder writes a table: the builder dies with it (its
    parent-death signal), but the server hears of the worker's death while the builder is
    still dying (a libc build has hundreds of MB to tear down), and what the builder wrote
    (`<build ID>.inf.<pid>.tmp`, the inflated debug file) was left as a live writer's, until
    the server's next start, though the table's build lock was the server's. Here the
    builder stays dying (a zombie) for as long as the test needs."""
    sg, symtabs, body = await _libc_server(start_symgate, tmp_path)
    with _orphans_kept_unreaped():
        pending = asyncio.ensure_future(post(sg, body))
        builder = await _builder_writing(symtabs)
        stat = Path(f"/proc/{builder}/stat").read_text()
        worker = int(stat.rpartition(")")[2].split()[1])
        os.kill(worker, signal.SIGKILL)
        try:
            status, headers, text = await pending
            assert status == 503, (status, headers, text)
            assert not list(symtabs.rglob("*.tmp"))
        finally:
            os.waitpid(builder, 0)  # this process's now, reparented
    status, headers, _ = await post(sg, body)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    assert not list(symtabs.rglob("*.tmp"))
