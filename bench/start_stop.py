"""How long `symgate serve` takes to start (to its first /healthz 200) and to stop (SIGTERM to
exit), by `symgate`'s entry point (proxy.tools.entry: the command's modules imported with the
cyclic garbage collector off, then frozen) beside the same server run as plain
`python -m proxy.tools.cli`, in interleaved rounds. The test suite starts hundreds of servers;
an operator's restart is one of each.

  python bench/start_stop.py [--rounds 6]

One worker, a fresh SQLite database and data dir each start, an upstream that is never asked.
Prints the median start and stop of each, and the entry point's ratio to the plain module's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
WAYS = {"entry point": "proxy.tools.entry", "plain module": "proxy.tools.cli"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _once(module: str, work: Path) -> tuple[float, float]:
    home = Path(tempfile.mkdtemp(dir=work))
    port = _free_port()
    (home / "symgate.toml").write_text(
        f'[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{home}/data"\n'
        f'[database]\nurl = "sqlite+aiosqlite:///{home}/db.sqlite"\n'
        '[[upstreams]]\nurl = "http://127.0.0.1:9/"\n')
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, "serve", "--config", str(home / "symgate.toml"),
        "--workers", "1", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "HOME": str(home), "PYTHONPATH": str(ROOT)})
    async with aiohttp.ClientSession() as s:
        while True:
            if proc.returncode is not None:
                raise SystemExit(f"{module} exited {proc.returncode} before it served")
            try:
                async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.01)
    up = time.monotonic() - started
    stopping = time.monotonic()
    proc.terminate()
    await proc.wait()
    return up, time.monotonic() - stopping


async def _main(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        runs: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
        for _ in range(rounds):
            for way, module in WAYS.items():
                runs[way].append(await _once(module, Path(work)))
    medians = {way: (statistics.median(u for u, _ in r), statistics.median(s for _, s in r))
               for way, r in runs.items()}
    for way, (up, down) in medians.items():
        print(f"{way:13} start {up:.3f} s  stop {down:.3f} s  (medians of {rounds})")
    (eu, ed), (pu, pd) = medians["entry point"], medians["plain module"]
    print(f"entry point / plain module: start {eu / pu:.2f}x, stop {ed / pd:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    asyncio.run(_main(ap.parse_args().rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
