"""cache.max_bytes holds while downloads are under way: a download holds room for its size
(evicting least recently used files before its first byte), a download that cannot fit is
served to its clients but not kept, and an artifact larger than the whole budget is served,
not kept, and evicts nothing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from pathlib import Path

import aiohttp

from proxy.config import CacheConfig
from proxy.keys import ArtifactKey
from proxy.web.state import STATE
from symbolize.elf import section_extent
from tests.elfs import ElfSet, build_program
from tests.faults import FaultUpstream
from tests.harness import Symgate, SymgateFactory, eventually
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, post, symbolize_config

MiB = 1024 * 1024


def _blocks(folder: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # a download that just ended
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def on_disk(cache_dir: Path) -> int:
    """Bytes the cache takes on disk: kept files and downloads under way, every process's."""
    return _blocks(cache_dir / "objects") + _blocks(cache_dir / "tmp")


async def _written(cache_dir: Path, n: int) -> None:
    """Until symgate has written `n` bytes of downloads: what the upstream sent before it
    held the rest back is then on disk, not in a socket buffer."""
    async def done() -> bool:
        return _blocks(cache_dir / "tmp") >= n

    await eventually(done, timeout=30)


async def _built(sg: Symgate, n: int) -> None:
    """Symbol tables are built from each cached debuginfo, under a lease eviction respects."""
    async def done() -> bool:
        return await sg.metric("symgate_symtab_builds_total", result="ok") >= n

    await eventually(done, timeout=60)


async def test_larger_than_the_budget_is_served_not_kept_and_evicts_nothing(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")], cache=CacheConfig(max_bytes=MiB))
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    await _built(sg, 1)
    status, _, body = await sg.get(f"/buildid/{elfs.big.build_id}/debuginfo")
    assert status == 200 and body == elfs.big.debug.read_bytes()
    await sg.settled()  # its temp file is written to its end, then removed
    assert await sg.metric("symgate_cache_evictions_total") == 0
    assert await sg.metric("symgate_cache_entries") == 1
    assert await sg.metric("symgate_cache_not_kept_total") == 1
    assert on_disk(sg.config.cache_dir) <= MiB
    objects = sg.config.cache_dir / "objects"
    assert not (objects / ArtifactKey.parse(elfs.big.build_id, "debuginfo").storage_name
                ).exists()
    assert (objects / ArtifactKey.parse(elfs.prog.build_id, "debuginfo").storage_name).exists()


async def test_the_budget_holds_while_downloads_are_under_way(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    # A second large artifact, half the size of `big`.
    (tmp_path / "out").mkdir()
    big2 = await asyncio.to_thread(build_program, tmp_path / "src", tmp_path / "out", "big2",
                                   7, 12 * MiB)
    faults.by_id[big2.build_id] = big2
    size, size2 = elfs.big.debug.stat().st_size, big2.debug.stat().st_size
    budget = size + size2 // 4  # both cannot be kept; `big` and half of big2 overflow it
    sg = await start_symgate([faults.url_for("held")], cache=CacheConfig(max_bytes=budget))
    faults.release.set()
    big_path = f"/buildid/{elfs.big.build_id}/debuginfo"
    assert (await sg.get(big_path))[0] == 200
    await _built(sg, 1)
    assert await sg.metric("symgate_cache_entries") == 1

    faults.release, faults.held_half_sent = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(sg.get(f"/buildid/{big2.build_id}/debuginfo"))
    await asyncio.wait_for(faults.held_half_sent.wait(), 30)
    await _written(sg.config.cache_dir, size2 // 2)
    # Held half-way by the upstream: the old file made room before the first byte.
    assert on_disk(sg.config.cache_dir) <= budget + MiB
    # A concurrent download that cannot fit beside the room big2 holds: served, not kept.
    second = asyncio.create_task(sg.get(big_path))
    for _ in range(300):
        if faults.count("held") == 3:
            break
        await asyncio.sleep(0.05)
    assert faults.count("held") == 3
    assert on_disk(sg.config.cache_dir) <= budget + MiB
    faults.release.set()
    status, _, body = await first
    assert status == 200 and body == big2.debug.read_bytes()
    status, _, body = await second
    assert status == 200 and body == elfs.big.debug.read_bytes()
    await sg.settled()
    assert await sg.metric("symgate_cache_not_kept_total") == 1
    assert on_disk(sg.config.cache_dir) <= budget
    kept = sg.config.cache_dir / "objects" / ArtifactKey.parse(big2.build_id,
                                                               "debuginfo").storage_name

    async def big2_kept() -> bool:
        return kept.exists()

    # Verified and kept after its last byte reached the client: on a loaded machine, a little
    # after the client's read returns (CI once looked first).
    await eventually(big2_kept)
    assert on_disk(sg.config.cache_dir) <= budget


async def test_eviction_follows_last_access_across_a_restart(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """The least recently used goes first, hits included, also when the order comes from SQL
    after a restart (hits reach it in the batches flushed at shutdown)."""
    debug = elfs.prog.debug.stat().st_size + elfs.other.debug.stat().st_size
    budget = debug + elfs.prog.executable.stat().st_size - 1
    sg = await start_symgate([faults.url_for("ok")], cache=CacheConfig(max_bytes=budget))
    for e in (elfs.prog, elfs.other):  # `prog` fetched first: the older of the two
        assert (await sg.get(f"/buildid/{e.build_id}/debuginfo"))[0] == 200
    await _built(sg, 2)
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200  # a hit
    await sg.stop()
    again = await start_symgate(config=sg.config)
    assert (await again.get(f"/buildid/{elfs.prog.build_id}/executable"))[0] == 200
    objects = sg.config.cache_dir / "objects"
    assert (objects / ArtifactKey.parse(elfs.prog.build_id, "debuginfo").storage_name).exists()
    assert not (objects / ArtifactKey.parse(elfs.other.build_id, "debuginfo").storage_name
                ).exists()


async def test_an_announced_size_never_sent_evicts_nothing(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    # An upstream that announces a size and sends half of it: room is made as bytes come, so
    # the lie alone cannot have the cache emptied (repeated with new build IDs, it would).
    size = elfs.big.debug.stat().st_size
    kept = elfs.prog.debug.stat().st_size
    budget = size + kept // 2  # `big` whole and `prog` cannot both be kept; half of big can
    sg = await start_symgate([faults.url_for("ok")], cache=CacheConfig(max_bytes=budget))
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    await _built(sg, 1)
    await sg.stop()
    liar = await start_symgate([faults.url_for("truncated")], data_dir=sg.config.server.data_dir,
                               cache=CacheConfig(max_bytes=budget))
    with contextlib.suppress(aiohttp.ClientPayloadError):  # cut off after its first half
        await liar.get(f"/buildid/{elfs.big.build_id}/debuginfo")
    assert faults.count("truncated") >= 1
    assert await liar.metric("symgate_cache_evictions_total") == 0
    assert (await liar.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    assert faults.count("ok") == 1


async def test_a_profile_whose_debug_file_cannot_be_kept_now_is_refused_not_left_bare(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """While a client that reads nothing holds `big`'s room, the profile's debug file fits
    the budget but not beside it: served, not kept, so not there for the table's build to read.
    The profile was answered 200 with its mapping not_found, which a backend keeps for good;
    it is a 507 with Retry-After, and symbolized once the room is back."""
    small = elfs.prog.debug.stat().st_size
    sg = await start_symgate(
        [faults.url_for("ok")], symbolize=symbolize_config(),
        cache=CacheConfig(max_bytes=elfs.big.debug.stat().st_size + small // 2))
    big = f"/buildid/{elfs.big.build_id}/debuginfo"
    assert (await sg.get(big))[0] == 200
    await _built(sg, 1)
    host, port = sg.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET {big} HTTP/1.1\r\nHost: x\r\n\r\n".encode())  # and read nothing
    cache = sg.runner.app[STATE].service.cache

    async def sending() -> bool:
        return bool(cache._leases)

    await eventually(sending)
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])])
    raw = profile.SerializeToString()
    status, headers, _body = await post(sg, raw)
    assert status == 507 and "Retry-After" in headers, (status, headers)
    writer.close()
    reader.feed_eof()
    await sg.settled()

    async def symbolized() -> bool:
        status, headers, _body = await post(sg, raw)
        return status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"

    await eventually(symbolized, timeout=30)


async def test_a_download_that_cannot_fit_beside_one_under_way_evicts_nothing(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """Two cold misses at once, each of which fits the budget beside the file cached, but not
    both: the second was judged by the room the first held so far (half its size), kept, and
    as both grew the cached file was evicted for the room, then one of the two was not kept
    after all. The file went for nothing. A download's announced size is the room it will
    hold: the second is served, not kept, and evicts nothing, as one larger than the room is."""
    (tmp_path / "out").mkdir()
    big2, cached = await asyncio.gather(
        asyncio.to_thread(build_program, tmp_path / "src", tmp_path / "out", "big2", 7,
                          12 * MiB),
        asyncio.to_thread(build_program, tmp_path / "src", tmp_path / "out", "mid", 8, 4 * MiB))
    for e in (big2, cached):
        faults.by_id[e.build_id] = e
    size, size2 = elfs.big.debug.stat().st_size, big2.debug.stat().st_size
    budget = size + cached.debug.stat().st_size + MiB  # either beside `cached`, not both
    assert size + size2 > budget and size2 < size
    sg = await start_symgate([faults.url_for("held")], cache=CacheConfig(max_bytes=budget))
    faults.release.set()
    assert (await sg.get(f"/buildid/{cached.build_id}/debuginfo"))[0] == 200
    await _built(sg, 1)

    faults.release, faults.held_half_sent = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(sg.get(f"/buildid/{elfs.big.build_id}/debuginfo"))
    await asyncio.wait_for(faults.held_half_sent.wait(), 30)
    await _written(sg.config.cache_dir, size // 2)
    second = asyncio.create_task(sg.get(f"/buildid/{big2.build_id}/debuginfo"))
    await _written(sg.config.cache_dir, size // 2 + size2 // 2)
    faults.release.set()
    for task, e in ((first, elfs.big), (second, big2)):
        status, _, body = await task
        assert status == 200 and body == e.debug.read_bytes()
    await sg.settled()
    assert await sg.metric("symgate_cache_not_kept_total") == 1
    assert await sg.metric("symgate_cache_evictions_total") == 0
    objects = sg.config.cache_dir / "objects"
    assert (objects / ArtifactKey.parse(cached.build_id, "debuginfo").storage_name).exists()
    assert (objects / ArtifactKey.parse(elfs.big.build_id, "debuginfo").storage_name).exists()
    assert on_disk(sg.config.cache_dir) <= budget


async def test_a_section_larger_than_the_budget_is_served_not_kept_and_evicts_nothing(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A section is kept as an artifact of its own, but was never judged against the budget:
    cut (its bytes on disk past the budget), committed, it evicted every other file, and then
    itself once its client had it. The cache was emptied for a section it cannot keep. It is
    served, not kept, and evicts nothing, as a file larger than the budget is."""
    sg = await start_symgate([faults.url_for("ok")], cache=CacheConfig(max_bytes=8 * MiB))
    for e in (elfs.prog, elfs.other):
        assert (await sg.get(f"/buildid/{e.build_id}/debuginfo"))[0] == 200
    await _built(sg, 2)
    extent = section_extent(elfs.big.debug, ".symgate_pad")
    assert extent is not None and extent[1] > 8 * MiB
    offset, size = extent
    with elfs.big.debug.open("rb") as f:
        f.seek(offset)
        section = f.read(size)
    path = f"/buildid/{elfs.big.build_id}/section/.symgate_pad"
    status, headers, _ = await sg.request("HEAD", path)
    assert status == 200 and headers["Content-Length"] == str(size)
    # Two at once share one cut, each reading it whole.
    for status, headers, body in await asyncio.gather(sg.get(path), sg.get(path)):
        assert status == 200 and headers["Content-Length"] == str(size) and body == section
    await sg.built()
    assert await sg.metric("symgate_cache_evictions_total") == 0
    assert await sg.metric("symgate_cache_entries") == 2
    assert on_disk(sg.config.cache_dir) <= 8 * MiB


async def test_a_file_of_no_stated_size_as_large_as_the_budget_is_kept(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """An upstream that does not say how big the file is: room is held a step ahead of its
    bytes, and the last step, rounded past the budget, was refused though the file itself
    fits; it was served and never kept, fetched again at every request."""
    # Padded to a size the budget's steps (a sixteenth of it, here) do not divide.
    data = elfs.prog.debug.read_bytes()
    data += bytes((8 - len(data)) % 16)
    padded = tmp_path / "prog.debug"
    padded.write_bytes(data)
    faults.by_id[elfs.prog.build_id] = dataclasses.replace(elfs.prog, debug=padded)
    size = len(data)
    sg = await start_symgate([faults.url_for("chunked")], cache=CacheConfig(max_bytes=size))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    for _ in range(2):
        status, _, body = await sg.get(path)
        assert status == 200 and body == data
        await sg.settled()
    assert await sg.metric("symgate_cache_not_kept_total") == 0
    assert await sg.metric("symgate_cache_entries") == 1
    assert await sg.metric("symgate_cache_size_bytes") == size
    assert faults.count("chunked") == 1  # the second was a hit
