"""PostgreSQL unreachable (a TCP forwarder in the test, cut and restored): hits are served,
misses are still fetched and served, unknown IDs are 404, /healthz says the database is down;
once it is back the rows written meanwhile reach it, and a restart finds them."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import struct
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import pytest

from proxy.config import Config, UploadConfig
from proxy.health import DATABASE
from proxy.keys import ArtifactKey
from proxy.store.disk import DiskStore
from proxy.store.replica import replica_id
from proxy.store.repository import DATABASE_ERRORS, Repository, create_engine
from proxy.web.state import STATE
from tests.elfs import Elf, ElfSet
from tests.faults import FaultUpstream
from tests.harness import (
    Symgate,
    SymgateFactory,
    cli,
    config_file,
    eventually,
    fast_upstream,
    free_port,
    make_config,
)
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, post, symbolize_config


class Forwarder:
    """127.0.0.1:<port> -> the real PostgreSQL, until cut: then connections are refused and
    those open are reset, as when the database host goes away."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        self._silent = False  # connections accepted and never answered (silence())
        # (SQLSTATE, message) each new connection is refused with (refuse()), or None.
        self._refusal: tuple[str, str] | None = None
        # A statement whose transaction's COMMIT has its answer held (hold_commit()), and the
        # connections whose answers are held until answer().
        self._hold: bytes | None = None
        self._gates: set[asyncio.Event] = set()
        # Every connection's answers held (stall()), open ones and those to come, until answer().
        self._stalled = False
        self._open_gates: set[asyncio.Event] = set()
        self.stalled_connections = 0  # connections whose answers stall() holds now
        # Not port 0's answer, which is in the kernel's ephemeral range: while the forwarder
        # is cut, an outgoing connection of any test may take that port as its own, and
        # binding it again then fails (seen once in CI: EADDRINUSE in silence()).
        self.port = free_port()

    async def start(self) -> None:
        self._silent = False
        # Bound again after a cut: the kernel may not let go of the port at once (seen in CI:
        # EADDRINUSE though nothing of ours listened there), so it is tried for a while.
        for attempt in range(50):
            try:
                self._server = await asyncio.start_server(self._accept, "127.0.0.1",
                                                          self.port)
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE or attempt == 49:
                    raise
                await asyncio.sleep(0.1)
        self.port = self._server.sockets[0].getsockname()[1]

    async def silence(self) -> None:
        """From now on, connections are accepted and never answered, and those open are cut: a
        database host whose packets are dropped, or a server stuck on a lock. The listening
        socket stays: binding its port again is what failed once in CI."""
        self._silent = True
        for w in list(self._pipes):
            w.transport.abort()
        self._pipes.clear()

    async def refuse(self, sqlstate: str, message: str) -> None:
        """From now on, each connection is answered as PostgreSQL answers while it starts up
        or shuts down (57P03), or has too many clients (53300): its FATAL error, then the
        connection closed; those open are cut. heal() ends it."""
        self._refusal = (sqlstate, message)
        for w in list(self._pipes):
            w.transport.abort()
        self._pipes.clear()

    def heal(self) -> None:
        self._refusal = None
        self._silent = False

    def hold_commit(self, statement: bytes) -> None:
        """From now on, a connection that sends `statement` and then a COMMIT has the COMMIT's
        answer, and what follows, held until answer(): the database has committed, and its
        client does not know yet, as when the answer is on its way when the client stops."""
        self._hold = statement

    def stall(self) -> None:
        """From now on, every connection's answers are held, open ones' and new ones' alike,
        until answer(): a server stuck on a lock, or a network that has stopped delivering
        while the connections stay up. Each statement sent meanwhile waits for its timeout."""
        self._stalled = True
        for gate in self._open_gates:
            gate.clear()
            self._gates.add(gate)

    def answer(self) -> None:
        """Send the answers hold_commit() and stall() held, and hold no more."""
        self._hold = None
        self._stalled = False
        for gate in self._gates:
            gate.set()
        self._gates.clear()

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      sqlstate: str, message: str) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            length, code = struct.unpack("!ii", await reader.readexactly(8))
            if code == 80877103:  # SSLRequest: "N", no TLS here; the startup message follows
                writer.write(b"N")
                length, _ = struct.unpack("!ii", await reader.readexactly(8))
            await reader.readexactly(length - 8)
            fields = b"".join(tag + text.encode() + b"\0" for tag, text in (
                (b"S", "FATAL"), (b"V", "FATAL"), (b"C", sqlstate), (b"M", message)))
            writer.write(b"E" + struct.pack("!i", 4 + len(fields) + 1) + fields + b"\0")
            await writer.drain()
        writer.close()

    async def _hang(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._pipes.add(writer)
        with contextlib.suppress(OSError):
            await reader.read()  # until the client gives up

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        for w in list(self._pipes):
            w.transport.abort()
        self._pipes.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusal is not None:
            await self._refuse(reader, writer, *self._refusal)
            return
        if self._silent:
            await self._hang(reader, writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self._pipes.update((writer, up_writer))
        gate = asyncio.Event()  # the server's answers go through while it is set
        gate.set()
        if self._stalled:
            gate.clear()
            self._gates.add(gate)
        self._open_gates.add(gate)
        try:
            await asyncio.gather(_pipe(reader, up_writer, self._watch(gate)),
                                 _pipe(up_reader, writer, self._through(gate)))
        finally:
            self._open_gates.discard(gate)
            self._pipes.difference_update((writer, up_writer))

    def _through(self, gate: asyncio.Event) -> Callable[[bytes], Awaitable[None]]:
        """What holds a connection's answers while its gate is closed, counted while held."""
        async def through(_: bytes) -> None:
            if gate.is_set():
                return
            self.stalled_connections += 1
            try:
                await gate.wait()
            finally:
                self.stalled_connections -= 1

        return through

    def _watch(self, gate: asyncio.Event) -> Callable[[bytes], Awaitable[None]]:
        """What looks at a connection's client's bytes before they go to the server: closes
        the gate before a COMMIT that follows hold_commit()'s statement goes, so that no byte
        of its answer gets through."""
        seen = False

        async def watch(data: bytes) -> None:
            nonlocal seen
            if self._hold is None:
                return
            seen = seen or self._hold in data
            if seen and b"COMMIT" in data:
                gate.clear()
                self._gates.add(gate)
            if b"COMMIT" in data or b"ROLLBACK" in data:
                seen = False  # the transaction's end

        return watch


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                before: Callable[[bytes], Awaitable[object]] | None = None) -> None:
    """`before`: awaited with each chunk before it is passed on."""
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(65536):
            if before is not None:
                await before(data)
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


def _profile_of_big(elfs: ElfSet) -> bytes:
    return make_profile([(place(elfs.big, BASES["prog"]), code_addresses(elfs.big)[:5])]
                        ).SerializeToString()


async def _named_again(sg: Symgate, profile: bytes) -> None:
    """Until the profile is answered with its mapping named: the database answers again."""
    async def named() -> bool:
        status, headers, _ = await post(sg, profile)
        return status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"

    await eventually(named, timeout=30)


async def _behind_forwarder(database_url: str, tmp_path: Path, faults: FaultUpstream
                            ) -> tuple[Forwarder, Config]:
    """A started forwarder to the test's PostgreSQL, and a config that reaches it through it."""
    real = urlsplit(database_url)
    forwarder = Forwarder(real.hostname or "127.0.0.1", real.port or 5432)
    await forwarder.start()
    via = urlunsplit(real._replace(netloc=real.netloc.replace(
        f"{real.hostname}:{real.port}", f"127.0.0.1:{forwarder.port}")))
    return forwarder, make_config(tmp_path / "data", via, [faults.url_for("ok")])


_UPLOAD_TIMEOUT_S = 2.0  # database.timeout_s of _uploaded's servers


async def _uploaded(start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
                    database_url: str, tmp_path: Path, servers: int
                    ) -> tuple[Forwarder, list[Symgate], str, dict[str, str]]:
    """`servers` serving processes on one data dir, behind a forwarder, with prog's debug
    file uploaded: (forwarder, servers, its path, the admin's headers)."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    token = "admin-token-of-this-test"
    cfg = replace(cfg, database=replace(cfg.database, timeout_s=_UPLOAD_TIMEOUT_S),
                  upload=UploadConfig(admin_tokens=(token,)))
    started = [await start_symgate(config=cfg) for _ in range(servers)]
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    admin = {"Authorization": f"Bearer {token}"}
    assert (await started[0].request("PUT", path, data=elfs.prog.debug.read_bytes(),
                                     headers=admin))[0] == 201
    return forwarder, started, path, admin


def with_database_timeout(cfg: Config, timeout_s: float) -> Config:
    """`cfg` with `timeout_s` for the database, and hit counts flushed every 0.1 s: a hit has
    a flush to wait on at once."""
    return replace(cfg, database=replace(cfg.database, timeout_s=timeout_s),
                   server=replace(cfg.server, access_flush_s=0.1))


# Past one database.timeout_s, short of two: what a client that allows for one waits.
_PAST_ONE = 1.6

# database.timeout_s of the tests whose upload the database takes before the outage they are
# about: a request's whole budget of SQL time, which a PUT's rows (through the forwarder, in
# the test process, to PostgreSQL) overran at 1 s on a loaded CI machine, a 503 before the
# outage had begun.
_UPLOADS_THEN_OUTAGE_S = 2.5


def past_one_timeout(timeout_s: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=timeout_s * _PAST_ONE)


async def stops_within_one_timeout(sg: Symgate, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(sg.stop(), timeout_s * _PAST_ONE)
    except TimeoutError:
        pytest.fail("the stop waited past one database.timeout_s")


async def _deleted_once_it_answers(forwarder: Forwarder, sg: Symgate, path: str,
                                   admin: dict[str, str]) -> None:
    """The database answering again, the upload's DELETE goes through: nothing was left
    held by the requests given up on."""
    forwarder.answer()
    assert (await sg.request("DELETE", path, headers=admin))[0] == 204
    await forwarder.cut()


# PostgreSQL alone: the forwarder stands between symgate and a database server. (SQLite made
# unwritable is the full-disk test's case.)
@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_misses_are_served_while_postgresql_is_down(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    cfg = replace(cfg, server=replace(cfg.server, access_flush_s=0.1))
    sg = await start_symgate(config=cfg)
    hit, miss = (f"/buildid/{e.build_id}/debuginfo" for e in (elfs.prog, elfs.other))
    assert (await sg.get(hit))[0] == 200

    await forwarder.cut()
    status, _, body = await sg.get(hit)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    status, _, body = await sg.get(miss)
    assert status == 200 and body == elfs.other.debug.read_bytes(), body[:200]
    assert (await sg.get("/buildid/" + "ee" * 20 + "/debuginfo"))[0] == 404
    status, _, text = await sg.get("/healthz")
    # Still 200: the server is serving; a 503 would have probes pull every replica at once.
    assert status == 200 and text.startswith(b"degraded\n") and b"database: unreachable" in text
    assert b"degraded" in (await sg.get("/"))[2]
    assert (await sg.get(miss))[0] == 200  # now a hit, from memory
    assert faults.count("ok") == 3

    await forwarder.start()  # the database is back: the row kept meanwhile reaches it
    repo = Repository(create_engine(database_url))
    try:
        async def written() -> bool:
            return bool(await repo.artifacts_of(elfs.other.build_id))

        await eventually(written, timeout=30)
    finally:
        await repo.close()
    assert (await sg.get("/healthz"))[2] == b"ok\n"
    await sg.stop()
    again = await start_symgate(config=cfg)  # a restart keeps both, from SQL and disk
    for path, elf in ((hit, elfs.prog), (miss, elfs.other)):
        status, _, body = await again.get(path)
        assert status == 200 and body == elf.debug.read_bytes()
    assert faults.count("ok") == 3


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_database_that_never_answers_holds_no_request_past_its_timeout(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    cfg = replace(cfg, database=replace(cfg.database, timeout_s=1.0))
    sg = await start_symgate(config=cfg)
    hit, miss = (f"/buildid/{e.build_id}/debuginfo" for e in (elfs.prog, elfs.other))
    assert (await sg.get(hit))[0] == 200

    await forwarder.silence()
    # The drivers' own defaults wait a minute (or forever): far past this client's patience.
    patience = aiohttp.ClientTimeout(total=20)
    status, _, body = await sg.get(miss, timeout=patience)
    assert status == 200 and body == elfs.other.debug.read_bytes()
    status, _, body = await sg.get(hit, timeout=patience)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    status, _, text = await sg.get("/healthz", timeout=patience)
    assert status == 200 and b"database: unreachable" in text
    await forwarder.cut()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_request_of_several_queries_waits_one_timeout_for_them_all(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """A remembered miss past its memo (looked up, asked again, written), an unknown ID, a
    section of a cached file (its parent's misses looked up, its fetch's room judged beside
    the periodic look at the cache's totals) each make several queries: against a database
    that never answers, each waited its own database.timeout_s, and the request three or
    four times it. Their time is one timeout in all."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    timeout_s = 3.0
    cfg = replace(with_database_timeout(cfg, timeout_s),
                  upstreams=(fast_upstream(faults.url_for("ok")),
                             fast_upstream(faults.url_for("notfound"))))
    sg = await start_symgate(config=cfg)
    remembered = "/buildid/" + "ee" * 20 + "/debuginfo"
    assert (await sg.get(remembered))[0] == 404
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    await sg.settled()

    await forwarder.silence()
    patience = past_one_timeout(timeout_s)
    for path in (remembered, "/buildid/" + "dd" * 20 + "/debuginfo",
                 f"/buildid/{elfs.prog.build_id}/section/.text",
                 f"/buildid/{elfs.prog.build_id}/source/no/such.c"):
        try:
            status, _, _ = await sg.get(path, timeout=patience)
        except TimeoutError:
            pytest.fail(f"{path} waited past one database.timeout_s")
        assert status in (200, 404), (path, status)
    await forwarder.cut()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_deletes_queued_behind_one_another_wait_one_timeout_in_all(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """Uploads and deletes take their turns one at a time, and each holder asks the database:
    against one that does not answer, the fourth DELETE queued waited four timeouts. Each is
    a 503 (retry later) within one."""
    forwarder, (sg,), path, admin = await _uploaded(start_symgate, faults, elfs, database_url,
                                                    tmp_path, servers=1)

    forwarder.stall()
    patience = past_one_timeout(_UPLOAD_TIMEOUT_S)
    deletes = await asyncio.gather(*(sg.request("DELETE", path, headers=admin, timeout=patience)
                                     for _ in range(4)), return_exceptions=True)
    assert [d if isinstance(d, BaseException) else d[0] for d in deletes] == [503] * 4
    await _deleted_once_it_answers(forwarder, sg, path, admin)


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_delete_waiting_for_another_process_s_upload_lock_waits_one_timeout_in_all(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """Two serving processes on one data dir (as serve --workers 2): one's DELETE holds the
    data dir's upload lock while its query waits on a database that does not answer; the
    other's waited for the lock that long, then for its own query as long again."""
    forwarder, (a, b), path, admin = await _uploaded(start_symgate, faults, elfs, database_url,
                                                     tmp_path, servers=2)

    forwarder.stall()
    patience = past_one_timeout(_UPLOAD_TIMEOUT_S)
    first = asyncio.ensure_future(a.request("DELETE", path, headers=admin, timeout=patience))

    async def a_waits_on_the_database() -> bool:
        return forwarder.stalled_connections > 0

    await eventually(a_waits_on_the_database, timeout=30)
    try:
        status, _, _ = await b.request("DELETE", path, headers=admin, timeout=patience)
    except TimeoutError:
        pytest.fail("b's DELETE waited past one database.timeout_s")
    assert status == 503
    assert (await first)[0] == 503
    await _deleted_once_it_answers(forwarder, b, path, admin)


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_stop_while_the_database_does_not_answer_waits_one_timeout_for_it(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A flush of hit counts under way as the stop begins is let finish, within
    database.timeout_s; the stop's own last flush then waited a timeout of its own: two in
    all before the process could exit."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    timeout_s = 3.0
    sg = await start_symgate(config=with_database_timeout(cfg, timeout_s))
    hit = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(hit))[0] == 200
    await sg.settled()

    forwarder.hold_commit(b"UPDATE artifacts")  # the flush's
    assert (await sg.get(hit))[0] == 200  # a hit count to write

    async def flushing() -> bool:
        return forwarder.stalled_connections > 0

    await eventually(flushing, timeout=30)
    forwarder.stall()  # and the last flush's too
    caplog.set_level(logging.INFO, logger="proxy.web.jobs")
    await stops_within_one_timeout(sg, timeout_s)
    assert "ArtifactCache.flush_access" in caplog.text  # it was under way
    forwarder.answer()
    await forwarder.cut()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_profile_while_postgresql_is_down_is_named_or_refused_never_left_bare(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Tables in memory go on serving, and program headers found meanwhile are used though
    their row cannot be written; a table that must be looked up in SQL cannot be, and a 200
    with the mapping bare would be kept by a profiling backend for good: that profile is
    refused with Retry-After, and named once the database is back."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    # other's debug file in a local tree without its executable: the program headers of a
    # profile of runtime addresses are searched apart, and their row written apart.
    tree = tmp_path / "debug" / ".build-id" / elfs.other.build_id[:2]
    tree.mkdir(parents=True)
    (tree / (elfs.other.build_id[2:] + ".debug")).symlink_to(elfs.other.debug)
    cfg = replace(cfg, database=replace(cfg.database, timeout_s=1.0),
                  symbolize=symbolize_config(debug_dirs=(tmp_path / "debug",)))
    sg = await start_symgate(config=cfg)

    def profile(elf: Elf, runtime: bool = True) -> bytes:
        return make_profile([(place(elf, BASES["prog"]), code_addresses(elf)[:5])],
                            runtime=runtime).SerializeToString()

    for body in (profile(elfs.prog), profile(elfs.other, runtime=False)):
        status, headers, _ = await post(sg, body)
        assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers

    await forwarder.cut()
    # In memory: the first table whole, the second without the executable's program headers,
    # which a profile of runtime addresses has fetched now, their row not written.
    for body in (profile(elfs.prog), profile(elfs.other)):
        status, headers, _ = await post(sg, body)
        assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    assert "program headers of " + elfs.other.build_id in caplog.text
    status, headers, text = await post(sg, profile(elfs.big))
    assert status == 503 and int(headers["Retry-After"]) > 0, (status, headers, text)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text

    await forwarder.start()

    await _named_again(sg, profile(elfs.big))


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
@pytest.mark.parametrize("refusal", [
    ("57P03", "the database system is starting up"),
    ("53300", "sorry, too many clients already"),
])
async def test_a_postgresql_that_refuses_connections_refuses_a_profile_never_leaves_it_bare(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path, caplog: pytest.LogCaptureFixture, refusal: tuple[str, str],
) -> None:
    """A PostgreSQL restarting (or out of connection slots) answers each connection with its
    FATAL error, which reaches SQLAlchemy as a bare DBAPIError rather than an
    OperationalError: it is the database out of reach all the same, a 503 with Retry-After,
    never a table failed "internal" and its mapping left bare in a 200."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    cfg = replace(cfg, database=replace(cfg.database, timeout_s=1.0),
                  symbolize=symbolize_config())
    sg = await start_symgate(config=cfg)
    profile = _profile_of_big(elfs)

    await forwarder.refuse(*refusal)
    status, headers, text = await post(sg, profile)
    assert status == 503 and int(headers["Retry-After"]) > 0, (status, headers, text)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    status, _, text = await sg.get("/healthz")
    assert status == 200 and b"database: unreachable" in text

    forwarder.heal()

    await _named_again(sg, profile)
    await forwarder.cut()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_pool_held_by_hanging_statements_refuses_a_profile_never_leaves_it_bare(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Statements that hang (a lock, a stalled network) hold every pooled connection: the next
    query waits database.timeout_s for one and gets SQLAlchemy's pool TimeoutError, neither an
    OSError nor a DBAPIError. It was taken for a bug: the table failed "internal", and the
    profile was a 200 with its mapping bare, which a backend keeps for good."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    cfg = replace(cfg, database=replace(cfg.database, timeout_s=1.0),
                  symbolize=symbolize_config())
    sg = await start_symgate(config=cfg)
    profile = _profile_of_big(elfs)

    forwarder.stall()
    # Misses of unknown IDs each take a connection to look for a remembered 404, and keep it:
    # its answer never comes. SQLAlchemy's pool holds 5 connections and 10 more.
    misses = [asyncio.ensure_future(sg.get(f"/buildid/{i:040x}/debuginfo")) for i in range(20)]

    async def pool_held() -> bool:
        return forwarder.stalled_connections >= 15

    await eventually(pool_held, timeout=30)
    status, headers, text = await post(sg, profile)
    assert status == 503 and int(headers["Retry-After"]) > 0, (status, headers, text)
    # Unknown IDs: the upstream's 404, the database's answer or not.
    assert [r[0] for r in await asyncio.gather(*misses)] == [404] * 20
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text

    forwarder.answer()

    await _named_again(sg, profile)
    await forwarder.cut()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_purge_made_while_a_replica_could_not_write_its_row_still_reaches_its_copy(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """Replica b fetches a file while its database is out of reach: the row waits in memory.
    An operator purges the key meanwhile (on a, whose database answers). Once b's database is
    back, its purge notice and its pending row meet: the row, written after the purge
    deleted the others, was taken for a fetch made since, and b kept serving the file the
    operator purged, a row naming it in SQL again."""
    forwarder, cfg_b = await _behind_forwarder(database_url, tmp_path / "b", faults)
    quick = dict(server=replace(cfg_b.server, access_flush_s=0.1),
                 cache=replace(cfg_b.cache, purge_poll_s=0.1))
    cfg_b = replace(cfg_b, database=replace(cfg_b.database, timeout_s=1.0), **quick)
    cfg_a = replace(cfg_b, database=replace(cfg_b.database, url=database_url),
                    server=replace(cfg_b.server, data_dir=tmp_path / "a" / "data"))
    a = await start_symgate(config=cfg_a)
    b = await start_symgate(config=cfg_b)
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await a.get(path))[0] == 200  # a's row: what the purge finds the key by
    await a.settled()
    store = DiskStore(cfg_b.server.data_dir / "cache", cfg_b.server.data_dir / "symtabs")
    on_b = store.artifact_path("", ArtifactKey.from_id(f"{elfs.prog.build_id}/debuginfo"))

    await forwarder.cut()
    status, _, body = await b.get(path)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    await b.settled()
    assert on_b.exists()
    purged = await cli(config_file(a, tmp_path), "cache", "purge", elfs.prog.build_id)
    assert purged.returncode == 0, purged.stderr
    await forwarder.start()

    async def b_let_it_go() -> bool:
        return not on_b.exists() and b.runner.app[STATE].service.cache.rows_pending == 0

    await eventually(b_let_it_go, timeout=15)
    repo = Repository(create_engine(database_url),
                      replica=replica_id(cfg_b.server.data_dir / "cache"))
    try:
        assert not await repo.artifacts_of(None, every_replica=False), "a purged file's row"
    finally:
        await repo.close()
    before = faults.count("ok")
    assert (await b.get(path))[::2] == (200, elfs.prog.debug.read_bytes())
    assert faults.count("ok") == before + 1, "b served the purged copy"
    await forwarder.cut()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_an_upload_refused_when_its_rows_commit_went_unanswered_leaves_no_row(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """The database commits an upload's row and the connection breaks before its answer
    comes: the PUT is refused (503, retry later) and its file removed, and the row stayed,
    naming a file on no disk: a pinned upload in SQL that the uploader was told failed,
    counted in the upload budget, and with a bucket found by every replica's
    upload_anywhere (another file's PUT of the key a 409 Conflict)."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    cfg = replace(cfg, database=replace(cfg.database, timeout_s=1.0),
                  upload=UploadConfig(admin_tokens=("admin-token-of-this-test",)))
    sg = await start_symgate(config=cfg)
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    data = elfs.prog.debug.read_bytes()
    admin = {"Authorization": "Bearer admin-token-of-this-test"}

    forwarder.hold_commit(b"INSERT INTO artifacts")
    put = asyncio.ensure_future(sg.request("PUT", path, data=data, headers=admin))

    async def committed_unanswered() -> bool:
        return forwarder.stalled_connections > 0

    await eventually(committed_unanswered, timeout=30)
    await forwarder.cut()  # the answer lost with its connection
    forwarder.answer()
    await forwarder.start()
    status, headers, _ = await put
    assert status == 503 and int(headers["Retry-After"]) > 0, (status, headers)
    repo = Repository(create_engine(database_url))
    try:
        assert not await repo.artifacts_of(elfs.prog.build_id), "a row of a refused upload"
    finally:
        await repo.close()
    assert (await sg.request("PUT", path, data=data, headers=admin))[0] == 201  # the retry
    assert (await sg.get(path))[::2] == (200, data)
    await forwarder.cut()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_an_upload_s_row_committed_unanswered_while_the_database_stays_away_is_taken_back(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """As above, but the database is still out of reach when the refused PUT takes its row
    back: that DELETE failed too, and the row stayed for good once the database was back,
    pinned, on no file: counted in upload.max_bytes, and another build of the same ID (a
    stripped file, say) refused 409 Conflict "a different upload ... DELETE it first", though
    nothing was served. It is taken back at the first flush that reaches the database, and
    /healthz is degraded until then."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    token = "admin-token-of-this-test"
    cfg = replace(with_database_timeout(cfg, _UPLOADS_THEN_OUTAGE_S),
                  upstreams=(fast_upstream(faults.url_for("notfound")),),
                  upload=UploadConfig(admin_tokens=(token,)))
    sg = await start_symgate(config=cfg)
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    admin = {"Authorization": f"Bearer {token}"}

    forwarder.hold_commit(b"INSERT INTO artifacts")
    put = asyncio.ensure_future(sg.request("PUT", path, data=elfs.prog.debug.read_bytes(),
                                           headers=admin))

    async def committed_unanswered() -> bool:
        return forwarder.stalled_connections > 0

    await eventually(committed_unanswered, timeout=30)
    await forwarder.cut()  # the answer lost with its connection, and the database away
    forwarder.answer()
    status, headers, _ = await put
    assert status == 503 and int(headers["Retry-After"]) > 0, (status, headers)
    status, _, text = await sg.get("/healthz")
    assert status == 200 and text.startswith(b"degraded\n"), text
    await forwarder.start()

    async def healthy() -> bool:
        return (await sg.get("/healthz"))[2] == b"ok\n"

    await eventually(healthy, timeout=30)
    repo = Repository(create_engine(database_url))
    try:
        assert not await repo.artifacts_of(elfs.prog.build_id), "a row of a refused upload"
    finally:
        await repo.close()
    stripped = elfs.prog.executable.read_bytes()  # the same build ID, another file
    status, _, text = await sg.request("PUT", path, data=stripped, headers=admin)
    assert status == 201, (status, text)
    assert (await sg.get(path))[::2] == (200, stripped)
    await forwarder.cut()


Answer = tuple[int, dict[str, str], bytes]  # Symgate.request's


async def _delete_answer_lost(sg: Symgate, forwarder: Forwarder, cfg: Config, elfs: ElfSet,
                              token: str) -> tuple[str, Path, asyncio.Future[Answer]]:
    """prog's debug file uploaded, then DELETEd with `token`, the database committing the
    removal and the answer lost with its connection (the forwarder cut, then answering
    again). Its path, its file, and the DELETE under way."""
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    admin = {"Authorization": f"Bearer {token}"}
    assert (await sg.request("PUT", path, data=elfs.prog.debug.read_bytes(),
                             headers=admin))[0] == 201
    on_disk = DiskStore(cfg.server.data_dir / "cache", cfg.server.data_dir / "symtabs"
                        ).artifact_path("", ArtifactKey.from_id(f"{elfs.prog.build_id}/debuginfo"))
    assert on_disk.exists()
    forwarder.hold_commit(b"INSERT INTO purges")
    deleting = asyncio.ensure_future(sg.request("DELETE", path, headers=admin))

    async def committed_unanswered() -> bool:
        return forwarder.stalled_connections > 0

    await eventually(committed_unanswered, timeout=30)
    await forwarder.cut()
    forwarder.answer()
    return path, on_disk, deleting


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_delete_whose_commit_went_unanswered_removes_the_file_it_removed_from_sql(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """The database commits an upload's removal (its rows gone, its notice made) and the
    connection breaks before the answer comes: the DELETE was a 503 and the file stayed on
    disk, on no row, until a restart, its retry a 404. Whether the removal was taken is
    asked where the database answers again."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    token = "admin-token-of-this-test"
    cfg = replace(cfg, database=replace(cfg.database, timeout_s=_UPLOADS_THEN_OUTAGE_S),
                  upstreams=(fast_upstream(faults.url_for("notfound")),),
                  upload=UploadConfig(admin_tokens=(token,)))
    sg = await start_symgate(config=cfg)
    path, on_disk, deleting = await _delete_answer_lost(sg, forwarder, cfg, elfs, token)
    await forwarder.start()
    status, _, text = await deleting
    assert status == 204, (status, text)
    assert not on_disk.exists(), "a file on no row"
    assert (await sg.get(path))[0] == 404
    await forwarder.cut()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
@pytest.mark.parametrize("meanwhile", ["nothing", "another process's commit"])
async def test_a_delete_committed_unanswered_while_the_database_stays_away_removes_its_file_later(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path, meanwhile: str,
) -> None:
    """As above, but the database is still out of reach when the DELETE asks whether its
    removal was taken: a 503 (retry later) is right, but once the database was back the
    file stayed on disk on no row until a restart, the process having forgotten it at its
    own notice, and the DELETE sent again was a 404. The first flush that reaches the
    database asks, and removes it; /healthz is degraded until then."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    token = "admin-token-of-this-test"
    cfg = replace(with_database_timeout(cfg, _UPLOADS_THEN_OUTAGE_S),
                  cache=replace(cfg.cache, purge_poll_s=0.1),
                  upstreams=(fast_upstream(faults.url_for("notfound")),),
                  upload=UploadConfig(admin_tokens=(token,)))
    sg = await start_symgate(config=cfg)
    path, on_disk, deleting = await _delete_answer_lost(sg, forwarder, cfg, elfs, token)
    status, headers, _ = await deleting
    assert status == 503 and int(headers["Retry-After"]) > 0, (status, headers)
    assert (await sg.get("/healthz"))[2].startswith(b"degraded\n")
    if meanwhile != "nothing":
        # Another process on the data dir commits a file of the key meanwhile (a download, its
        # row to be written once the database is back), renamed over the path as a commit
        # is: that file is not the removed upload's, and stays.
        theirs = on_disk.with_name("theirs.tmp")
        theirs.write_bytes(elfs.prog.debug.read_bytes())
        os.replace(theirs, on_disk)
    await forwarder.start()

    async def healthy() -> bool:
        return (await sg.get("/healthz"))[2] == b"ok\n"

    await eventually(healthy, timeout=30)
    if meanwhile == "nothing":
        assert not on_disk.exists(), "a file on no row"
    else:
        assert on_disk.read_bytes() == elfs.prog.debug.read_bytes(), "another's commit removed"
    assert (await sg.get(path))[0] == 404
    await forwarder.cut()


async def _big_hit_only_sql_can_tell(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> tuple[Forwarder, Symgate, str]:
    """A server behind a forwarder (database.timeout_s long), and the path of a big file it
    holds whose inode changed after its row's commit: (forwarder, server, path)."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    cfg = replace(cfg, database=replace(cfg.database, timeout_s=120.0))
    sg = await start_symgate(config=cfg)
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    await sg.settled()  # its commit made
    cached = sg.runner.app[STATE].service.cache.store.artifact_path(
        "", ArtifactKey.from_id(f"{elfs.big.build_id}/debuginfo"))
    os.chmod(cached, os.stat(cached).st_mode)  # its ctime now, past its row's commit
    return forwarder, sg, path


async def _served_at_once_by_a_database_that_never_answers(
    forwarder: Forwarder, sg: Symgate, path: str, elfs: ElfSet
) -> None:
    forwarder.stall()  # a database that takes connections and never answers
    forwarder.heal()
    try:
        status, _, body = await sg.get(path, timeout=aiohttp.ClientTimeout(total=20))
        assert status == 200 and body == elfs.big.debug.read_bytes()
    finally:
        forwarder.answer()
        await forwarder.cut()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_big_hit_whose_commit_only_sql_can_tell_waits_on_no_outage(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """A big file whose inode changed after its row's commit (the data dir chowned or restored
    from a backup) is the hit's commit only as SQL tells (ArtifactCache.still_current). Once
    SQL is known down, every such hit waited out database.timeout_s for it, all the outage
    long, where every other hit is served from disk at once."""
    forwarder, sg, path = await _big_hit_only_sql_can_tell(start_symgate, faults, elfs,
                                                           database_url, tmp_path)
    await forwarder.refuse("57P03", "the database system is starting up")
    status, _, body = await sg.get(path)  # finds SQL down
    assert status == 200 and body == elfs.big.debug.read_bytes()
    await _served_at_once_by_a_database_that_never_answers(forwarder, sg, path, elfs)


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_flush_round_during_an_outage_does_not_say_the_database_is_back(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """The access flush said the database well whenever it had no row of its own to write,
    with no query made, in the middle of an outage: the next hit that asks SQL when it is
    not known down (a big file whose inode changed, above) waited out database.timeout_s,
    once a flush round, all the outage long."""
    forwarder, sg, path = await _big_hit_only_sql_can_tell(start_symgate, faults, elfs,
                                                           database_url, tmp_path)
    cache = sg.runner.app[STATE].service.cache
    await forwarder.refuse("57P03", "the database system is starting up")
    assert (await sg.get(path))[0] == 200  # finds SQL down
    assert cache.health.get(DATABASE) is not None
    with contextlib.suppress(*DATABASE_ERRORS):
        await cache.flush_access()  # the round the job makes: its hit counts cannot be written
    assert cache.health.get(DATABASE) is not None
    await _served_at_once_by_a_database_that_never_answers(forwarder, sg, path, elfs)


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_flush_round_says_the_database_well_or_down_only_by_a_query_it_made(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """An outage /healthz found, with nothing to write: the flush's round said the database
    well with no query made. An outage nothing found yet, with a hit's counts to write: their
    failed write left it said well. (The test above has both at once: either change alone
    passes it.)"""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    sg = await start_symgate(config=cfg)
    cache = sg.runner.app[STATE].service.cache
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    await sg.settled()
    await cache.flush_access()  # nothing left for the next round to write
    try:
        await forwarder.refuse("57P03", "the database system is starting up")
        assert (await sg.get("/healthz"))[2].startswith(b"degraded\ndatabase: unreachable")
        await cache.flush_access()
        assert cache.health.get(DATABASE) is not None, "said well by a round that asked nothing"

        forwarder.heal()
        assert (await sg.get("/healthz"))[2] == b"ok\n"
        assert (await sg.get(path))[0] == 200  # a hit, which asks SQL nothing
        await forwarder.refuse("57P03", "the database system is starting up")
        assert cache.health.get(DATABASE) is None  # nothing has asked it yet
        with contextlib.suppress(*DATABASE_ERRORS):
            await cache.flush_access()
        assert cache.health.get(DATABASE) is not None, "its hit counts not written"
    finally:
        await forwarder.cut()


async def _prog_evicted_in_an_outage(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> tuple[Forwarder, Config, Symgate, Path]:
    """A server whose cache holds one of prog's and other's debug files, behind a forwarder:
    prog's fetched and its table built, then other's fetched with the database cut, which
    evicts prog's. The forwarder, the config, the server and prog's table."""
    forwarder, cfg = await _behind_forwarder(database_url, tmp_path, faults)
    prog, other = (elfs.prog.debug.stat().st_size, elfs.other.debug.stat().st_size)
    cfg = replace(cfg, server=replace(cfg.server, access_flush_s=0.1),
                  database=replace(cfg.database, timeout_s=1.0),
                  cache=replace(cfg.cache, max_bytes=max(prog, other)))
    sg = await start_symgate(config=cfg)
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    await sg.built()
    table = sg.runner.app[STATE].service.cache.store.symtab_path("", elfs.prog.build_id)
    assert table.exists()
    await forwarder.cut()
    status, _, body = await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo")
    assert status == 200 and body == elfs.other.debug.read_bytes()
    await sg.settled()
    return forwarder, cfg, sg, table


async def _table_dropped(database_url: str, table: Path, build_id: str) -> None:
    """Until the table's file and its row are gone."""
    repo = Repository(create_engine(database_url))
    try:
        async def dropped() -> bool:
            return not table.exists() and await repo.get_symbol_table("", build_id) is None

        await eventually(dropped, timeout=15)
    finally:
        await repo.close()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_symbol_table_whose_source_is_evicted_while_postgresql_is_down_goes_after(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """prog's debug file is evicted for other's while the database is down: the eviction
    listener could not read prog's table's row, and left the table, file and row, for good,
    a table of no cached file (not under cache.max_bytes, nor ever evicted again). Once the
    database is back it goes, as it would have with its file."""
    forwarder, _cfg, sg, table = await _prog_evicted_in_an_outage(
        start_symgate, faults, elfs, database_url, tmp_path)
    objects = sg.config.cache_dir / "objects"
    assert not (objects / ArtifactKey.parse(elfs.prog.build_id, "debuginfo").storage_name
                ).exists(), "prog was not evicted"
    await forwarder.start()
    await _table_dropped(database_url, table, elfs.prog.build_id)
    await forwarder.cut()


@pytest.mark.parametrize("database_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_a_symbol_table_whose_source_was_evicted_before_a_stop_in_an_outage_goes_at_start(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, database_url: str,
    tmp_path: Path,
) -> None:
    """As above, but the server stops before the database is back: the next start finds the
    row of prog's evicted file and drops it as stale, and its table with it, which was left
    (file and row) for good."""
    forwarder, cfg, sg, table = await _prog_evicted_in_an_outage(
        start_symgate, faults, elfs, database_url, tmp_path)
    await sg.stop()
    await forwarder.start()

    again = await start_symgate(config=cfg)
    await _table_dropped(database_url, table, elfs.prog.build_id)
    assert (await again.get(f"/buildid/{elfs.other.build_id}/debuginfo"))[0] == 200
    await forwarder.cut()
