"""Upstreams that misbehave: what the client sees, what the metrics say, that nothing bad is
cached (the next request goes upstream again)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from multidict import CIMultiDict

from proxy.config import CacheConfig, FetchConfig, FetchPolicy, SymbolizeConfig
from tests.elfs import ElfSet
from tests.faults import SLOW_HOPS, FaultUpstream
from tests.harness import SymgateFactory, fast_upstream, read_broken
from tests.processes import debuginfod_find

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


async def test_slow_first_byte_is_504_or_406_for_elfutils_and_not_cached(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    faults.first_byte_delay = 3
    sg = await start_symgate([fast_upstream(faults.url_for("slow-first-byte"),
                                            first_byte_timeout_s=0.5, retries=0)])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    status, headers, body = await sg.get(path)
    assert status == 504 and headers["Retry-After"] == "30"
    assert b"no response in time" in body
    status, _, _ = await sg.get(path, headers={"User-Agent": "elfutils/0.188,Linux/x86_64"})
    assert status == 406  # elfutils' client would cache any other error as a miss
    assert faults.count("slow-first-byte") == 2  # nothing remembered: each asked again
    up = faults.url_for("slow-first-byte")
    assert await sg.metric("symgate_upstream_requests_total", upstream=up, result="timeout") == 2
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="timeout") == 2


@pytest.mark.parametrize("mode", ["hang-mid-body", "reset-mid-body", "truncated"])
async def test_body_cut_off_mid_stream_breaks_the_response_and_is_not_cached(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, mode: str
) -> None:
    sg = await start_symgate([fast_upstream(faults.url_for(mode), read_timeout_s=0.5)])
    size = elfs.big.debug.stat().st_size
    url = f"{sg.url}/buildid/{elfs.big.build_id}/debuginfo"
    status, got, broken = await read_broken(url)
    # Big enough to be streamed before the failure: the status line was 200, the body broken.
    assert status == 200 and broken and got < size
    assert await sg.metric("symgate_aborted_responses_total") == 1
    failures = await sg.metric("symgate_upstream_body_failures_total",
                               upstream=faults.url_for(mode),
                               result="timeout" if mode == "hang-mid-body" else "upstream_error")
    assert failures == 1
    assert await sg.metric("symgate_cache_entries") == 0
    assert not any((sg.config.cache_dir / "objects").rglob("*"))
    # This process's temp folder and its lock stay while the server lives; no download does.
    assert not [p for p in (sg.config.cache_dir / "tmp").rglob("*")
                if p.is_file() and p.suffix != ".lock"]
    status, got, broken = await read_broken(url)
    assert broken and faults.count(mode) == 2


@pytest.mark.parametrize("mode", ["reset-mid-body", "truncated"])
async def test_a_cut_off_download_is_not_a_miss_elfutils_keeps(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path, mode: str
) -> None:
    """The upstream fails mid-body after the response began: the connection is cut with a
    reset. Closed with a FIN instead, libcurl reports a partial file, which elfutils' client
    takes for "not found" and keeps as a miss for 10 minutes (an empty file in its cache),
    answering every later debuginfod-find from it without asking: a file that exists,
    missing for ten minutes because one download broke."""
    sg = await start_symgate([fast_upstream(faults.url_for(mode), retries=0)])
    cache = tmp_path / "client"
    for attempt in (1, 2):
        asked = faults.count(mode)
        found = await asyncio.to_thread(debuginfod_find, sg.url, cache, "debuginfo",
                                        elfs.big.build_id)
        assert found.returncode != 0, found.stdout
        assert faults.count(mode) > asked, f"attempt {attempt} answered from a kept miss"
        kept = [p for p in (cache / elfs.big.build_id).glob("*")]
        assert not kept, f"elfutils kept a miss: {found.stderr}"


async def test_small_file_cut_off_breaks_the_response_it_started(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    # The response starts with the upstream's first bytes, whatever the size: a body that
    # then stops short can only break the connection, never end like a whole file.
    sg = await start_symgate([fast_upstream(faults.url_for("truncated"), retries=0)])
    status, got, broken = await read_broken(
        f"{sg.url}/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and broken
    assert got < elfs.prog.debug.stat().st_size
    assert await sg.metric("symgate_cache_entries") == 0


async def test_wrong_build_id_is_502_counted_and_not_cached(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("wrong-bytes")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    status, _, body = await sg.get(path)
    assert status == 502
    assert f"build ID {elfs.other.build_id}, not {elfs.prog.build_id}".encode() in body
    assert await sg.metric("symgate_verification_failures_total", kind="debuginfo",
                           reason="build_id_mismatch",
                           upstream=faults.url_for("wrong-bytes")) == 1
    status, _, _ = await sg.get(path)
    assert status == 502 and faults.count("wrong-bytes") == 2
    assert await sg.metric("symgate_cache_entries") == 0


@pytest.mark.parametrize("mode", ["wrong-bytes", "huge-size"])
@pytest.mark.parametrize("policy", ["in_order", "race"])
async def test_an_upstream_that_sent_the_wrong_file_is_asked_after_one_that_has_it(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, policy: FetchPolicy,
    mode: str,
) -> None:
    """The first upstream answers with another build ID's file (or says the file is a
    terabyte, past max_artifact_bytes), the second has the right one. The fetch fails before
    the client got a byte, and is made again at once with the liar asked after the others:
    the client gets the right file, which is kept, and so does every later request, instead
    of a 502 (or 406), the first one's included."""
    sg = await start_symgate([faults.url_for(mode), faults.url_for("hold")],
                             fetch=FetchConfig(policy=policy))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    first = asyncio.ensure_future(sg.get(path))  # "hold" answers nothing yet: the liar's is first
    reason = "build_id_mismatch" if mode == "wrong-bytes" else "too_large"
    while not await sg.metric("symgate_verification_failures_total", kind="debuginfo",
                              reason=reason, upstream=faults.url_for(mode)):
        await asyncio.sleep(0.01)
    assert not first.done()  # asking "hold" now, which the liar comes after
    faults.release.set()
    status, _, body = await first
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert faults.count(mode) == 1
    await sg.settled()
    assert await sg.metric("symgate_cache_entries") == 1
    assert (await sg.get(path))[0] == 200 and faults.count(mode) == 1


async def test_a_fetch_made_again_after_a_lie_is_made_once_for_all_its_clients(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Ten clients wait on the liar's answer: each asks again, and they share one fetch from
    the next upstream, as they shared the first."""
    sg = await start_symgate([faults.url_for("wrong-bytes"), faults.url_for("hold")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    clients = [asyncio.ensure_future(sg.get(path)) for _ in range(10)]
    while not await sg.metric("symgate_verification_failures_total", kind="debuginfo",
                              reason="build_id_mismatch", upstream=faults.url_for("wrong-bytes")):
        await asyncio.sleep(0.01)
    faults.release.set()
    for status, _, body in await asyncio.gather(*clients):
        assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert faults.count("wrong-bytes") == 1 and faults.count("hold") == 1


async def test_a_lie_is_asked_again_by_the_clients_that_followed_it_from_another_process(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """A fetch that fails on a liar's answer, other upstreams left, is asked again by its
    clients that got no byte of it. Those of another process on the data dir, which followed
    it, were given its 502 instead (a third of them, as a writer's own client asked again
    before they looked, and they followed that fetch; all of them here, where that client had
    asked again once already): they ask again too now, the liar after the others."""
    ups = [fast_upstream(faults.url_for(mode), retries=0)
           for mode in ("wrong-bytes", "hold-wrong", "ok")]
    a = await start_symgate(ups, data_dir=tmp_path / "d")
    b = await start_symgate(ups, data_dir=tmp_path / "d")
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    # The first lies at once; the client asks again, which asks the second first.
    writers = asyncio.ensure_future(a.get(path))
    while not faults.count("hold-wrong"):
        await asyncio.sleep(0.01)
    following = asyncio.ensure_future(b.get(path))
    while not await b.metric("symgate_fetch_waiters"):
        await asyncio.sleep(0.01)  # b's client waits on a's fetch
    faults.release.set()  # the second lies too: a's client, which asked again once, has a 502
    assert (await writers)[0] == 502
    status, _, body = await following
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert faults.count("hold-wrong") == 1 and faults.count("ok") == 1


async def test_a_lie_with_no_other_upstream_to_ask_is_not_fetched_again_at_once(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Asked again, the only upstream would lie again: the client has the 502."""
    sg = await start_symgate([faults.url_for("wrong-bytes")])
    status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 502 and faults.count("wrong-bytes") == 1


async def test_a_doubted_upstream_is_still_asked_when_no_other_has_the_file(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Doubt reorders, never hides: with the others missing the file, the liar's answer is
    still the answer (502, not a 404 that elfutils' client would keep for ten minutes)."""
    sg = await start_symgate([faults.url_for("wrong-bytes"), faults.url_for("notfound")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 502
    # Its lie made the fetch again at once: the other upstream first, then the liar.
    assert [p.split("/")[1] for p in faults.paths] == ["wrong-bytes", "notfound", "wrong-bytes"]
    await sg.settled()
    status, _, body = await sg.get(path)
    assert status == 502 and b"build ID" in body
    # The other's miss is remembered: the liar alone is asked, once.
    assert [p.split("/")[1] for p in faults.paths[3:]] == ["wrong-bytes"]
    # Counted against the upstream that lied; the honest one's series is there, at 0.
    for upstream, lies in (("wrong-bytes", 3), ("notfound", 0)):
        assert await sg.metric("symgate_verification_failures_total", kind="debuginfo",
                               reason="build_id_mismatch",
                               upstream=faults.url_for(upstream)) == lies


async def test_wrong_build_id_of_a_streamed_file_breaks_the_response(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("wrong-big")])
    status, got, broken = await read_broken(
        f"{sg.url}/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and broken
    # Streamed as it came, and cut where the client's stream was when the verdict came (the
    # build ID is read as the body ends): never the whole body, whose last byte waits for it.
    assert 0 < got < elfs.big.debug.stat().st_size
    assert await sg.metric("symgate_verification_failures_total", kind="debuginfo",
                           reason="build_id_mismatch", upstream=faults.url_for("wrong-big")) == 1
    assert await sg.metric("symgate_cache_entries") == 0


async def test_not_elf_is_rejected(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    # The upstream's "executable" for this ID is a C source file: 200, but not ELF at all.
    faults.by_id[elfs.prog.build_id] = type(elfs.prog)(
        "fake", elfs.prog.build_id, elfs.prog.sources[0], elfs.prog.sources[0], ())
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/executable")
    assert status == 502 and b"build ID none" in body
    assert await sg.metric("symgate_verification_failures_total", kind="executable",
                           reason="not_elf", upstream=faults.url_for("ok")) == 1


async def test_a_body_that_is_no_elf_file_is_refused_at_its_first_bytes_evicting_nothing(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A 200 of no stated size that never ends and is no ELF file (zeros: an error page or a
    broken server's stream would do). The budget makes room as a body grows: until it was cut
    at max_artifact_bytes, and failed, it had evicted the cached files for bytes that could
    never be kept; its client had a 200 cut off. Its first bytes tell it is no debug file."""
    sg = await start_symgate(
        [faults.url_for("ok"), faults.url_for("zeros")],
        cache=CacheConfig(max_bytes=40 << 20, max_artifact_bytes=30 << 20),
        symbolize=SymbolizeConfig(enabled=False))  # a table's build holds its file a while
    assert (await sg.get(f"/buildid/{elfs.big.build_id}/debuginfo"))[0] == 200
    await sg.settled()
    status, _, body = await sg.get("/buildid/" + "ab" * 20 + "/debuginfo")  # "ok" lacks it
    assert status == 502 and b"build ID none (not ELF)" in body
    await sg.settled()
    assert await sg.metric("symgate_cache_evictions_total") == 0
    assert await sg.metric("symgate_cache_entries") == 1
    assert await sg.metric("symgate_verification_failures_total", kind="debuginfo",
                           reason="not_elf", upstream=faults.url_for("zeros")) == 1


async def test_500s_are_retried_then_502_and_not_remembered(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([fast_upstream(faults.url_for("status500"), retries=2)])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    status, headers, body = await sg.get(path)
    assert status == 502 and "Retry-After" in headers and b"answered 500" in body
    assert faults.count("status500") == 3
    status, _, _ = await sg.get(path)
    assert status == 502 and faults.count("status500") == 6
    assert await sg.metric("symgate_upstream_requests_total",
                           upstream=faults.url_for("status500"), result="upstream_error") == 6


@pytest.mark.parametrize("wait", ["120", "Sun, 06 Nov 2994 08:49:37 GMT", "0"])
async def test_a_429_is_not_asked_again_sooner_than_its_retry_after_says(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, wait: str
) -> None:
    """A rate-limited upstream says how long to wait: its retries, a fraction of a second
    apart, would only be refused again and add to its load. A wait shorter than the backoff
    (0) is retried as any transient failure is."""
    faults.retry_after = wait
    sg = await start_symgate([fast_upstream(faults.url_for("busy"), retries=2)])
    status, headers, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 502 and "Retry-After" in headers and b"answered 429" in body
    assert faults.count("busy") == (3 if wait == "0" else 1)
    assert (b"Retry-After: 0 s" if wait == "0" else b"Retry-After: ") in body
    # Its clients are not sent back sooner than it asked (within an hour), nor sooner than
    # the server's own retry_after_s.
    assert headers["Retry-After"] == {"120": "120", "0": "30"}.get(wait, "3600")
    # Nor is it asked again meanwhile, for any file: each miss of the site asked it again.
    status, headers, body = await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo")
    assert status == 502
    if wait == "0":
        assert faults.count("busy") == 6
    else:
        assert faults.count("busy") == 1 and b"as its Retry-After asked" in body, body
        assert int(headers["Retry-After"]) >= 100


async def test_a_retry_after_holds_past_the_cool_down_of_the_breaker_it_opened(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """The 429 that opens the breaker (the threshold's last failure, or a half-open trial's)
    says how long to wait: the breaker's cool-down, shorter, must not have it asked sooner.
    It was, when the retry found the breaker open and gave up before resting it."""
    faults.retry_after = "120"
    sg = await start_symgate([fast_upstream(faults.url_for("busy"), retries=1,
                                            breaker_failures=1, breaker_cooldown_s=0.2)])
    status, headers, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 502 and headers["Retry-After"] == "120"
    await asyncio.sleep(0.3)  # past the cool-down, far from the 120 s asked
    status, headers, body = await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo")
    assert status == 502 and b"as its Retry-After asked" in body, body
    assert faults.count("busy") == 1 and int(headers["Retry-After"]) >= 100


async def test_a_resting_upstream_leaves_the_others_to_answer(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Asked first, a rate-limited upstream said how long to wait: until then the next one
    answers every miss, and the first is not asked."""
    sg = await start_symgate([fast_upstream(faults.url_for("busy")), faults.url_for("ok")])
    for elf in (elfs.prog, elfs.other):
        status, _, body = await sg.get(f"/buildid/{elf.build_id}/debuginfo")
        assert status == 200 and body == elf.debug.read_bytes()
    assert faults.count("busy") == 1 and faults.count("ok") == 2
    assert await sg.metric("symgate_upstream_breaker_state",
                           upstream=faults.url_for("busy")) == 2


async def test_flaky_upstream_succeeds_after_a_retry(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    faults.flaky_failures = 1
    sg = await start_symgate([fast_upstream(faults.url_for("flaky"), retries=1)])
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert faults.count("flaky") == 2


async def test_circuit_breaker_opens_skips_and_recovers(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    up = faults.url_for("gate")
    # A cooldown that outlasts the checks below on a loaded machine (0.5 s did not, once).
    sg = await start_symgate([fast_upstream(up, retries=0, breaker_failures=2,
                                            breaker_cooldown_s=2.0)])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    # Two different files: one failing twice would count once.
    for elf in (elfs.prog, elfs.other):
        assert (await sg.get(f"/buildid/{elf.build_id}/debuginfo"))[0] == 502
    assert await sg.metric("symgate_upstream_breaker_state", upstream=up) == 2
    assert await sg.metric("symgate_upstream_breaker_trips_total", upstream=up) == 1
    status, _, body = await sg.get(path)
    assert status == 502 and b"circuit breaker open" in body
    assert faults.count("gate") == 2  # the open breaker kept the third request local
    faults.gate_open = True
    await asyncio.sleep(2.1)
    status, _, _ = await sg.get(path)
    assert status == 200 and faults.count("gate") == 3
    assert await sg.metric("symgate_upstream_breaker_state", upstream=up) == 0


async def test_redirects_are_followed_but_not_to_other_schemes_or_forever(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("redirect")])
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    for mode, reason in (("redirect-file", b"bad redirect"),
                         ("redirect-loop", b"too many redirects")):
        sg = await start_symgate([faults.url_for(mode)], data_dir=sg.config.server.data_dir
                                 .with_name(mode))
        status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
        assert status == 502 and reason in body, body
    assert faults.count("redirect-loop") == 4  # the first request and 3 hops, then it stops


async def test_a_fetch_through_redirects_ends_at_the_upstreams_total_timeout(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """total_timeout_s bounds an attempt, every hop of it: each hop had one of its own, so an
    upstream that sent each hop's headers half a bound late held the client for 21 halves."""
    sg = await start_symgate([fast_upstream(
        faults.url_for("slow-hops"), total_timeout_s=1, first_byte_timeout_s=120,
        read_timeout_s=120, retries=0, max_redirects=SLOW_HOPS)])
    status, _, body = await asyncio.wait_for(
        sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"), 60)
    assert status == 504 and b"no response in time" in body, body[:200]


async def test_upstream_credentials_are_sent(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([fast_upstream(faults.url_for("auth"), retries=0)])
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 502 and b"answered 401" in body
    sg = await start_symgate(
        [fast_upstream(faults.url_for("auth"), headers={"Authorization": "Bearer sesame"})],
        data_dir=sg.config.server.data_dir.with_name("with-auth"))
    status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200


async def test_user_agent_and_forwarded_for_go_upstream(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo",
                 headers={"X-Forwarded-For": "10.1.2.3", "User-Agent": "gdb/13.1"})
    sent = faults.headers[-1]
    # The client's, with symgate's appended, as a federating elfutils debuginfod relays it.
    assert sent["User-Agent"] == "gdb/13.1 symgate/0.1.0"
    assert sent["X-Forwarded-For"] == "10.1.2.3, 127.0.0.1"
    assert sent["Via"].startswith("1.1 symgate-")  # how a loop of caches is recognised


async def test_forwarding_loop_stops_at_the_hop_limit(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    hops = ", ".join(f"10.0.0.{i}" for i in range(8))
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo",
                                   headers={"X-Forwarded-For": hops})
    assert status == 404 and b"forwarded-ttl-limit" in body
    assert faults.count("ok") == 0
    # Below the limit it goes upstream; once cached, even a long chain gets the hit.
    status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200
    status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo",
                                headers={"X-Forwarded-For": hops})
    assert status == 200 and faults.count("ok") == 1


async def test_every_forwarded_for_line_counts_and_goes_upstream(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A proxy that adds an X-Forwarded-For line of its own beside the one it got (HAProxy's
    forwardfor): only the first line was read, so the hops of the others were neither
    counted towards forwarded_ttl_limit nor passed on."""
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    lines = [("X-Forwarded-For", ", ".join(f"10.0.0.{i}" for i in range(7))),
             ("X-Forwarded-For", "10.0.1.1")]
    status, _, body = await sg.get(path, headers=CIMultiDict(lines))
    assert status == 404 and b"forwarded-ttl-limit" in body, body
    status, _, _ = await sg.get(path, headers=CIMultiDict(
        [("X-Forwarded-For", "10.1.2.3"), ("X-Forwarded-For", "10.4.5.6")]))
    assert status == 200
    assert faults.headers[-1]["X-Forwarded-For"] == "10.1.2.3, 10.4.5.6, 127.0.0.1"


async def test_only_if_cached_is_heard_on_any_cache_control_line(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Cache-Control may come as several lines (a proxy adds its own): only-if-cached on the
    second was not heard, and the file was fetched for a client that asked for none."""
    sg = await start_symgate([faults.url_for("ok")])
    status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo",
                                headers=CIMultiDict([("Cache-Control", "max-age=0"),
                                                     ("Cache-Control", "Only-If-Cached")]))
    assert status == 504 and faults.count("ok") == 0


async def test_chunked_upstream_without_length_is_cached_and_head_waits_for_size(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("chunked")])
    status, headers = await sg.head(f"/buildid/{elfs.big.build_id}/debuginfo")
    size = elfs.big.debug.stat().st_size
    assert status == 200 and int(headers["Content-Length"]) == size
    status, _, body = await sg.get(f"/buildid/{elfs.big.build_id}/debuginfo")
    assert status == 200 and body == elfs.big.debug.read_bytes()
    assert faults.count("chunked") == 1
