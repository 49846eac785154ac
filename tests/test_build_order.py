"""Builds waiting for a worker go biggest source first: a cold profile's builds arrive all at
once, and it is answered when the biggest one is done, so that one must not queue behind a
row of small ones; and a profile's build IDs are resolved widest mapping first, so that the
biggest build tends to be the first to arrive. Real builds in a real worker process, of gcc-built
fixtures and libc."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.symbols.build_pool import BuildPool
from proxy.symbols.workers import WorkerPool
from proxy.web.state import STATE
from symbolize.elf import LoadSegment
from symbolize.pprof.profile_pb2 import Profile
from symbolize.worker import Limits, scan
from tests.elfs import ElfSet
from tests.harness import SymgateFactory, eventually
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID
from tests.profiles import Placed, code_addresses, make_profile, place
from tests.symbolize_helpers import post, symbolize_config


@pytest.fixture
async def one_worker() -> object:
    pool = WorkerPool(1, idle_s=0)
    yield pool
    await pool.close()


async def test_the_biggest_waiting_build_gets_the_next_worker(
        elfs: ElfSet, tmp_path: Path, one_worker: WorkerPool) -> None:
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    builds = BuildPool(one_worker, 1)
    done: list[str] = []

    async def build(path: Path, build_id: str) -> None:
        await builds.build(path, tmp_path / f"{build_id}.symc", build_id)
        done.append(build_id)

    # libc's build holds the only slot while the others arrive, smallest first.
    first = asyncio.create_task(build(LIBC_DEBUG, LIBC_ID))
    await asyncio.sleep(0)
    fixtures = sorted((e for e in elfs.all), key=lambda e: e.debug.stat().st_size)
    waiting = [asyncio.create_task(build(e.debug, e.build_id)) for e in fixtures]
    await asyncio.gather(first, *waiting)
    # Of equal sizes, the one that came first.
    biggest_first = [e.build_id for _i, e in sorted(
        enumerate(fixtures), key=lambda ie: (-ie[1].debug.stat().st_size, ie[0]))]
    assert done == [LIBC_ID, *biggest_first]


async def test_a_waiting_build_that_gives_up_leaves_its_place_and_no_slot_lost(
        elfs: ElfSet, tmp_path: Path, one_worker: WorkerPool) -> None:
    builds = BuildPool(one_worker, 1)
    big, small = elfs.big, elfs.prog
    holder = asyncio.create_task(builds.build(big.debug, tmp_path / "a.symc", big.build_id))
    await asyncio.sleep(0)
    quitter = asyncio.create_task(builds.build(small.debug, tmp_path / "b.symc",
                                               small.build_id))
    await asyncio.sleep(0)
    quitter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await quitter
    await holder
    # The slot came back: two builds in turn still get it, and nothing waits.
    for n in range(2):
        await asyncio.wait_for(builds.build(small.debug, tmp_path / f"c{n}.symc",
                                            small.build_id), 30)
    assert not (tmp_path / "b.symc").exists()


async def test_a_build_cancelled_as_the_slot_reaches_it_passes_the_slot_on(
        elfs: ElfSet, tmp_path: Path, one_worker: WorkerPool) -> None:
    """The await point is taken by hand: the slot is handed to a waiter, which is cancelled
    before it runs; the slot must go to the next waiter, not be lost."""
    builds = BuildPool(one_worker, 1)
    small = elfs.prog
    async with builds._slot(1):
        loser = asyncio.create_task(builds.build(small.debug, tmp_path / "x.symc",
                                                 small.build_id))
        winner = asyncio.create_task(builds.build(small.debug, tmp_path / "y.symc",
                                                  small.build_id))
        await asyncio.sleep(0)
        assert len(builds._waiting) == 2
    # Leaving the slot woke the first waiter (equal sizes: the earlier one); it is cancelled
    # before it runs.
    loser.cancel()
    with pytest.raises(asyncio.CancelledError):
        await loser
    await asyncio.wait_for(winner, 30)
    assert (tmp_path / "y.symc").exists() and not (tmp_path / "x.symc").exists()
    assert builds._free == 1 and not builds._waiting


async def test_a_build_that_waited_past_patience_goes_next_whatever_its_size(
        elfs: ElfSet, tmp_path: Path, one_worker: WorkerPool) -> None:
    """Bigger builds arriving all the time must not hold a small one back for good: past its
    patience (0 here: at once) the oldest waiting build goes first."""
    builds = BuildPool(one_worker, 1, patience_s=0)
    done: list[str] = []

    async def build(name: str, path: Path, build_id: str) -> None:
        await builds.build(path, tmp_path / f"{name}.symc", build_id)
        done.append(name)

    async with builds._slot(1):
        fixtures = sorted(elfs.all, key=lambda e: e.debug.stat().st_size)
        waiting = [asyncio.create_task(build(e.name, e.debug, e.build_id)) for e in fixtures]
        await asyncio.sleep(0)
    await asyncio.gather(*waiting)
    assert done == [e.name for e in fixtures]  # smallest first: the order they came in


def _tree(root: Path, elfs: list[tuple[str, Path, Path]]) -> Path:
    """A .build-id tree of (build ID, executable, debug file)."""
    for bid, exe, debug in elfs:
        d = root / ".build-id" / bid[:2]
        d.mkdir(parents=True, exist_ok=True)
        (d / bid[2:]).symlink_to(exe)
        (d / (bid[2:] + ".debug")).symlink_to(debug)
    return root


def _libc_and_fixtures(elfs: ElfSet) -> Profile:
    """A profile of the fixtures and libc, libc's mapping last and the widest."""
    placed = [(place(e, 0x5500_0000_0000 + (i << 32)), code_addresses(e)[:20])
              for i, e in enumerate(elfs.all)]
    libc = Placed(LIBC_ID, str(LIBC), 0x7F00_0000_0000, 0x7F00_0019_0000, 0x28000,
                  LoadSegment(0x28000, 0x28000, 0x168000, 0x168000, True), 0x7F00_0000_0000)
    return make_profile([*placed, (libc, [0x29000, 0x30000])])


def test_the_scan_lists_build_ids_widest_mapping_first(elfs: ElfSet) -> None:
    profile = _libc_and_fixtures(elfs)
    layouts = scan(profile.SerializeToString(), Limits(1 << 26, 100)).layouts
    by_width = sorted(((m.memory_limit - m.memory_start, profile.string_table[m.build_id])
                       for m in profile.mapping), key=lambda x: (-x[0], x[1]))
    assert by_width[0][1] == LIBC_ID
    assert list(layouts) == [bid for _w, bid in by_width]


# Which build reaches an idle pool first is not owed: between the profile's scan and the build
# pool each resolution hops to threads (the supplement link, the build lock), which come back
# in any order under load (CI saw the widest mapping's build come fifth). What is owed, and
# what a cold profile's answer time depends on with several workers, is that the builds
# which wait go biggest first; so the one slot is held until all of them wait.
async def test_a_cold_profiles_waiting_builds_go_biggest_first(
        start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path) -> None:
    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    profile = _libc_and_fixtures(elfs)
    sources = [(LIBC_ID, LIBC, LIBC_DEBUG), *((e.build_id, e.executable, e.debug)
                                              for e in elfs.all)]
    tree = _tree(tmp_path / "debug", sources)
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tree,)))
    state = sg.runner.app[STATE]
    builds = state.symbols._pool
    async with builds._slot(1):  # the one slot, held until every build waits for it
        posted = asyncio.ensure_future(post(sg, profile.SerializeToString()))
        await eventually(lambda: len(builds._waiting) == len(sources), timeout=20)
    status, headers, _body = await posted
    assert status == 200
    assert headers["X-Symgate-Mappings-Symbolized"] == str(len(sources))
    built = {bid: rec.built_at for bid, _e, _d in sources
             if (rec := await state.repo.get_symbol_table("", bid)) is not None}
    order = sorted(built, key=lambda b: built[b])
    size = {bid: debug.stat().st_size for bid, _e, debug in sources}
    # Of equal sizes, in the order they came: not known here, so not told apart.
    assert [size[b] for b in order] == sorted(size.values(), reverse=True)
