"""A `symgate serve` killed with SIGKILL leaves nothing running: its forkserver, resource
tracker, symbol-table builders and symbolize workers all exit with it."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp

from tests.elfs import ElfSet
from tests.harness import Debuginfod, free_port
from tests.processes import descendants, reap_all, wait_until_serving
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES


async def test_sigkilled_server_leaves_no_helper_processes(
    tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    port = free_port()
    config = tmp_path / "symgate.toml"
    config.write_text(f'[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{tmp_path / "d"}"\n'
                      f'[symbolize]\nbuild_workers = 1\nworkers = 1\n'
                      f'[[upstreams]]\nurl = "{debuginfod.url}"\n')
    proc = await asyncio.create_subprocess_exec(
        "symgate", "serve", "--config", str(config), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "HOME": str(tmp_path)})
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_until_serving(base, proc)
        profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
        async with aiohttp.ClientSession() as s, s.post(
                base + "/symbolize", data=profile.SerializeToString(),
                headers={"Content-Type": "application/octet-stream"}) as r:
            assert r.status == 200 and r.headers["X-Symgate-Mappings-Symbolized"] == "1"
        helpers = descendants(proc.pid)
        # The forkserver, the resource tracker and a worker at least.
        assert len(helpers) >= 3, helpers
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    await reap_all(helpers, "the server")
