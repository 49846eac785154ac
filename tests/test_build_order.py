"""Builds waiting for a worker go biggest source first: a cold profile's builds arrive all at
once, and it is answered when the biggest one is done, so that one must not queue behind a
row of small ones. Real builds in a real worker process, of gcc-built fixtures and libc."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.symbols.build_pool import BuildPool
from proxy.symbols.workers import WorkerPool
from tests.elfs import ElfSet
from tests.libc import LIBC_DEBUG, LIBC_ID


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
