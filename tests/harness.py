"""What tests share besides fixtures: the running symgate's handle, config builders, and
waiting for background work. Fixtures live in conftest.py and build on these."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import (
    CacheConfig,
    Config,
    DatabaseConfig,
    NegativeConfig,
    ServerConfig,
    SymbolizeConfig,
    UpstreamConfig,
)
from tests.processes import run_in_thread


async def serve_loopback(app: web.Application) -> tuple[web.AppRunner, str]:
    """Run a test's own server (an upstream that misbehaves) on a free loopback port."""
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


# Below the kernel's ephemeral range (32768 up), which port 0 and clients draw from.
_FIRST_PORT, _END_PORT = 21000, 32768
_next_port = 0


def free_port() -> int:
    """A loopback port for a server the test starts as a process. Port 0's answer is free only
    until the socket closes: under xdist another test could take it before our server binds,
    or a symgate still shutting down could hold it. So each xdist worker hands out the ports of
    its own range, below the kernel's ephemeral range, in turn, skipping any that is taken."""
    global _next_port
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), index + 1)
    span = (_END_PORT - _FIRST_PORT) // workers
    base = _FIRST_PORT + index * span
    for _ in range(span):
        port = base + _next_port % span
        _next_port += 1
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {base}..{base + span - 1}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    # A symgate holds this name for as long as it lives, even after closing its port.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as u:
        try:
            u.bind(f"\0symgate-listen-127.0.0.1-{port}")
        except OSError:
            return False
    return True


@dataclass
class Debuginfod:
    url: str
    process: subprocess.Popen[bytes]


@dataclass
class Symgate:
    """A symgate server running in this process on a real loopback port."""

    url: str
    config: Config
    runner: web.AppRunner
    registry: CollectorRegistry
    session: aiohttp.ClientSession = field(repr=False)

    async def get(self, path: str, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        async with self.session.get(self.url + path, **kw) as r:
            return r.status, dict(r.headers), await r.read()

    async def request(self, method: str, path: str, **kw: Any
                      ) -> tuple[int, dict[str, str], bytes]:
        async with self.session.request(method, self.url + path, **kw) as r:
            return r.status, dict(r.headers), await r.read()

    async def head(self, path: str, **kw: Any) -> tuple[int, dict[str, str]]:
        async with self.session.head(self.url + path, **kw) as r:
            return r.status, dict(r.headers)

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (name, sorted labels)."""
        async with self.session.get(self.url + "/metrics") as r:
            text = await r.text()
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    async def metric(self, name: str, **labels: str) -> float:
        return (await self.metrics()).get((name, tuple(sorted(labels.items()))), 0.0)

    async def settled(self) -> None:
        """Until no fetch is under way: a fetch commits its file (and evicts for it) after its
        clients have their last byte, so what is on disk and in the metrics lags a response."""
        from proxy.web.state import STATE

        await self.runner.app[STATE].service.wait_idle()

    async def built(self) -> None:
        """settled, and every symbol-table build done too: the files they read are leased
        (not to be evicted) until then, and a build that started as a fetch committed may still
        be writing its table to the disk."""
        from proxy.web.state import STATE

        await self.settled()
        symbols = self.runner.app[STATE].symbols

        async def idle() -> bool:
            return not symbols.busy

        await eventually(idle)

    async def stop(self) -> None:
        await self.runner.cleanup()


SymgateFactory = Callable[..., Awaitable[Symgate]]


def make_config(
    data_dir: Path, database_url: str, upstreams: list[str] | list[UpstreamConfig],
    **sections: Any,
) -> Config:
    ups = tuple(u if isinstance(u, UpstreamConfig) else fast_upstream(u) for u in upstreams)
    cfg = Config(
        server=ServerConfig(listen="127.0.0.1:0", data_dir=data_dir, access_log=False),
        # No worker warmed for a profile that most tests never send: its start, a forkserver
        # importing what workers run, took a third of the suite's CPU, and the server's stop
        # waited for it. A test that symbolizes gives [symbolize] and has one as servers do.
        symbolize=SymbolizeConfig(worker_at_start=False),
        database=DatabaseConfig(url=database_url),
        negative=NegativeConfig(not_found_initial_ttl_s=60, not_found_ttl_s=600),
        cache=CacheConfig(),
        upstreams=ups,
    )
    return replace(cfg, **sections)


# The fault upstream's modes whose answer, or its second half, waits for the test's `release`
# (tests/faults.py): the test says when it comes. Under 2 s limits, a loaded machine that
# stalled the test process's loop (the upstream, the server and the clients share it) past
# them between two steps turned the hold into a retry or a body cut at half, which such a
# test is not about (a CI failure of test_bucket's). 15 s: what that test had been given
# alone. A test that wants a hold to time out says so with its own limit.
_HELD_MODES = ("/hold", "/hold500", "/hold404", "/hold-wrong", "/held")


def fast_upstream(url: str, **kw: Any) -> UpstreamConfig:
    """Short limits, so fault tests end in seconds; no breaker and no rest of a failed file,
    so each request of a test that fails asks the upstream (the tests of those turn them on)."""
    defaults: dict[str, Any] = dict(connect_timeout_s=2, first_byte_timeout_s=2,
                                    read_timeout_s=2, total_timeout_s=30, retries=1,
                                    retry_backoff_s=0.05, breaker_failures=0,
                                    failed_file_rest_s=0)
    if url.endswith(_HELD_MODES):
        defaults.update(first_byte_timeout_s=15, read_timeout_s=15)
    defaults.update(kw)
    return UpstreamConfig(url=url, **defaults)


async def read_broken(url: str) -> tuple[int, int, bool]:
    """(status, bytes received, whether the body was cut off)."""
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await read_rest(r)


async def read_rest(r: aiohttp.ClientResponse, got: int = 0) -> tuple[int, int, bool]:
    """read_broken of a response already begun, `got` bytes of it read."""
    try:
        async for chunk in r.content.iter_chunked(65536):
            got += len(chunk)
    except aiohttp.ClientPayloadError:
        return r.status, got, True
    return r.status, got, False


async def gather_bounded(n: int, make: Callable[[int], Awaitable[Any]]) -> list[Any]:
    return list(await asyncio.gather(*(make(i) for i in range(n))))


@contextlib.contextmanager
def running_debuginfod(scanned: Path, work: Path, *flags: str) -> Iterator[Debuginfod]:
    """A real elfutils debuginfod on a loopback port, scanning the files under `scanned` (-F)
    with `flags` beside; its database and its log (debuginfod.log) in `work`."""
    exe = shutil.which("debuginfod")
    assert exe is not None, "apt-get install debuginfod"
    port = free_port()
    with (work / "debuginfod.log").open("wb") as log:
        proc = subprocess.Popen([exe, "-p", str(port), "-d", str(work / "db.sqlite"),
                                 "-F", str(scanned), *flags],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        yield Debuginfod(f"http://127.0.0.1:{port}", proc)
    finally:
        proc.terminate()
        proc.wait(10)


async def serves(url: str) -> bool:
    """Whether a GET of `url` answers 200 (for servers that index in the background)."""
    try:
        async with aiohttp.ClientSession() as s, s.get(url) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout: float = 30.0
                     ) -> None:
    """Wait until `check` holds: for effects of background work (builds, deferred eviction).
    `check` may be a coroutine function, or a plain one for state in this process."""
    deadline = asyncio.get_running_loop().time() + timeout

    async def holds() -> bool:
        held = check()
        return await held if inspect.isawaitable(held) else held

    while not await holds():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.05)


def config_file(sg: Symgate, tmp_path: Path) -> Path:
    """A config naming `sg`'s data dir and database: what the admin CLI (`symgate cache ...`)
    is run with against a running server's state."""
    path = tmp_path / "admin.toml"
    path.write_text(f'[server]\ndata_dir = "{sg.config.server.data_dir}"\n'
                    f'[database]\nurl = "{sg.config.database_url}"\n')
    return path


async def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`symgate ARGS --config CONFIG`, its output captured."""
    return await run_in_thread(["symgate", *args, "--config", str(config)], timeout=60)


async def upstream_requests(debuginfod: Debuginfod) -> int:
    """debuginfo requests the real debuginfod has answered, by its own count: every test of
    an xdist worker shares that debuginfod, so a count moved by another test's leftover
    request is possible; a server's own outcomes (served) are not."""
    async with aiohttp.ClientSession() as s, s.get(debuginfod.url + "/metrics") as r:
        text = await r.text()
    found = re.search(r'^http_requests_total\{type="debuginfo"\} (\d+)', text, re.M)
    return int(found.group(1)) if found else 0


async def served(base: str) -> dict[str, float]:
    """A server's /buildid debuginfo answers by outcome (hit, miss, negative_hit, ...), by its
    own count: unlike an upstream's request count, which every test sharing that upstream
    moves, it tells what this one server did."""
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^symgate_requests_total\{endpoint="buildid",kind="debuginfo",outcome="(\w+)"\} (\S+)$',
        text, re.M)}


def changes(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
            if after.get(k, 0) != before.get(k, 0)}
