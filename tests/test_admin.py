"""`symgate cache ...` and `symgate negative ...` against a running server's state."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from proxy.config import NegativeConfig
from proxy.keys import ArtifactKey
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import Symgate, SymgateFactory
from tests.processes import run_in_thread

MISSING = "00112233445566778899aabbccddeeff00112233"


def config_file(sg: Symgate, tmp_path: Path) -> Path:
    path = tmp_path / "admin.toml"
    path.write_text(f'[server]\ndata_dir = "{sg.config.server.data_dir}"\n'
                    f'[database]\nurl = "{sg.config.database_url}"\n')
    return path


async def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return await run_in_thread(["symgate", *args, "--config", str(config)], timeout=60)


async def test_cache_ls_stats_and_purge(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    for e in (elfs.prog, elfs.other):
        assert (await sg.get(f"/buildid/{e.build_id}/debuginfo"))[0] == 200
    cfg = config_file(sg, tmp_path)
    ls = await cli(cfg, "cache", "ls")
    assert ls.returncode == 0, ls.stderr
    assert f"{elfs.prog.build_id}/debuginfo" in ls.stdout
    assert f"{elfs.other.build_id}/debuginfo" in ls.stdout
    stats = json.loads((await cli(cfg, "cache", "stats", "--json")).stdout)
    size = elfs.prog.debug.stat().st_size + elfs.other.debug.stat().st_size
    assert stats["entries"] == 2 and stats["bytes"] == size
    assert (await cli(cfg, "cache", "purge")).returncode == 2  # everything needs --all
    purged = await cli(cfg, "cache", "purge", elfs.prog.build_id)
    assert purged.returncode == 0 and "purged 1 artifacts" in purged.stdout
    stored = sg.config.cache_dir / "objects" / ArtifactKey.parse(
        elfs.prog.build_id, "debuginfo").storage_name
    assert not stored.exists()
    only = json.loads((await cli(cfg, "cache", "ls", "--json")).stdout)
    assert [r["key"] for r in only] == [f"{elfs.other.build_id}/debuginfo"]
    # The running server notices and fetches the purged file again.
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes() and faults.count("ok") == 3
    bad = await cli(cfg, "cache", "ls", "not-hex")
    assert bad.returncode == 2 and "invalid build ID" in bad.stderr


async def test_negative_ls_and_clear_make_a_miss_retryable(
    start_symgate: SymgateFactory, faults: FaultUpstream, tmp_path: Path
) -> None:
    sg = await start_symgate([faults.url_for("notfound")],
                             negative=NegativeConfig(not_found_initial_ttl_s=600, memo_s=0.2))
    path = f"/buildid/{MISSING}/debuginfo"
    assert (await sg.get(path))[0] == 404
    cfg = config_file(sg, tmp_path)
    rows = json.loads((await cli(cfg, "negative", "ls", "--json")).stdout)
    assert [(r["key"], r["live"]) for r in rows] == [(f"{MISSING}/debuginfo", True)]
    text = (await cli(cfg, "negative", "ls", MISSING)).stdout
    assert faults.url_for("notfound") in text and "yes" in text
    assert (await sg.get(path))[0] == 404 and faults.count("notfound") == 1  # remembered
    cleared = await cli(cfg, "negative", "clear", MISSING)
    assert cleared.returncode == 0 and "cleared 1" in cleared.stdout
    await asyncio.sleep(0.3)  # the server's in-memory copy lasts memo_s
    assert (await sg.get(path))[0] == 404
    assert faults.count("notfound") == 2  # asked again
