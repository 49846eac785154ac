"""Real processes the tests drive: elfutils' debuginfod-find, symgate's own commands, and
`symgate serve` started and waited for."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import aiohttp


def debuginfod_find(server: str, cache: Path, *args: str, ua_timeout: int = 20
                    ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBUGINFOD_URLS": server, "DEBUGINFOD_CACHE_PATH": str(cache),
           "DEBUGINFOD_TIMEOUT": str(ua_timeout)}
    return subprocess.run(["debuginfod-find", *args], env=env, capture_output=True, text=True,
                          timeout=60)


async def run_in_thread(cmd: list[str], *, timeout: float = 120,
                        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command to its end without blocking the event loop, so that a symgate serving in
    this process can answer it."""
    return await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True,
                                   env=env, timeout=timeout)


async def wait_until_serving(base_url: str, proc: asyncio.subprocess.Process) -> None:
    """Return once `base_url`/healthz answers 200; if `proc` exits first or 30 s pass, kill it
    and fail with what it printed (its stdout must be a pipe)."""
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            try:
                async with s.get(base_url + "/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if proc.returncode is not None:
                break
            await asyncio.sleep(0.1)
    proc.kill()
    out = await proc.stdout.read() if proc.stdout else b""
    raise AssertionError(f"symgate did not come up: {out.decode()}")
