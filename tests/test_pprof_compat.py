"""What /symbolize returns is a profile that Go's own `go tool pprof` reads, inlined
functions and source lines included."""

from __future__ import annotations

import gzip
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.elfs import ElfSet
from tests.harness import Debuginfod, SymgateFactory
from tests.processes import run_in_thread
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, post, symbolize_config


@pytest.mark.skipif(shutil.which("go") is None, reason="needs Debian's golang-go")
async def test_output_parses_with_go_tool_pprof(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog))])
    status, _, body = await post(sg, gzip.compress(profile.SerializeToString()))
    assert status == 200
    out = tmp_path / "out.pb.gz"
    out.write_bytes(body)
    env = {**os.environ, "HOME": str(tmp_path), "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local",
           "PPROF_TMPDIR": str(tmp_path)}
    result = await run_in_thread(["go", "tool", "pprof", "-raw", str(out)], env=env,
                                 timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.search(r"\bmix\b .*util\.c:4", result.stdout), result.stdout[:2000]
    assert "square" in result.stdout and "twist" in result.stdout
