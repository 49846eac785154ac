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
from tests.processes import wait_until_serving
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES


def _alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for a parent to reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


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
        helpers = _descendants(proc.pid)
        # The forkserver, the resource tracker, a builder and a symbolize worker at least.
        assert len(helpers) >= 4, helpers
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    for _ in range(100):
        left = {pid for pid in helpers if _alive(pid)}
        if not left:
            break
        await asyncio.sleep(0.1)
    for pid in left:  # leave no orphans of a failed run either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the server was killed: {sorted(left)}"
