"""What an operator sees of a running symgate: its logs, metrics, status page, SQL rows and
command line, against real servers on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from proxy.config import ConfigError, load_config
from tests.elfs import ElfSet
from tests.harness import Debuginfod, eventually, free_port
from tests.processes import (
    Start,
    alive,
    descendants,
    run_in_thread,
    start_serve,
    stop_serve,
    wait_until_serving,
)

SECRET = "s3cr3t-T0KEN-in-the-url"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "proxy.tools.entry", *args]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A TMPDIR of its own for a server, short: multiprocessing's forkserver puts its socket
    in it, and a Unix socket's path may not pass 107 bytes (pytest's tmp_path under xdist
    does, with a long test's name)."""
    path = Path(tempfile.mkdtemp(prefix="sg-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def test_credentials_in_an_upstream_url_reach_no_log_metric_page_or_row(
    database_url: str, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    # A private upstream's credentials written into its URL, as DEBUGINFOD_URLS allows.
    upstream = debuginfod.url.replace("http://", f"http://ci:{SECRET}@")
    base, proc = await start_serve(tmp_path, tmp_path / "d", database_url, upstream,
                                   access_log=True)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{base}/buildid/{elfs.prog.build_id}/debuginfo") as r:
            assert r.status == 200  # the upstream is reached through that URL
        async with s.get(f"{base}/buildid/{'ab' * 20}/debuginfo") as r:
            assert r.status == 404  # a remembered miss, under the upstream's name
        async with s.get(f"{base}/") as r:
            page = await r.text()
        async with s.get(f"{base}/metrics") as r:
            metrics = await r.text()
    config = next(tmp_path.glob("symgate-*.toml"))
    listings = [await run_in_thread(_cli(what, "ls", "--config", str(config)))
                for what in ("cache", "negative")]
    await stop_serve([proc])
    assert proc.stdout is not None
    log = (await proc.stdout.read()).decode()
    assert all(listing.returncode == 0 for listing in listings), listings
    assert "upstream=http://***@127.0.0.1" in log  # the access line still names it
    for what, text in [("log", log), ("status page", page), ("metrics", metrics),
                       *((f"{lst.args[3]} ls", lst.stdout) for lst in listings)]:
        assert SECRET not in text, f"the upstream's credentials are in the {what}"


@pytest.mark.parametrize("url", [f"ftp://ci:{SECRET}@mirror/", f"https//ci:{SECRET}@mirror/",
                                 f"http:/ci:{SECRET}@mirror"])
def test_a_url_that_is_not_one_is_refused_without_its_credentials(url: str) -> None:
    # A typo in DEBUGINFOD_URLS: the start-up error, which logs keep, names it all the same.
    with pytest.raises(ConfigError, match=r"^DEBUGINFOD_URLS: expected an http") as e:
        load_config(None, environ={"DEBUGINFOD_URLS": url})
    assert SECRET not in str(e.value) and "mirror" in str(e.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/?token=abc", "http://127.0.0.1:1/#x"])
def test_an_upstream_url_with_a_query_is_refused_at_start(tmp_path: Path, url: str) -> None:
    # Request paths are appended to the URL: after a query every request would ask for "/".
    config = tmp_path / "symgate.toml"
    config.write_text(f'[[upstreams]]\nurl = "{url}"\n')
    with pytest.raises(ConfigError, match=r"^upstreams\[0\]\.url: a query or fragment"):
        load_config(config, environ={})
    with pytest.raises(ConfigError, match=r"^DEBUGINFOD_URLS: a query or fragment"):
        load_config(None, environ={"DEBUGINFOD_URLS": url})


async def _gauges(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(f"{base}/metrics") as r:
        text = await r.text()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in ("symgate_cache_size_bytes", "symgate_cache_entries")}


async def test_cache_gauges_tell_what_is_cached_from_the_start_with_workers(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    # No periodic judge of the shared budget during the test: what the gauges say at start
    # is what start-up set.
    extra = "access_flush_s = 3600.0\n"
    base, proc = await serve(debuginfod.url, workers=2, extra=extra)
    async with aiohttp.ClientSession() as s:
        for elf in (elfs.prog, elfs.big):
            async with s.get(f"{base}/buildid/{elf.build_id}/debuginfo") as r:
                assert r.status == 200
                await r.read()
    size = elfs.prog.debug.stat().st_size + elfs.big.debug.stat().st_size
    config = next(tmp_path.glob("symgate-*.toml"))

    async def committed() -> bool:  # a file is committed after its client's last byte
        stats = await run_in_thread(_cli("cache", "stats", "--json", "--config", str(config)))
        return bool(json.loads(stats.stdout)["entries"] == 2)

    await eventually(committed)
    await stop_serve([proc])
    base, proc = await serve(debuginfod.url, workers=2, extra=extra)
    # A restarted server has lost nothing: its gauges must not say the cache is empty.
    assert await _gauges(base) == {"symgate_cache_size_bytes": size,
                                   "symgate_cache_entries": 2.0}


def test_a_start_that_fails_leaves_no_metrics_folder(tmp_path: Path, short_tmp: Path) -> None:
    # A database out of reach: under a service manager that restarts it, symgate fails to
    # start again and again; each try must leave nothing in the temporary directory.
    config = tmp_path / "symgate.toml"
    config.write_text(f'upstreams = []\n[server]\nlisten = "127.0.0.1:{free_port()}"\n'
                      f'data_dir = "{tmp_path / "d"}"\n[database]\n'
                      f'url = "postgresql+asyncpg://symgate@127.0.0.1:{free_port()}/none"\n'
                      f'timeout_s = 2.0\n')
    temp = short_tmp
    result = subprocess.run(_cli("serve", "--config", str(config), "--workers", "2"),
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "TMPDIR": str(temp)})
    assert result.returncode == 1 and "cannot reach the database" in result.stderr
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize("command", [("cache", "stats"), ("cache", "ls"), ("negative", "ls"),
                                     ("cache", "purge", "--all"), ("negative", "clear", "--all")])
def test_admin_commands_on_a_data_dir_without_a_database_say_so_and_make_nothing(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    # A mistyped --data-dir (or a default one, on a host where the server runs elsewhere).
    where = tmp_path / "no-such-dir"
    config = tmp_path / "symgate.toml"
    config.write_text("upstreams = []\n")
    result = subprocess.run(_cli(*command, "--config", str(config), "--data-dir", str(where)),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr == (f"symgate: no symgate database at {where}/symgate.sqlite: is this "
                             "the server's data dir? (--data-dir, --config)\n")
    assert not where.exists()


async def test_a_file_another_process_cached_is_cached_to_only_if_cached_requests(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    # Two serving processes on one data dir and database (serve --workers N, a restart that
    # overlaps the old process, replicas on one host): a file one of them fetched is cached
    # for the other too, whichever of them a connection reaches. `symgate inspect --server`
    # and `symgate upload` ask with only-if-cached; a chained cache past its hop limit is
    # answered from the cache alone.
    first, _ = await serve(debuginfod.url)
    second, _ = await serve(debuginfod.url)
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    async with aiohttp.ClientSession() as s:
        async with s.get(first + path) as r:
            assert r.status == 200
            await r.read()
        config = next(tmp_path.glob("symgate-*.toml"))

        async def committed() -> bool:  # a file is committed after its client's last byte
            stats = await run_in_thread(_cli("cache", "stats", "--json", "--config",
                                             str(config)))
            return bool(json.loads(stats.stdout)["entries"] == 1)

        await eventually(committed)
        async with s.head(second + path, headers={"Cache-Control": "only-if-cached"}) as r:
            assert r.status == 200
        hops = ", ".join(f"10.0.0.{i}" for i in range(1, 10))  # past forwarded_ttl_limit (8)
        async with s.get(second + path, headers={"X-Forwarded-For": hops}) as r:
            assert r.status == 200
            assert await r.read() == elfs.prog.debug.read_bytes()


@pytest.mark.parametrize(("url", "got"), [
    ("postgresql://symgate:hunter2hunter2@db/symgate", "a postgresql:// URL"),
    ("mysql://db/symgate", "a mysql:// URL"), ("sqlite:///tmp/x.sqlite", "a sqlite:// URL"),
    ("db.internal", "no URL")])
def test_a_database_url_without_symgates_drivers_is_refused_at_start(
    tmp_path: Path, url: str, got: str
) -> None:
    # Before, `symgate serve` got as far as its migration and died with a traceback of a
    # driver it does not ship (No module named 'psycopg').
    expected = ("database.url: expected sqlite+aiosqlite:///PATH or "
                f"postgresql+asyncpg://USER@HOST/DATABASE, got {got}")
    config = tmp_path / "symgate.toml"
    config.write_text(f'upstreams = []\n[database]\nurl = "{url}"\n')
    with pytest.raises(ConfigError) as e:
        load_config(config, environ={})
    assert str(e.value) == expected
    with pytest.raises(ConfigError) as e:  # as the deploy files give it: the password hidden
        load_config(None, environ={"SYMGATE_DATABASE_URL": url})
    assert str(e.value) == f"SYMGATE_DATABASE_URL ({expected})"
    result = subprocess.run(_cli("serve", "--config", str(config), "--data-dir",
                                 str(tmp_path / "d"), "--listen", f"127.0.0.1:{free_port()}"),
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (
        78, f"symgate: configuration error: {config}: {expected}\n")


def test_a_listing_whose_reader_stops_reading_ends_quietly(tmp_path: Path) -> None:
    # `symgate negative ls | head -1`: the pipe closes under the listing. That is no database
    # fault ("cannot reach the database: [Errno 32] Broken pipe", before) and nothing to say.
    config = tmp_path / "symgate.toml"
    config.write_text(f'upstreams = []\n[server]\ndata_dir = "{tmp_path / "d"}"\n')
    assert subprocess.run(_cli("db", "upgrade", "--config", str(config)),
                          capture_output=True).returncode == 0
    read, write = os.pipe()
    os.close(read)  # a reader gone before the first line
    try:
        result = subprocess.run(_cli("negative", "ls", "--config", str(config)), stdout=write,
                                stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (1, "")


@pytest.mark.parametrize("command", [("db", "upgrade"), ("db", "current"), ("negative", "ls"),
                                     ("serve", "--workers", "2"), ("serve", "--workers", "1")])
def test_a_database_that_never_answers_is_given_up_after_its_timeout(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    # A PostgreSQL that accepts connections and says nothing (a hung server, a black-holing
    # network path): database.timeout_s bounds connecting, migrations included, and the
    # message says what happened. Before, migrations waited asyncpg's own 60 s, and a
    # timeout was reported as "cannot reach the database: " and nothing more.
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # connections complete in the kernel's backlog, and hear nothing
        port = silent.getsockname()[1]
        config = tmp_path / "symgate.toml"
        config.write_text(f'upstreams = []\n[server]\nlisten = "127.0.0.1:{free_port()}"\n'
                          f'data_dir = "{tmp_path / "d"}"\n[database]\n'
                          f'url = "postgresql+asyncpg://symgate@127.0.0.1:{port}/symgate"\n'
                          "timeout_s = 1.0\n")
        result = subprocess.run(_cli(*command, "--config", str(config)), capture_output=True,
                                text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    said = result.stderr.strip().splitlines()[-1]
    assert said.endswith(": no answer within database.timeout_s (1 s)"), result.stderr
    assert "cannot reach the database" in said


@pytest.mark.postgres
@pytest.mark.parametrize("action", ["ls", "stats"])
async def test_cache_listings_of_a_dir_no_server_used_say_so_on_a_shared_database(
    serve: Start, debuginfod: Debuginfod, elfs: ElfSet, database_url: str, tmp_path: Path,
    action: str
) -> None:
    # Replicas share the database; `cache ls|stats` show the replica whose data dir is given.
    # Given another (a typo, an admin host), they listed nothing, as if that cache were empty,
    # and made it a replica of its own.
    if database_url.startswith("sqlite"):
        pytest.skip("a shared database")
    base, _ = await serve(debuginfod.url)
    async with aiohttp.ClientSession() as s, s.get(
            f"{base}/buildid/{elfs.prog.build_id}/debuginfo") as r:
        assert r.status == 200
    elsewhere = tmp_path / "elsewhere"
    config = tmp_path / "admin.toml"
    config.write_text(f'upstreams = []\n[database]\nurl = "{database_url}"\n')
    result = await run_in_thread(_cli("cache", action, "--config", str(config),
                                      "--data-dir", str(elsewhere)))
    assert result.returncode == 1, result.stdout
    assert result.stderr.startswith(f"symgate: no symgate cache at {elsewhere / 'cache'}: ")
    assert not elsewhere.exists()


@pytest.mark.parametrize("workers", [1, 2])
async def test_sighup_drains_and_stops_as_sigterm_does(tmp_path: Path, short_tmp: Path,
                                                       workers: int) -> None:
    # A terminal's hangup reaches the supervisor and its workers. It killed the supervisor at
    # once: no drain, its workers left to die as orphans, its metrics folder left in /tmp.
    temp = short_tmp
    port = free_port()
    config = tmp_path / "symgate.toml"
    config.write_text(f'upstreams = []\n[server]\nlisten = "127.0.0.1:{port}"\n'
                      f'data_dir = "{tmp_path / "d"}"\n')
    proc = await asyncio.create_subprocess_exec(
        *_cli("serve", "--config", str(config), "--workers", str(workers)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(temp)})
    await wait_until_serving(f"http://127.0.0.1:{port}", proc)
    family = descendants(proc.pid)
    proc.send_signal(signal.SIGHUP)
    assert proc.stdout is not None
    out = (await proc.stdout.read()).decode()
    assert await proc.wait() == 0, out
    assert not [pid for pid in family if alive(pid)]
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize("workers", [1, 2])
async def test_ctrl_c_drains_a_profile_under_way_without_tracebacks(
        tmp_path: Path, short_tmp: Path, workers: int) -> None:
    """Ctrl-C on a terminal sends SIGINT to every process of the foreground group: the build
    and profile workers too, which died of it (a KeyboardInterrupt traceback each), so the
    profile under way, which the drain was to let finish, got a 503."""
    from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID, libc_tree
    from tests.profiles import make_profile, place
    from tests.symbolize_helpers import BASES

    if not LIBC_DEBUG.exists():
        pytest.skip("needs Debian's libc6-dbg")
    from tests.elfs import Elf

    tree = libc_tree(tmp_path / "debug")
    libc = place(Elf("libc.so.6", LIBC_ID, LIBC, LIBC_DEBUG, ()), BASES["libmix.so"])
    body = make_profile([(libc, [libc.text.vaddr + i * 4096 for i in range(50)])]
                        ).SerializeToString()
    port = free_port()
    config = tmp_path / "symgate.toml"
    config.write_text(f'upstreams = []\n[server]\nlisten = "127.0.0.1:{port}"\n'
                      f'data_dir = "{tmp_path / "d"}"\n[symbolize]\ndebug_dirs = ["{tree}"]\n')
    proc = await asyncio.create_subprocess_exec(
        *_cli("serve", "--config", str(config), "--workers", str(workers)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "TMPDIR": str(short_tmp)}, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_until_serving(base, proc)
        family = descendants(proc.pid)
        async with aiohttp.ClientSession() as s:
            pending = asyncio.ensure_future(s.post(
                base + "/symbolize", data=body,
                headers={"Content-Type": "application/octet-stream"}))
            symtabs = tmp_path / "d" / "symtabs"
            for _ in range(20000):  # bounded: until libc's table is being written
                if list(symtabs.rglob("*.tmp")) or pending.done():
                    break
                await asyncio.sleep(0.0005)
            os.killpg(proc.pid, signal.SIGINT)
            async with await pending as r:
                assert r.status == 200, await r.text()
                assert r.headers["X-Symgate-Mappings-Symbolized"] == "1"
        assert proc.stdout is not None
        out = (await proc.stdout.read()).decode()
        assert await proc.wait() == 0, out
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert "Traceback" not in out, out
    assert not [pid for pid in family if alive(pid)]


@pytest.mark.parametrize(("workers", "group", "pid1"),
                         [(1, True, False), (2, True, False), (2, False, False),
                          (2, True, True)])
async def test_what_a_killed_server_leaves_in_the_temporary_directory_goes_at_the_next_start(
        tmp_path: Path, short_tmp: Path, workers: int, group: bool, pid1: bool) -> None:
    # SIGKILL leaves no cleanup to run: the folder of a supervisor's live metrics, and its
    # forkserver's socket in multiprocessing's own pymp-* folder, which only a clean exit
    # removed, stayed in /tmp for good (each kill of a restart loop under a service manager
    # left one more). The next start removes them; the folders of a server that runs are left
    # alone. Killed alone (`group` False), the supervisor's workers die with it. As PID 1
    # (`pid1`: a container's, each start in a PID namespace of its own), the folders were
    # named after a pid that ran again at the next start, and stayed for good.
    if pid1 and subprocess.run(["unshare", "-pf", "--mount-proc", "true"],
                               capture_output=True).returncode != 0:
        pytest.skip("cannot start a process in a PID namespace of its own here")
    namespace = ["unshare", "-pf", "--mount-proc"] if pid1 else []
    temp = short_tmp
    port = free_port()
    config = tmp_path / "symgate.toml"
    config.write_text(f'upstreams = []\n[server]\nlisten = "127.0.0.1:{port}"\n'
                      f'data_dir = "{tmp_path / "d"}"\n')
    env = {**os.environ, "TMPDIR": str(temp)}
    others = [temp / f"symgate-{kind}-{os.getpid()}-running" for kind in ("metrics", "mp")]
    for other in others:
        other.mkdir()
    killed = await asyncio.create_subprocess_exec(
        *namespace, *_cli("serve", "--config", str(config), "--workers", str(workers)),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env=env,
        start_new_session=True)
    try:
        await wait_until_serving(f"http://127.0.0.1:{port}", killed)
        family = descendants(killed.pid)
    finally:  # the whole process group, as a container's or a cgroup's kill does, or it alone
        if killed.returncode is None:
            if group:
                os.killpg(killed.pid, signal.SIGKILL)
            else:
                killed.kill()
        await killed.wait()

    async def all_gone() -> bool:
        return not [pid for pid in family if alive(pid)]

    await eventually(all_gone)
    left = [f for f in temp.iterdir() if f not in others]
    assert left  # the forkserver's folder, and with workers the metrics folder
    if workers > 1:
        assert [f for f in left if f.name.startswith("symgate-metrics-")]
    again = await asyncio.create_subprocess_exec(
        *namespace, *_cli("serve", "--config", str(config), "--workers", str(workers)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
        start_new_session=True)
    try:
        await wait_until_serving(f"http://127.0.0.1:{port}", again)
        assert [f.name for f in left if f.exists()] == []
        # Named after this test's pid, which no process has in the namespace of its own.
        assert pid1 or all(other.exists() for other in others)
    finally:
        if again.returncode is None:
            # The group: unshare passes no signal on to the server, its namespace's PID 1.
            os.killpg(again.pid, signal.SIGTERM)
        await again.wait()


def _revisions() -> list[str]:
    from alembic.script import ScriptDirectory

    from proxy.store.migrate import alembic_config

    script = ScriptDirectory.from_config(alembic_config("sqlite+aiosqlite://"))
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def test_a_first_migration_logs_every_revision_it_runs(tmp_path: Path) -> None:
    # The log's repeat limit took alembic's "Running upgrade %s -> %s" for a flood of one
    # line: a fresh database showed its upgrade stop at the fifth revision, and nothing said
    # that the rest had run.
    revisions = _revisions()
    assert len(revisions) > 5
    result = subprocess.run(_cli("db", "upgrade", "--data-dir", str(tmp_path / "d")),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for before, after in zip(["", *revisions], revisions, strict=False):
        assert f"Running upgrade {before} -> {after}," in result.stderr, result.stderr


def test_db_current_names_the_revision_of_a_sqlite_database_at_head(tmp_path: Path) -> None:
    # A SQLite file at head is not written to by a start (a read-only one starts too): that
    # shortcut ended `symgate db current` before it showed anything, with status 0.
    where = str(tmp_path / "d")
    assert subprocess.run(_cli("db", "upgrade", "--data-dir", where),
                          capture_output=True).returncode == 0
    result = subprocess.run(_cli("db", "current", "--data-dir", where), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"Rev: {_revisions()[-1]} (head)" in result.stdout, result.stdout


def test_db_current_of_a_data_dir_without_a_database_says_so_and_makes_none(
    tmp_path: Path
) -> None:
    # It made the directory and an empty SQLite file there, and showed no revision, status 0:
    # a mistyped --data-dir read as a database without schema.
    where = tmp_path / "typo"
    result = subprocess.run(_cli("db", "current", "--data-dir", str(where)),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result
    assert result.stderr == (f"symgate: no symgate database at {where / 'symgate.sqlite'}: is "
                             "this the server's data dir? (--data-dir, --config)\n")
    assert not where.exists()


@pytest.mark.parametrize("how", ["file", "flag"])
def test_a_database_without_schema_unmigrated_names_both_ways_to_migrate(
    tmp_path: Path, how: str
) -> None:
    # The hint said "serve without --no-migrate" to an operator who had written
    # migrate_on_start = false, and gave no flag.
    config = tmp_path / "symgate.toml"
    config.write_text(f'upstreams = []\n[server]\nlisten = "127.0.0.1:{free_port()}"\n'
                      + ("[database]\nmigrate_on_start = false\n" if how == "file" else ""))
    where = tmp_path / "d"
    where.mkdir()
    (where / "symgate.sqlite").touch()
    flags = ["--no-migrate"] if how == "flag" else []
    result = subprocess.run(_cli("serve", "--config", str(config), "--data-dir", str(where),
                                 "--workers", "1", *flags),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    said = result.stderr.strip().splitlines()[-1]
    assert said.endswith("has no symgate schema, or an old one: run `symgate db upgrade` (or "
                         "let serve migrate: without --no-migrate, and "
                         "database.migrate_on_start = true)"), said


@pytest.mark.parametrize("command", ["prefetch", "upload"])
def test_the_server_a_command_goes_to_by_default_is_in_its_help(command: str) -> None:
    # Without --server they go to 127.0.0.1:8002, which their help did not say.
    result = subprocess.run(_cli(command, "--help"), capture_output=True, text=True, timeout=60)
    assert "(default http://127.0.0.1:8002)" in " ".join(result.stdout.split())
