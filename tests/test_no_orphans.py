"""A `symgate serve` killed with SIGKILL leaves nothing running: its forkserver, resource
tracker, symbol-table builders and symbolize workers all exit with it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
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


_LEAVES_A_FORK = '''
import os
import time
from multiprocessing import forkserver
from pathlib import Path


def test_leaves_a_fork() -> None:
    forkserver.ensure_running()  # as a server's first build starts it
    pid = os.fork()
    if pid == 0:
        time.sleep(3600)
        os._exit(0)
    Path(os.environ["H_FORK_PID"]).write_text(str(pid))
'''


def test_a_child_a_test_leaves_ends_the_session_even_where_warnings_are_errors(
        tmp_path: Path) -> None:
    """The session keeps the forkserver (tests/conftest.py) and stops it at its end, which
    waits for every holder of its liveness pipe: a child a test left (a fork) is killed
    first. It was killed after the warning that says so, and a suite run with warnings as
    errors (-W error, CI's filterwarnings) raised there: the child was left, and the stop
    waited for it for good."""
    test = tmp_path / "test_inner.py"
    test.write_text(_LEAVES_A_FORK)
    pid_file = tmp_path / "pid"
    root = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
             "-p", "no:benchmark", "-p", "tests.conftest", "--rootdir", str(tmp_path),
             "-W", "error:tests left child processes:UserWarning", str(test)],
            cwd=root, env={**os.environ, "PYTHONPATH": str(root), "H_FORK_PID": str(pid_file)},
            capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        # The session hung with the fork alive: killed here, and only here (once the session
        # reaped it, its pid may be another process's).
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        raise
    assert "1 passed" in done.stdout, done.stdout + done.stderr
    assert "tests left child processes" in done.stdout + done.stderr
