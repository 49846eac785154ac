"""Shared fixtures: ELF files built with gcc, a real elfutils debuginfod, a fault-injecting
upstream, PostgreSQL databases, and symgate itself on loopback."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import (
    CacheConfig,
    Config,
    DatabaseConfig,
    NegativeConfig,
    ServerConfig,
    UpstreamConfig,
)
from proxy.web.app import create_app
from tests.elfs import ElfSet, build_elf_set
from tests.faults import FaultUpstream

PG_ADMIN_DSN = os.environ.get("SYMGATE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")

# Tests talk to loopback only: never let a proxy setting route them elsewhere.
for _var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
    os.environ.pop(_var, None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def elfs(tmp_path_factory: pytest.TempPathFactory) -> ElfSet:
    return build_elf_set(tmp_path_factory.mktemp("elfs"))


@dataclass
class Debuginfod:
    url: str
    process: subprocess.Popen[bytes]


@pytest.fixture(scope="session")
def debuginfod(elfs: ElfSet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Debuginfod]:
    """A real elfutils debuginfod indexing the gcc-built fixtures."""
    exe = shutil.which("debuginfod")
    if exe is None:
        pytest.fail("elfutils debuginfod is not installed (apt-get install debuginfod)")
    port = free_port()
    work = tmp_path_factory.mktemp("debuginfod")
    log = (work / "log").open("wb")
    proc = subprocess.Popen(
        [exe, "-p", str(port), "-d", str(work / "db.sqlite"), "-F", str(elfs.upstream_dir),
         "-t", "0", "-g", "0"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    import urllib.request

    pending = [f"{url}/buildid/{e.build_id}/debuginfo" for e in elfs.all]
    while pending:
        try:
            with urllib.request.urlopen(pending[0], timeout=2) as r:
                if r.status == 200:
                    pending.pop(0)
                    continue
        except Exception:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"debuginfod did not index the fixtures: {(work / 'log').read_text()}")
        time.sleep(0.2)
    yield Debuginfod(url, proc)
    proc.terminate()
    proc.wait(10)


@pytest.fixture
async def faults(elfs: ElfSet) -> AsyncIterator[FaultUpstream]:
    upstream = FaultUpstream(elfs)
    await upstream.start()
    yield upstream
    await upstream.stop()


async def _pg_reachable() -> bool:
    import asyncpg

    try:
        conn = await asyncpg.connect(PG_ADMIN_DSN, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """Each test gets a fresh database: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'symgate.sqlite'}"
        return
    import asyncpg

    if not await _pg_reachable():
        pytest.skip(f"no PostgreSQL reachable at {PG_ADMIN_DSN}")
    name = f"symgate_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(PG_ADMIN_DSN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    yield f"{base}/{name}"
    admin = await asyncpg.connect(PG_ADMIN_DSN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()


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
        database=DatabaseConfig(url=database_url),
        negative=NegativeConfig(not_found_initial_ttl_s=60, not_found_ttl_s=600),
        cache=CacheConfig(),
        upstreams=ups,
    )
    return replace(cfg, **sections)


def fast_upstream(url: str, **kw: Any) -> UpstreamConfig:
    """Short limits, so fault tests end in seconds."""
    defaults: dict[str, Any] = dict(connect_timeout_s=2, first_byte_timeout_s=2,
                                    read_timeout_s=2, total_timeout_s=30, retries=1,
                                    retry_backoff_s=0.05, breaker_failures=0)
    defaults.update(kw)
    return UpstreamConfig(url=url, **defaults)


@pytest.fixture
async def start_symgate(
    tmp_path: Path, database_url: str
) -> AsyncIterator[SymgateFactory]:
    running: list[Symgate] = []
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))

    async def start(
        upstreams: list[str] | list[UpstreamConfig] | None = None,
        *, config: Config | None = None, data_dir: Path | None = None, **sections: Any,
    ) -> Symgate:
        cfg = config or make_config(data_dir or tmp_path / "data", database_url,
                                    upstreams or [], **sections)
        registry = CollectorRegistry()
        runner = web.AppRunner(create_app(cfg, registry), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        sg = Symgate(f"http://127.0.0.1:{port}", cfg, runner, registry, session)
        running.append(sg)
        return sg

    yield start
    for sg in running:
        await sg.stop()
    await session.close()


async def gather_bounded(n: int, make: Callable[[int], Awaitable[Any]]) -> list[Any]:
    return list(await asyncio.gather(*(make(i) for i in range(n))))


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    """Wait until `check` holds: for effects of background work (builds, deferred eviction)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.05)
