"""Shared fixtures: ELF files built with gcc, a real elfutils debuginfod, a fault-injecting
upstream, PostgreSQL databases, and symgate itself on loopback."""

from __future__ import annotations

import asyncio
import compileall
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.config import Config, UpstreamConfig
from proxy.symbols import executors
from proxy.web.app import body_options, create_app
from tests.elfs import ElfSet, build_elf_set
from tests.faults import FaultUpstream, RawUpstream
from tests.harness import Debuginfod, Symgate, SymgateFactory, free_port, make_config
from tests.processes import Start, alive, children, start_serve, stop_serve

PG_ADMIN_DSN = os.environ.get("SYMGATE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")

# `symgate` as pip installed it, beside this interpreter, found before pyenv's shim, which finds
# it in turn (bash, then `pyenv exec`) and cost each of the suite's hundreds of `symgate`
# processes 0.08 s before Python started. Any other `symgate` first on PATH (a wrapper that
# runs another checkout) stays first.
_FOUND = shutil.which("symgate")
_SCRIPTS = Path(sys.executable).parent
if _FOUND is not None and Path(_FOUND).parent.name == "shims" \
        and (_SCRIPTS / "symgate").exists():
    os.environ["PATH"] = f"{_SCRIPTS}{os.pathsep}{os.environ.get('PATH', '')}"

# Tests talk to loopback only: never let a proxy setting route them elsewhere.
for _var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
    os.environ.pop(_var, None)


@pytest.fixture(scope="session", autouse=True)
def _helpers_kept() -> Iterator[None]:
    """multiprocessing's forkserver and resource tracker, once a test's server started them,
    kept for the next tests of this process: each server's first build started them anew (a
    new interpreter importing what the workers run, 0.4 s of CPU), 700 times a run, a sixth of
    the suite's CPU. Their stop with the last pool is `symgate serve`'s, tested there
    (tests/test_worker_lifecycle.py)."""
    with executors.helpers_kept():
        yield
        # A child a test left (a fork of this process) holds this process's copy of the
        # forkserver's liveness pipe, and the forkserver's stop would wait for it for good.
        # Killed before the warning: where warnings are errors, it raises.
        left = _children_but_helpers()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        if left:
            warnings.warn(f"tests left child processes, killed now: {left}", stacklevel=1)


def _children_but_helpers() -> list[int]:
    """This process's live children other than multiprocessing's forkserver and resource
    tracker."""
    helpers = {getattr(forkserver._forkserver, "_forkserver_pid", None),
               getattr(resource_tracker._resource_tracker, "_pid", None)}
    return sorted(pid for pid in children(os.getpid()) if pid not in helpers and alive(pid))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Our modules compiled to bytecode once, by the controller, before any test starts a
    process: where PYTHONDONTWRITEBYTECODE is set (this kind of machine sets it), Python reads
    a .pyc it finds but never writes one, and every `symgate` process the suite starts
    (servers and the CLI's: 465 in a run, and the helpers they spawn) compiled proxy/,
    symbolize/ and the migrations from source again: a server's start-up CPU went from 1.32
    to 1.12 s (user), and its /healthz came 0.12 s sooner."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller did it before starting the workers
    root = Path(__file__).resolve().parent.parent
    for folder in ("proxy", "symbolize", "migrations", "tests"):
        compileall.compile_dir(root / folder, quiet=1, workers=0)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: two test processes a core, not one. A test spends most of its time waiting
    on what it started (servers starting and stopping, real debuginfod, gcc, PostgreSQL):
    with one a core, two cores were busy 67% of the suite's 15 minutes; with two, 83% of
    12 3/4. At most 16: each holds PostgreSQL connections of its own."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    return min(2 * cores, 16)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A module marked `one_database` runs on SQLite alone. Its subject is not SQL (HTTP
    framing, the debuginfod protocol, symbolization's names and lines): on PostgreSQL its
    tests did the same queries again, which the modules about SQL's part (misses, leases,
    replicas, budgets, tables' records) exercise on both, and cost CI a fifth of its time."""
    kept, dropped = [], []
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and spec.params.get("database_url") == "postgresql" \
                and item.get_closest_marker("one_database") is not None:
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def elfs(tmp_path_factory: pytest.TempPathFactory) -> ElfSet:
    return build_elf_set(tmp_path_factory.mktemp("elfs"))


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


@pytest.fixture
async def raw_upstream(elfs: ElfSet) -> AsyncIterator[RawUpstream]:
    up = RawUpstream(elfs.prog.debug.read_bytes(), [])
    server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    up.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    yield up
    server.close()
    await server.wait_closed()


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
    # SYMGATE_TEST_DB_PREFIX: for a shared server whose databases are named by convention.
    name = f"{os.environ.get('SYMGATE_TEST_DB_PREFIX', 'symgate_test_')}{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(PG_ADMIN_DSN)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    base = PG_ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    yield f"{base}/{name}"
    admin = await asyncpg.connect(PG_ADMIN_DSN)
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    await admin.close()


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
        runner = web.AppRunner(create_app(cfg, registry), access_log=None, **body_options())
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





@pytest.fixture
async def serve(tmp_path: Path, database_url: str) -> AsyncIterator[Start]:
    """Starts `symgate serve` processes on one data dir and database; stops them after."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(upstream: str, workers: int = 1, extra: str = "", access_log: bool = False
                    ) -> tuple[str, asyncio.subprocess.Process]:
        base, proc = await start_serve(tmp_path, tmp_path / "d", database_url, upstream,
                                       workers=workers, extra=extra, access_log=access_log)
        procs.append(proc)
        return base, proc

    yield start
    await stop_serve(procs)
