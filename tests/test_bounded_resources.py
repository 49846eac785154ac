"""What hostile or buggy traffic leaves behind: memory, descriptors and temp files a server
at a site's one egress point holds must go back near where they were once the traffic ends,
not wait for something that may come late (Python's full garbage collection) or never."""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest

from proxy.config import CacheConfig
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, fast_upstream, read_broken

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

MIB = 1024 * 1024


async def test_downloads_cut_off_hold_no_memory_until_a_garbage_collection(
        start_symgate: SymgateFactory, faults: FaultUpstream) -> None:
    """An upstream whose body never ends is cut at cache.max_artifact_bytes; the chunks that
    had come but were not on disk yet (up to the 32 MiB backlog) must go with the fetch.
    They were held by the failed flight, which its error's traceback kept in a reference
    cycle: freed only by a full collection, which a busy server makes seldom (campaign: RSS
    +300 MiB for 50 such fetches, back only minutes later). Measured with the collector off,
    so that what stays is what only it would free."""
    sg = await start_symgate([fast_upstream(faults.url_for("elf-zeros"))],
                             cache=CacheConfig(max_artifact_bytes=48 * MIB))
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            status, got, cut = await read_broken(
                f"{sg.url}/buildid/{os.urandom(20).hex()}/debuginfo")
            assert (status, cut) == (200, True) and got < 48 * MIB
        await sg.settled()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.enable()
    assert held < 6 * MIB, f"{held / MIB:.1f} MiB held after three downloads cut off"
