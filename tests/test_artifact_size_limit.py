"""An upstream cannot fill the disk: an artifact larger than `cache.max_artifact_bytes` is
refused before its body is read when its size is announced, and cut off at the limit when it
is not (a body that never ends); nothing of it is kept, and the server goes on serving."""

from __future__ import annotations

from pathlib import Path

from proxy.config import CacheConfig
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, fast_upstream, read_broken

LIMIT = 512 * 1024


def leftovers(data_dir: Path) -> list[Path]:
    """Files kept or half-written; a live process's temp-folder lock is neither, nor is the
    cache's replica id (proxy.store.replica), nor a fetch's state on the flight board, which
    stays a few seconds after the fetch (proxy.artifacts.board.LINGER_S)."""
    return [p for p in (data_dir / "cache").rglob("*")
            if p.is_file() and p.suffix != ".lock" and p.name != "replica-id"
            and p.parent.name != "flights"]


async def test_an_announced_size_over_the_limit_is_refused_unread(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    assert elfs.big.debug.stat().st_size > LIMIT
    sg = await start_symgate([fast_upstream(faults.url_for("ok"))],
                             cache=CacheConfig(max_artifact_bytes=LIMIT))
    status, _, body = await sg.get(f"/buildid/{elfs.big.build_id}/debuginfo")
    assert status == 406 and b"max_artifact_bytes" in body
    await sg.settled()
    assert await sg.metric("symgate_verification_failures_total", kind="debuginfo",
                           reason="too_large", upstream=faults.url_for("ok")) == 1
    assert leftovers(sg.config.server.data_dir) == []
    # Small files still come through.
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()


async def test_a_body_without_a_size_is_cut_off_at_the_limit(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    faults.chunk_size = 64 * 1024
    sg = await start_symgate([fast_upstream(faults.url_for("chunked"))],
                             cache=CacheConfig(max_artifact_bytes=LIMIT))
    # Streamed from the first byte: past the limit, the response can only be broken off.
    status, got, broken = await read_broken(f"{sg.url}/buildid/{elfs.big.build_id}/debuginfo")
    assert status == 200 and broken and got <= LIMIT
    await sg.settled()
    assert await sg.metric("symgate_verification_failures_total", kind="debuginfo",
                           reason="too_large", upstream=faults.url_for("chunked")) == 1
    assert await sg.metric("symgate_cache_entries") == 0
    assert leftovers(sg.config.server.data_dir) == []
    assert (await sg.get("/healthz"))[0] == 200
