"""`symgate serve --workers N`: N processes on one port, one set of metrics, one fetch per
artifact across them, and a supervisor that replaces a dead worker and takes them all along
when it dies.

Which worker the kernel hands a connection to is not ours to choose, so the cross-process
fetch is driven deterministically with two single-worker servers on one data dir: the same
board (proxy.artifacts.board) is what workers of one server share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tempfile
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.db_locks import database_held
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, eventually
from tests.processes import (
    Start,
    descendants,
    reap_all,
    spawn_serve,
    stop_serve,
    stopped,
    wait_until_serving,
)


def _workers_of(proc: asyncio.subprocess.Process) -> list[int]:
    """The serving processes under a supervisor: its children that are forked workers."""
    found = []
    for pid in descendants(proc.pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # Forked: the supervisor's command line; its helpers, the shared forkserver and
        # resource tracker, are named (proxy.symbols.forked_helpers).
        if parent == proc.pid and not name.startswith("symgate-"):
            found.append(pid)
    return sorted(found)


async def _requests_total(s: aiohttp.ClientSession, base: str) -> float:
    async with s.get(base + "/metrics") as r:
        text = await r.text()
        assert r.status == 200, text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "symgate_requests_total"
               and sample.labels.get("endpoint") == "buildid")


async def test_workers_share_one_port_and_one_set_of_metrics(
    serve: Start, debuginfod: Debuginfod
) -> None:
    base, proc = await serve(debuginfod.url, workers=2)
    assert len(_workers_of(proc)) == 2
    # A new connection each: the kernel spreads them over both workers.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        for _ in range(30):
            async with s.get(f"{base}/buildid/{'ab' * 20}/debuginfo") as r:
                assert r.status == 404
        # Whichever worker answers /metrics, it tells the whole server's counts.
        totals = {await _requests_total(s, base) for _ in range(10)}
    assert totals == {30.0}


async def test_a_scrape_meets_a_metrics_file_a_starting_worker_has_only_created(
    serve: Start, debuginfod: Debuginfod
) -> None:
    """prometheus-client creates a process's file empty, then sizes it: a scrape between
    the two (a worker starting), or any scrape after a worker killed between them, read
    an empty file and answered 500."""
    base, proc = await serve(debuginfod.url, workers=2)
    [folder] = Path(tempfile.gettempdir()).glob(f"symgate-metrics-{proc.pid}.*-*")
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        for _ in range(3):
            async with s.get(f"{base}/buildid/{'ab' * 20}/debuginfo") as r:
                assert r.status == 404
        # The state prometheus-client's MmapedDict leaves between open() and truncate().
        (folder / f"counter_{2**22 + 1}.db").touch()
        (folder / f"histogram_{2**22 + 1}.db").touch()
        for _ in range(4):  # whichever worker answers
            assert await _requests_total(s, base) == 3.0


async def _replace_a_worker(proc: asyncio.subprocess.Process, workers: int = 2,
                            victim: int | None = None) -> None:
    """SIGKILL one of the server's workers (`victim`, or any); return once the supervisor has
    started another (which may not serve yet)."""
    victim = victim or _workers_of(proc)[0]
    os.kill(victim, signal.SIGKILL)
    for _ in range(300):  # bounded: until the supervisor has started another
        now = _workers_of(proc)
        if len(now) == workers and victim not in now:
            break
        await asyncio.sleep(0.1)
    if not (len(now) == workers and victim not in now):
        if proc.returncode is None:  # the supervisor itself may have given up
            proc.terminate()  # then what it said, for the report
        said = await asyncio.wait_for(proc.stdout.read(), 60) if proc.stdout else b""
        pytest.fail(f"workers {now} after killing {victim}; the server said:\n"
                    + said.decode(errors="replace")[-3000:])


async def test_a_replaced_workers_counts_stay_and_its_files_go(
    serve: Start, debuginfod: Debuginfod
) -> None:
    """prometheus-client keeps a dead process's counter and histogram files, so that its
    counts stay in the totals: one pair for every worker ever replaced, read by every scrape,
    without end. They are folded into one archive: the totals the same, the files the live
    workers' alone."""
    base, proc = await serve(debuginfod.url, workers=2)
    [folder] = Path(tempfile.gettempdir()).glob(f"symgate-metrics-{proc.pid}.*-*")
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        for replaced in range(1, 4):
            for _ in range(10):
                async with s.get(f"{base}/buildid/{'ab' * 20}/debuginfo") as r:
                    assert r.status == 404
            await _replace_a_worker(proc)
            # A counter never goes down: whichever worker answers, the dead one's count is in.
            assert {await _requests_total(s, base) for _ in range(6)} == {10.0 * replaced}
            # Files of the live workers' alone (a new one makes its own as it starts).
            kept = {f.name.rpartition("_")[2].removesuffix(".db") for f in folder.glob("*.db")
                    if not f.name.startswith("gauge_")}
            assert kept <= {str(pid) for pid in _workers_of(proc)}, kept


# A tenant whose name holds what the text format must escape (a quote, a backslash, a
# newline) and what it need not (non-ASCII): its upstream's label carries it to /metrics.
ODD_TENANT = 'odd "q" \\ \n é'


def _campaign_config(faults: FaultUpstream) -> str:
    """Tenants whose own upstream fails (err) or times out (slow), each request asked once."""
    once = "retries = 0, breaker_failures = 0, failed_file_rest_s = 0"
    return (f'[tenants.err]\nupstreams = [{{url = "{faults.url_for("status500")}", {once}}}]\n'
            f'[tenants.slow]\nupstreams = [{{url = "{faults.url_for("slow-first-byte")}", '
            f'first_byte_timeout_s = 0.3, {once}}}]\n'
            f'[tenants.{json.dumps(ODD_TENANT)}]\nupstreams = [{{url = "http://127.0.0.1:9/"}}]\n')


async def _drive(s: aiohttp.ClientSession, base: str, elfs: ElfSet) -> None:
    """One round: 5 requests of each of two files, 6 of a build ID nobody has, 3 that fail
    upstream and 2 that time out there."""
    for files, bid in enumerate((elfs.prog.build_id, elfs.other.build_id), start=1):
        for _ in range(5):
            async with s.get(f"{base}/buildid/{bid}/debuginfo") as r:
                assert r.status == 200
                await r.read()
            # Committed (after the client's last byte) before the next: one that came to the
            # other worker meanwhile would join the fetch, a miss.
            await eventually(lambda: _has_entries(s, base, files))  # noqa: B023
    for tenant, status, times in (("", 404, 6), ("err", 502, 3), ("slow", 504, 2)):
        for _ in range(times):
            async with s.get(f"{base}/buildid/{'ab' * 20}/debuginfo",
                             headers={"X-Scope-OrgID": tenant} if tenant else {}) as r:
                assert r.status == status, tenant


async def _has_entries(s: aiohttp.ClientSession, base: str, files: int) -> bool:
    return await _sample(s, base, "symgate_cache_entries") >= files


async def _scrape(s: aiohttp.ClientSession, base: str) -> dict[tuple[str, str], float]:
    """The figures the campaign checks, by (name, the label that tells them apart)."""
    async with s.get(base + "/metrics") as r:
        text = await r.text()
        assert r.status == 200, text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "symgate_requests_total" and labels["endpoint"] == "buildid" \
                    and sample.value:
                out[sample.name, f'{labels["kind"]}/{labels["outcome"]}'] = sample.value
            elif sample.name in ("symgate_upstream_requests_total",
                                 "symgate_upstream_response_seconds_count") \
                    and (sample.value or labels["upstream"].startswith("tenant:odd")):
                out[sample.name, f'{labels["upstream"]}/{labels.get("result", "")}'] = \
                    sample.value
    return out


async def test_every_worker_tells_exact_totals_before_and_after_one_is_killed(
    serve: Start, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Known numbers of hits, misses, remembered 404s, upstream errors and timeouts, through
    both workers (a connection each): any worker's /metrics says exactly those, and again,
    doubled but for the one fetch of each file and the one miss, once a worker was killed
    between two rounds and replaced."""
    faults.first_byte_delay = 2.0
    base, proc = await serve(faults.url_for("ok"), workers=2, extra=_campaign_config(faults))
    ok, err, slow = faults.url_for("ok"), "tenant:err#1", "tenant:slow#1"
    upstream, latency = "symgate_upstream_requests_total", "symgate_upstream_response_seconds_count"
    odd = {(upstream, f"tenant:{ODD_TENANT}#1/{result}"): 0.0
           for result in ("ok", "not_found", "timeout", "upstream_error")}
    odd[latency, f"tenant:{ODD_TENANT}#1/"] = 0.0
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        for rounds in (1, 2):
            if rounds == 2:
                await _replace_a_worker(proc)
            await _drive(s, base, elfs)
            expected = {
                ("symgate_requests_total", "debuginfo/miss"): 2,
                ("symgate_requests_total", "debuginfo/hit"): 10 * rounds - 2,
                ("symgate_requests_total", "debuginfo/not_found"): 1,
                ("symgate_requests_total", "debuginfo/negative_hit"): 6 * rounds - 1,
                ("symgate_requests_total", "debuginfo/upstream_error"): 3 * rounds,
                ("symgate_requests_total", "debuginfo/timeout"): 2 * rounds,
                (upstream, f"{ok}/ok"): 2, (upstream, f"{ok}/not_found"): 1,
                (upstream, f"{err}/upstream_error"): 3 * rounds,
                (upstream, f"{slow}/timeout"): 2 * rounds,
                (latency, f"{ok}/"): 3, (latency, f"{err}/"): 3 * rounds,
                (latency, f"{slow}/"): 2 * rounds,  # a timeout's wait observed too
                **odd,
            }
            for _ in range(8):  # whichever worker answers
                assert await _scrape(s, base) == expected
    assert faults.count("ok") == 3 and faults.count("status500") == 6


async def test_a_dead_worker_is_replaced_and_the_server_keeps_serving(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    base, proc = await serve(debuginfod.url, workers=2)
    await _replace_a_worker(proc)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        for _ in range(10):
            async with s.get(f"{base}/buildid/{elfs.prog.build_id}/debuginfo") as r:
                assert r.status == 200 and await r.read() == elfs.prog.debug.read_bytes()
    proc.terminate()
    assert await asyncio.wait_for(proc.wait(), 60) == 0


def _listening_on(pid: int, port: int) -> bool:
    """Whether the process has a socket listening on the port: a worker does once it serves
    (the supervisor's own socket on it is bound and never listens)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:["):-1])
    except FileNotFoundError:
        return False
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return any(int(row[1].split(":")[1], 16) == port and row[3] == "0A" and row[9] in inodes
               for row in rows)


async def test_a_worker_killed_while_it_starts_is_replaced_not_taken_for_a_fault(
    tmp_path: Path, database_url: str, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """The OOM killer or an operator may kill a worker before it serves: that says nothing
    of the configuration, so the server replaces it instead of giving up. Both workers are
    frozen as soon as they exist, so which one has not started serving yet is known."""
    for _ in range(5):  # bounded: a try where a worker was serving before it was frozen
        base, proc = await spawn_serve(tmp_path, tmp_path / "d", database_url, debuginfod.url,
                                       workers=2)
        port = int(base.rsplit(":", 1)[1])
        workers: list[int] = []
        for _ in range(3000):
            workers = _workers_of(proc)
            if len(workers) == 2 or proc.returncode is not None:
                break
            await asyncio.sleep(0.01)
        assert len(workers) == 2, f"workers {workers}"
        with stopped(workers):
            starting = [pid for pid in workers if not _listening_on(pid, port)]
            if starting:
                os.kill(starting[0], signal.SIGKILL)
        if starting:
            break
        await stop_serve([proc])
    else:
        pytest.fail("every worker was serving before it could be frozen, five times")
    await wait_until_serving(base, proc)
    for _ in range(300):  # bounded: until the supervisor has started another
        workers = _workers_of(proc)
        if len(workers) == 2 and starting[0] not in workers:
            break
        await asyncio.sleep(0.1)
    try:
        assert len(workers) == 2 and starting[0] not in workers, f"workers {workers}"
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as s:
            for _ in range(10):
                async with s.get(f"{base}/buildid/{elfs.prog.build_id}/debuginfo") as r:
                    assert r.status == 200 and await r.read() == elfs.prog.debug.read_bytes()
    finally:
        await stop_serve([proc])
    said = (await proc.stdout.read() if proc.stdout else b"").decode(errors="replace")
    assert proc.returncode == 0, said
    assert "killed by SIGKILL while starting; starting another" in said, said


async def test_a_sigkilled_supervisor_takes_its_workers_along(
    serve: Start, debuginfod: Debuginfod
) -> None:
    _, proc = await serve(debuginfod.url, workers=2)
    tree = descendants(proc.pid)
    assert len(_workers_of(proc)) == 2
    proc.kill()
    await proc.wait()
    await reap_all(tree, "the supervisor")


async def test_a_second_server_on_the_same_port_is_refused(
    serve: Start, debuginfod: Debuginfod, tmp_path: Path
) -> None:
    """SO_REUSEPORT would let it share the port silently and take half the connections."""
    base, _ = await serve(debuginfod.url, workers=2)
    second = await asyncio.create_subprocess_exec(
        "symgate", "serve", "--listen", base.removeprefix("http://"), "--workers", "2",
        "--data-dir", str(tmp_path / "other"), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "HOME": str(tmp_path)})
    out, _ = await asyncio.wait_for(second.communicate(), 60)
    assert second.returncode == 1
    assert "address already in use" in out.decode(), out.decode()


async def _two_servers(serve: Start, upstream: str
                       ) -> tuple[str, str, asyncio.subprocess.Process]:
    """Two serving processes on one data dir, in front of `upstream`: their URLs, and the
    first one's process."""
    first, process = await serve(upstream)
    second, _ = await serve(upstream)
    return first, second, process


async def test_a_follower_gets_the_bytes_as_the_other_process_writes_them(
    serve: Start, faults: FaultUpstream, elfs: ElfSet
) -> None:
    first, second, _ = await _two_servers(serve, faults.url_for("held"))
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    expected = elfs.big.debug.read_bytes()
    async with aiohttp.ClientSession() as s:
        writer = asyncio.create_task(s.get(first + path))
        await asyncio.wait_for(faults.held_half_sent.wait(), 30)
        followers = [await s.get(second + path) for _ in range(5)]
        # Half the file reaches every follower while the upstream still holds the rest.
        heads = [await r.content.readexactly(len(expected) // 2 - 1) for r in followers]
        faults.release.set()
        for r, head in zip(followers, heads, strict=True):
            assert r.status == 200 and head + await r.read() == expected
        r = await writer
        assert await r.read() == expected
    assert faults.count("held") == 1


async def test_every_client_that_follows_another_process_fetch_counts_as_one_join(
    serve: Start, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Clients that wait together for the other process's fetch to stream: the first makes
    the local mirror flight, the rest join it; each joined a fetch it did not start."""
    first, second, _ = await _two_servers(serve, faults.url_for("hold"))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    expected = elfs.prog.debug.read_bytes()
    async with aiohttp.ClientSession() as s:
        writer = asyncio.create_task(s.get(first + path))

        async def asked() -> bool:
            return faults.count("hold") == 1

        await eventually(asked)

        async def follow() -> bytes:
            async with s.get(second + path) as r:
                assert r.status == 200
                return await r.read()

        followers = [asyncio.create_task(follow()) for _ in range(10)]
        await _waiting(s, second, 10)
        faults.release.set()
        assert await asyncio.gather(*followers) == [expected] * 10
        r = await writer
        assert await r.read() == expected
        assert await _joins_and_outcomes(s, second) == (10, {"miss": 10})
    assert faults.count("hold") == 1


async def _waiting(s: aiohttp.ClientSession, base: str, clients: int) -> None:
    """Until `clients` requests wait in the process at `base` for the other's fetch: a
    client's open connection was not enough (its request could still be on its way to the
    board on a loaded machine, and then came after the fetch had failed: its remembered miss
    or its own fetch, no join), nor was a second more."""
    async def all_wait() -> bool:
        async with s.get(base + "/metrics") as m:
            text = await m.text()
        return any(sample.name == "symgate_fetch_waiters" and sample.value == clients
                   for family in text_string_to_metric_families(text)
                   for sample in family.samples)

    await eventually(all_wait)


async def _joins_and_outcomes(s: aiohttp.ClientSession, base: str
                              ) -> tuple[float, dict[str, float]]:
    """The process at `base`'s single-flight joins, and its requests by outcome (those seen)."""
    async with s.get(base + "/metrics") as m:
        text = await m.text()
    samples = [sample for family in text_string_to_metric_families(text)
               for sample in family.samples]
    joins = next(sample.value for sample in samples
                 if sample.name == "symgate_singleflight_joins_total")
    return joins, {sample.labels["outcome"]: sample.value for sample in samples
                   if sample.name == "symgate_requests_total" and sample.value}


@pytest.mark.parametrize(("mode", "status", "outcome", "asked"), [
    ("hold404", 404, "not_found", 1),
    ("hold500", 502, "upstream_error", 3)])  # one fetch: its request, retried twice
async def test_clients_that_follow_another_process_fetch_that_fails_count_as_joins(
    serve: Start, faults: FaultUpstream, elfs: ElfSet, mode: str, status: int, outcome: str,
    asked: int
) -> None:
    """The fetch fails before it streams: each follower got its failure, as a client of the
    fetching process's own does, and joined it as much. They were counted as no join at all
    (board.follow raised past the count), so with --workers 2 fifty clients of one failed
    fetch showed ten-odd joins, by which worker the kernel gave them to."""
    first, second, _ = await _two_servers(serve, faults.url_for(mode))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:

        async def get(base: str) -> int:
            async with s.get(base + path) as r:
                await r.read()
                return r.status

        writer = asyncio.create_task(get(first))

        async def fetching() -> bool:
            return faults.count(mode) == 1

        await eventually(fetching)
        followers = [asyncio.create_task(get(second)) for _ in range(10)]
        await _waiting(s, second, 10)
        faults.release.set()
        assert await asyncio.gather(writer, *followers) == [status] * 11
        assert await _joins_and_outcomes(s, first) == (0, {outcome: 1})
        assert await _joins_and_outcomes(s, second) == (10, {outcome: 10})
    assert faults.count(mode) == asked


async def test_the_cache_gauges_are_not_set_back_by_a_worker_that_learns_of_a_file(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """The gauges show the most recent worker's reading of the whole cache: a worker that
    serves a file the other fetched must not set them back to its own older reading."""
    # The periodic reading only where this test takes it: at the start, and at the commit.
    base, _ = await serve(debuginfod.url, workers=2, extra="access_flush_s = 3600\n")
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    size = elfs.prog.debug.stat().st_size
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        async with s.get(base + path) as r:
            assert r.status == 200

        async def committed() -> bool:
            return await _cache_gauges(s, base) == (1, size)

        await eventually(committed)
        # A new connection each: the kernel spreads them over both workers.
        for _ in range(20):
            async with s.get(base + path) as r:
                assert r.status == 200 and len(await r.read()) == size
        assert {await _cache_gauges(s, base) for _ in range(10)} == {(1, size)}


async def _cache_gauges(s: aiohttp.ClientSession, base: str) -> tuple[float, float]:
    """The server's cache_entries and cache_size_bytes, as the worker that answers tells them."""
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    found = {sample.name: sample.value for family in text_string_to_metric_families(text)
             for sample in family.samples}
    return found["symgate_cache_entries"], found["symgate_cache_size_bytes"]


def _latest_reader(folder: Path, workers: list[int]) -> int:
    """The worker whose reading of the cache figures is the latest, by its gauges' file."""
    from prometheus_client.mmap_dict import MmapedDict

    def stamp(pid: int) -> float:
        return max((at for f in folder.glob(f"gauge_*mostrecent_{pid}.db")
                    for key, _, at, _ in MmapedDict.read_all_values_from_file(str(f))
                    if '"symgate_cache_entries"' in key), default=0.0)

    return max(workers, key=stamp)


async def test_the_cache_gauges_stay_true_when_the_worker_that_read_them_last_dies(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet, database_url: str
) -> None:
    """The gauges tell the data dir's cache as the latest reading of it said, whichever
    worker made it: they showed the live workers' latest, so when the worker that had read
    them last was killed, a survivor's older reading (0 or 1 of 2 files) until its
    replacement had read them again. The replacement is held from SQL (the database locked)
    while the server is scraped, so that the survivor alone tells them: on PostgreSQL, whose
    lock holds reads, not a WAL file's (which a connection can lock only while no other has
    it open: the workers' do)."""
    if database_url.startswith("sqlite"):
        pytest.skip("a SQLite file in WAL mode cannot be held from a new connection's reads")
    base, proc = await serve(debuginfod.url, workers=2, extra="access_flush_s = 3600\n")
    [folder] = Path(tempfile.gettempdir()).glob(f"symgate-metrics-{proc.pid}.*-*")
    files = (elfs.prog, elfs.other)
    cached = (len(files), sum(elf.debug.stat().st_size for elf in files))
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        for count, elf in enumerate(files, start=1):
            async with s.get(f"{base}/buildid/{elf.build_id}/debuginfo") as r:
                assert r.status == 200
                await r.read()
            await eventually(lambda: _has_entries(s, base, count))  # noqa: B023
        assert await _cache_gauges(s, base) == cached
        workers = _workers_of(proc)
        victim = _latest_reader(folder, workers)
        async with database_held(database_url, "EXCLUSIVE",
                                 "LOCK TABLE artifacts IN ACCESS EXCLUSIVE MODE"):
            await _replace_a_worker(proc, victim=victim)
            assert {await _cache_gauges(s, base) for _ in range(6)} == {cached}

        [new] = set(_workers_of(proc)) - set(workers)
        await eventually(lambda: _listening_on(new, int(base.rpartition(":")[2])))
        assert {await _cache_gauges(s, base) for _ in range(10)} == {cached}


async def test_a_follower_waits_for_a_fetch_whose_upstream_answered_but_sent_no_byte_yet(
    serve: Start, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """The fetching process tells the others it streams only once its first chunk is on
    disk: until then a follower waits as for a fetch that has said nothing, and then gets
    every byte, the upstream asked once."""
    first, second, _ = await _two_servers(serve, faults.url_for("headers-held"))
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    expected = elfs.big.debug.read_bytes()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        fetching = asyncio.create_task(s.get(first + path))
        await asyncio.wait_for(faults.headers_sent.wait(), 30)
        following = asyncio.create_task(s.get(second + path))
        await asyncio.sleep(0.3)  # long enough for a follower that would not wait to answer
        assert not following.done()
        faults.release.set()
        for response in (await fetching, await following):
            assert response.status == 200 and await response.read() == expected
    assert faults.count("headers-held") == 1


async def test_a_follower_is_cut_off_when_the_fetching_process_dies(
    serve: Start, faults: FaultUpstream, elfs: ElfSet
) -> None:
    first, second, writer_proc = await _two_servers(serve, faults.url_for("held"))
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    expected = elfs.big.debug.read_bytes()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        writer = asyncio.create_task(s.get(first + path))
        await asyncio.wait_for(faults.held_half_sent.wait(), 30)
        async with s.get(second + path) as r:
            await r.content.readexactly(1024)
            writer_proc.kill()  # the fetching process dies mid-download
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()  # broken off, never a short body that looks whole
        with pytest.raises(aiohttp.ClientError):
            await (await writer).read()
        faults.release.set()
        async with s.get(second + path) as r:  # it fetches the file itself now
            assert r.status == 200 and await r.read() == expected
    assert faults.count("held") == 2


async def test_a_miss_found_by_one_process_is_the_answer_in_the_other(
    serve: Start, faults: FaultUpstream
) -> None:
    first, second, _ = await _two_servers(serve, faults.url_for("hold"))
    path = f"/buildid/{'cd' * 20}/debuginfo"
    async with aiohttp.ClientSession() as s:
        asking = asyncio.create_task(s.get(first + path))
        for _ in range(300):  # bounded: until the first process has asked upstream
            if faults.count("hold") == 1:
                break
            await asyncio.sleep(0.05)
        following = asyncio.create_task(s.get(second + path))
        await asyncio.sleep(0.3)  # the second is waiting on the first's answer by now
        faults.release.set()
        statuses = [(await t).status for t in (asking, following)]
    assert statuses == [404, 404]
    assert faults.count("hold") == 1


async def test_processes_on_one_cache_keep_to_one_budget_together(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    """Each process evicts for the files it knows of; together they keep the whole cache
    within max_bytes, judged from SQL by one process at a time.

    A client has its last byte before the file is committed (fsync, rename, row), so the disk
    is within the budget until the second process's commit, some moments after its answer:
    it is the eviction that is waited for, then the disk judged."""
    sizes = [e.debug.stat().st_size for e in (elfs.prog, elfs.other)]
    budget = sum(sizes) - 1
    extra = f"access_flush_s = 0.2\n[cache]\nmax_bytes = {budget}\n"
    first, _ = await serve(debuginfod.url, extra=extra)
    second, _ = await serve(debuginfod.url, extra=extra)
    objects = tmp_path / "d" / "cache" / "objects"
    async with aiohttp.ClientSession() as s:
        for base, elf in ((first, elfs.prog), (second, elfs.other)):
            async with s.get(f"{base}/buildid/{elf.build_id}/debuginfo") as r:
                assert r.status == 200 and await r.read() == elf.debug.read_bytes()

        async def evicted() -> bool:
            return sum([await _sample(s, base, "symgate_cache_evictions_total")
                        for base in (first, second)]) > 0

        await eventually(evicted, timeout=15)
    files = [p for p in objects.rglob("*") if p.is_file()]
    assert len(files) == 1 and sum(p.stat().st_size for p in files) <= budget


async def _sample(s: aiohttp.ClientSession, base: str, name: str) -> float:
    """A sample without labels of one process's /metrics (one server of one worker)."""
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name and not sample.labels)


async def _upstream_gets(s: aiohttp.ClientSession, debuginfod: Debuginfod) -> float:
    """What elfutils' debuginfod counts of the requests it answered for files."""
    async with s.get(debuginfod.url + "/metrics") as r:
        text = await r.text()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "http_requests_total" and sample.labels.get("type") in (
                   "debuginfo", "executable"))


async def test_many_clients_over_both_workers_cost_one_upstream_request_per_key(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """At once and staggered, on connections the kernel spreads over both workers; a request
    that comes as the other worker commits the file included."""
    base, _ = await serve(debuginfod.url, workers=2)
    wanted = [elfs.prog, elfs.other, elfs.big]
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector) as s:
        before = await _upstream_gets(s, debuginfod)

        async def fetch(elf_index: int, delay: float) -> bool:
            await asyncio.sleep(delay)
            elf = wanted[elf_index]
            async with s.get(f"{base}/buildid/{elf.build_id}/debuginfo") as r:
                return r.status == 200 and await r.read() == elf.debug.read_bytes()

        # Half at once, half staggered over the whole fetch of the big file and its commit.
        results = await asyncio.gather(*(
            fetch(i % len(wanted), 0.005 * (i // len(wanted)) * (i % 2)) for i in range(150)))
        assert all(results)
        assert await _upstream_gets(s, debuginfod) - before == len(wanted)


async def test_workers_starting_together_after_a_crash_both_clear_its_flights(
        serve: Start, faults: FaultUpstream, tmp_path: Path) -> None:
    """A server SIGKILLed amid downloads leaves their flights/<key>.lock and .json. At the next
    start every worker clears them: one worker's removal of a lock the other has just listed
    is no start-up fault (it was: FileNotFoundError, 'cannot start', the server gone)."""
    _, first = await serve(faults.url_for("ok"))
    await stop_serve([first])
    flights = tmp_path / "d" / "cache" / "flights"
    for i in range(1000):  # as a crash amid many downloads leaves them: unlocked
        (flights / f"{i:064x}.lock").write_text("")
        (flights / f"{i:064x}.json").write_text('{"state": "streaming"}')
    base, proc = await serve(faults.url_for("ok"), workers=2)
    async with aiohttp.ClientSession() as s, s.get(base + "/healthz") as r:
        assert r.status == 200
    assert proc.returncode is None
    assert not list(flights.iterdir())


async def test_a_stop_signal_while_a_dead_worker_is_replaced_stops_the_new_one_too(
        tmp_path: Path, database_url: str, faults: FaultUpstream) -> None:
    """SIGTERM after the supervisor decided to replace a dead worker and before the new one
    exists: the new one must be told to stop as well, or the supervisor waits for it for good.
    The supervisor is held in that window by its own log line ("starting another"), written
    to a pipe the test keeps full."""
    from tests.harness import free_port

    port = free_port()
    config = tmp_path / "symgate.toml"
    config.write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{tmp_path / "d"}"\n'
        f'shutdown_grace_s = 1\n[database]\nurl = "{database_url}"\n'
        f'[[upstreams]]\nurl = "{faults.url_for("ok")}"\n')
    out_r, out_w = os.pipe()
    proc = await asyncio.create_subprocess_exec(
        "symgate", "serve", "--config", str(config), "--workers", "2",
        stdout=out_w, stderr=out_w, env={**os.environ, "HOME": str(tmp_path)})
    os.set_blocking(out_r, False)
    # Writes of its own that never wait, on a description of the pipe that is not the
    # server's (whose writes must wait).
    filler = os.open(f"/proc/self/fd/{out_w}", os.O_WRONLY | os.O_NONBLOCK)
    said = bytearray()

    def drain() -> None:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(out_r, 65536):
                said.extend(chunk)

    try:
        asyncio.get_running_loop().add_reader(out_r, drain)
        await wait_until_serving(f"http://127.0.0.1:{port}", proc)

        async def supervising() -> bool:  # its last line of the start written
            return b"serving with 2 workers" in said

        await eventually(supervising)
        workers = _workers_of(proc)
        assert len(workers) == 2
        asyncio.get_running_loop().remove_reader(out_r)
        drain()
        with contextlib.suppress(BlockingIOError):  # the pipe full: every write to it waits
            while True:
                os.write(filler, b"#" * 4096)
        os.kill(workers[0], signal.SIGKILL)

        async def reaped() -> bool:
            return len(_workers_of(proc)) == 1

        await eventually(reaped)
        await asyncio.sleep(0.3)  # and writing that it starts another, which waits
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        asyncio.get_running_loop().add_reader(out_r, drain)
        try:
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        except TimeoutError:
            left = _workers_of(proc)
            proc.kill()
            await proc.wait()
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the supervisor still waits, for workers {left}; it said:\n"
                        + said.replace(b"#", b"").decode(errors="replace")[-2000:])
    finally:
        asyncio.get_running_loop().remove_reader(out_r)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for fd in (out_r, out_w, filler):
            os.close(fd)


def _exposition(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """The series of a /metrics text, checked as a scraper's parser would: each family's HELP
    and TYPE once, each sample once."""
    for tag in ("# HELP ", "# TYPE "):
        names = [line.split(" ", 3)[2] for line in text.splitlines() if line.startswith(tag)]
        assert len(names) == len(set(names)), f"{tag}twice"
    series = [(s.name, tuple(sorted(s.labels.items())))
              for family in text_string_to_metric_families(text) for s in family.samples]
    assert len(series) == len(set(series)), "a sample twice"
    return set(series)


async def test_what_clients_send_adds_no_series_and_a_dead_worker_leaves_none(
    serve: Start, faults: FaultUpstream
) -> None:
    """Every label is symgate's own word, never a client's: build IDs, paths, section names,
    tenants, user agents, tokens, methods and metadata keys of a client's choosing, 400
    requests of them (each of the 11 paths many times), make no series that a fresh server
    has not. Nor does a killed and replaced worker: its counts go to the archive, its gauges
    (labelled by pid in its files) with it, and the text stays one HELP, one TYPE and one
    sample each."""
    base, proc = await serve(faults.url_for("ok"), workers=2, extra="[tenants.acme]\n")
    connector = aiohttp.TCPConnector(force_close=True, limit=8)
    async with aiohttp.ClientSession(connector=connector) as s:

        async def series() -> set[tuple[str, tuple[tuple[str, str], ...]]]:
            async with s.get(base + "/metrics") as r:
                text = await r.text()
                assert r.status == 200, text
            return _exposition(text)

        fresh = await series()

        async def hostile(i: int) -> int:
            bid = f"{i:040x}"
            path = [f"/buildid/{bid}/debuginfo", f"/buildid/{bid}/executable",
                    f"/buildid/{bid}/source/src/f{i}.c", f"/buildid/{bid}/section/.s{i}",
                    f"/buildid/{bid}/kind{i}", f"/buildid/x{i}/debuginfo", f"/other{i}",
                    f"/metadata?key=k{i}&value=v", f"/metadata?key=file&value=/f{i}",
                    f"/buildid/{bid}/debuginfo?q{i}=1", f"/symbolize?t={i}"][i % 11]
            method = ["GET", "HEAD", "PUT", "DELETE", "POST", f"M{i}"][i % 6]
            headers = {"X-Scope-OrgID": ["", "acme", f"tenant{i}"][i % 3],
                       "User-Agent": f"agent/{i}", "Content-Type": f"type/{i}"}
            if i % 5 == 0:
                headers["Authorization"] = f"Bearer token-{i}"
            async with s.request(method, base + path, headers=headers, data=b"x" * (i % 2)
                                 ) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(hostile(i) for i in range(400)))
        assert max(statuses) < 500, sorted(set(statuses))
        assert await series() == fresh
        await _replace_a_worker(proc)
        for _ in range(4):  # whichever worker answers
            assert await series() == fresh
