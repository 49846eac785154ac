"""Worker processes start with the first job that needs one and exit after
`symbolize.worker_idle_s` without a job, and multiprocessing's forkserver and resource tracker
with them: a `symgate serve` that is not symbolizing is one process. The next job starts them
again, at nice 5 as before."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp

from tests.elfs import ElfSet
from tests.harness import Debuginfod, eventually, free_port
from tests.processes import descendants, niceness, wait_until_serving
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES


async def _symbolized(base: str, body: bytes) -> str:
    async with aiohttp.ClientSession() as s, s.post(
            base + "/symbolize", data=body,
            headers={"Content-Type": "application/octet-stream"}) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-Symgate-Mappings-Symbolized"]


async def test_workers_start_with_the_first_job_and_exit_with_their_helpers_when_idle(
    tmp_path: Path, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    port = free_port()
    config = tmp_path / "symgate.toml"
    config.write_text(f'[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{tmp_path / "d"}"\n'
                      f'[symbolize]\nbuild_workers = 1\nworkers = 1\nworker_idle_s = 1\n'
                      f'[[upstreams]]\nurl = "{debuginfod.url}"\n')
    proc = await asyncio.create_subprocess_exec(
        "symgate", "serve", "--config", str(config), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "HOME": str(tmp_path)})
    base = f"http://127.0.0.1:{port}"
    body = make_profile([(place(elfs.prog, BASES["prog"]),
                          code_addresses(elfs.prog)[:5])]).SerializeToString()

    async def no_helpers() -> bool:
        return not descendants(proc.pid)

    try:
        await wait_until_serving(base, proc)
        assert not descendants(proc.pid), "helper processes started before any job"
        assert await _symbolized(base, body) == "1"
        helpers = descendants(proc.pid)
        # The forkserver and the resource tracker, and the workers that built and rewrote.
        assert len(helpers) >= 3, helpers
        workers = {pid for pid in helpers if niceness(pid) == 5}
        assert workers and len(workers) <= 2, helpers
        await eventually(no_helpers)
        assert await _symbolized(base, body) == "1"
        again = descendants(proc.pid)
        assert again and again.isdisjoint(helpers), (helpers, again)
        assert any(niceness(pid) == 5 for pid in again)
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
