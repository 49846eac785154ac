"""A symgate can be another symgate's upstream: a site cache in front of a regional one
serves elfutils' client, and a miss at the far end is a plain 404 at the near one."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.elfs import ElfSet
from tests.harness import Debuginfod, SymgateFactory
from tests.processes import debuginfod_find


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
