"""The SQL engine and the queries symgate runs: one repository class, no SQL elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Row,
    bindparam,
    delete,
    event,
    func,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import ExceptionContext, make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from proxy.store.budget import budget_left_s, spending
from proxy.store.local_reads import LocalReads, PointRead
from proxy.store.models import (
    Artifact,
    Base,
    BucketObject,
    Lease,
    Negative,
    Purge,
    SymbolTableRow,
)
from proxy.store.replica import UNCLAIMED
from proxy.to_the_end import to_the_end


def create_engine(url: str, timeout_s: float | None = None, *, statements: bool = True
                  ) -> AsyncEngine:
    """`timeout_s` bounds connecting to PostgreSQL, waiting for a pooled connection and, with
    `statements`, each statement (None: the drivers' defaults, which wait a minute or
    forever); on SQLite, with `statements`, how long a statement waits for another
    connection's lock on the file (a writer elsewhere, an operator's `BEGIN EXCLUSIVE`).
    Migrations bound the connecting only: a statement of theirs may wait for the lock
    another replica's migration holds."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url)
        # A C int of milliseconds, which SQLite reads as 0 (no wait at all) past some 24.8 days.
        busy_ms = (min(int(timeout_s * 1000), 2**31 - 1) if timeout_s and statements
                   else _SQLITE_BUSY_MS)

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            # WAL lets the admin CLI read while the server writes; NORMAL is durable enough
            # for a cache whose every row can be re-derived from upstream.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute(f"PRAGMA busy_timeout={busy_ms}")
            cur.close()

        @event.listens_for(engine.sync_engine, "do_connect")
        def _connect_waiting_on_failure(_dialect: Any, _record: Any, _cargs: Any,
                                        cparams: dict[str, Any]) -> None:
            cparams["async_creator_fn"] = _aiosqlite_connect

        @event.listens_for(engine.sync_engine, "handle_error")
        def _renew_stuck(context: ExceptionContext) -> None:
            # A connection that could not write its file (made read-only, immutable, on a
            # filesystem remounted read-only) stays read-only once the file is writable
            # again: pooled, it would fail every write until a restart. Dropped instead, so
            # that the next query opens the file afresh.
            if _SQLITE_STUCK.search(str(context.original_exception)):
                context.is_disconnect = True

        return engine
    if timeout_s is None:
        engine = create_async_engine(url, pool_pre_ping=True)
    else:
        engine = create_async_engine(
            url, pool_pre_ping=True, pool_timeout=timeout_s,
            connect_args={"timeout": timeout_s,
                          **({"command_timeout": timeout_s} if statements else {})})

    @event.listens_for(engine.sync_engine, "invalidate")
    def _cut(dbapi_conn: Any, _record: Any, _error: BaseException | None) -> None:
        # A connection dropped for failing (a statement past its time, cut by its request's
        # budget, a database gone) was then closed politely, waiting up to 2 s for the
        # database's goodbye: one that does not answer held the request that long again.
        dbapi_conn.driver_connection.terminate()

    return engine


async def _aiosqlite_connect(*args: Any, **kwargs: Any) -> Any:
    """aiosqlite's connect, as SQLAlchemy makes it, but a connect that fails (the file a
    directory, or not to be opened) returns once aiosqlite's thread for it has ended: aiosqlite
    ends the thread without waiting, and the thread's last word came to the event loop after
    a start that failed had closed it: a traceback of the thread ("Event loop is closed")
    beside the start's one line."""
    import aiosqlite

    connection = aiosqlite.connect(*args, **kwargs)
    thread = connection._thread
    thread.daemon = True  # as SQLAlchemy's own connect makes it: no exit waits for it
    try:
        return await connection
    except Exception:
        await asyncio.to_thread(thread.join)
        raise


# How long a SQLite statement waits for another connection's lock without a timeout given.
_SQLITE_BUSY_MS = 10_000

# SQLITE_READONLY and SQLITE_IOERR, as sqlite3 words them.
_SQLITE_STUCK = re.compile(r"attempt to write a readonly database|disk I/O error")

# What a query raises when the database cannot be reached or written (a PostgreSQL that is
# down, a SQLite file on a full disk), as opposed to a bug in the query.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (SQLAlchemyError, OSError)

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

# SQLSTATE classes of a PostgreSQL that is there but cannot serve now: connection exceptions
# (08), insufficient resources (53: too many connections, its disk full), operator
# intervention (57: starting up, shutting down, a query cancelled) and system errors (58).
# asyncpg's errors of these kinds reach SQLAlchemy as a bare DBAPIError, not an
# OperationalError: told apart by their code, not their class.
_OUTAGE_STATES = ("08", "53", "57", "58")


def is_unreachable(error: BaseException) -> bool:
    """Whether a query failed because the database is gone or cannot serve now (a refused
    or cut connection, a query past database.timeout_s, a server starting up or shutting
    down, every pooled connection held past database.timeout_s by statements that hang), as
    opposed to a wrong query, which is a bug to show."""
    # PoolTimeout: no DBAPIError, raised before any statement is sent; it is the database
    # not answering all the same (the pool's connections all wait on it).
    if isinstance(error, (OperationalError, InterfaceError, OSError, PoolTimeout)):
        return True
    if isinstance(error, DBAPIError):
        if error.connection_invalidated:
            return True
        state = getattr(error.orig, "sqlstate", None)
        return isinstance(state, str) and state[:2] in _OUTAGE_STATES
    return False


def sql_failure(error: BaseException) -> str:
    """A failed query's error in a line: its type, and the first line of its text (a driver's
    error can run to a statement and its parameters)."""
    first = str(error).splitlines()[0][:200] if str(error) else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def is_read_only(error: BaseException) -> bool:
    """EROFS, raised directly or as the cause of another error (a build worker's): the data
    dir's filesystem cannot be written at all."""
    return any(isinstance(seen, OSError) and seen.errno == errno.EROFS
               for seen in _causes(error))


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC or EDQUOT, raised directly or by SQLite ("database or disk is full")."""
    return any((isinstance(seen, OSError) and seen.errno in _NO_SPACE)
               or "database or disk is full" in str(seen) for seen in _causes(error))


def _causes(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what caused it: its __cause__, or the driver's error SQLAlchemy wraps."""
    seen: BaseException | None = error
    for _ in range(8):  # the chain of causes is short; never follow a cycle
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or getattr(seen, "orig", None)


def _identity(path: Path | None) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`; None when there is none (or no path)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def aware(dt: datetime) -> datetime:
    """SQLite hands back naive datetimes; everything here is UTC."""
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class ArtifactRecord:
    key_hash: str
    scope: str
    key: str
    build_id: str
    kind: str
    size: int
    sha256: str
    upstream: str
    filename: str
    archive: str | None
    fetched_at: datetime
    last_access: datetime
    hits: int
    ima_signature: str | None = None
    # An upload: outside the LRU budget, never evicted; removed only by DELETE or an operator.
    pinned: bool = False
    # In the shared bucket, or was (read from it, or written to it): the catch-up leaves it be,
    # so that what the bucket's eviction took does not come back.
    shared: bool = False


@dataclass(frozen=True, slots=True)
class SymbolTableRecord:
    scope: str
    build_id: str
    outcome: str
    format: str
    source_key: str
    size: int
    load_address: int
    code_ranges: str
    cold_ranges: str
    has_lines: bool
    file_layout: str | None
    error: str | None
    built_at: datetime
    build_seconds: float
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class BucketRecord:
    """An object whole in the shared bucket, and what a hit on it serves."""

    key_hash: str
    scope: str
    key: str
    build_id: str
    kind: str
    size: int
    sha256: str
    upstream: str
    filename: str
    archive: str | None
    last_modified: str | None
    ima_signature: str | None
    pinned: bool
    stored_at: datetime
    last_access: datetime


@dataclass(frozen=True, slots=True)
class NegativeRecord:
    upstream: str
    outcome: str
    misses: int
    expires_at: datetime


def _columns(rec: ArtifactRecord | SymbolTableRecord | BucketRecord) -> dict[str, Any]:
    """A record's fields are named after its table's columns."""
    return {name: getattr(rec, name) for name in rec.__slots__}


def _record(row: Artifact | Row[Any]) -> ArtifactRecord:
    return ArtifactRecord(
        row.key_hash, row.scope, row.key, row.build_id, row.kind, row.size, row.sha256,
        row.upstream, row.filename, row.archive, aware(row.fetched_at), aware(row.last_access),
        row.hits, row.ima_signature, row.pinned, row.shared,
    )


def _bucket_record(row: BucketObject) -> BucketRecord:
    return BucketRecord(
        row.key_hash, row.scope, row.key, row.build_id, row.kind, row.size, row.sha256,
        row.upstream, row.filename, row.archive, row.last_modified, row.ima_signature,
        row.pinned, aware(row.stored_at), aware(row.last_access))


@dataclass(frozen=True, slots=True)
class PurgeNotice:
    id: int
    key_hash: str
    scope: str
    key: str
    # The version removed (see migration 0007): its bytes, its commit on `replica`, which
    # removed it from its own disk and rows. None for an operator's purge of every version.
    sha256: str | None = None
    fetched_at: datetime | None = None
    replica: str | None = None


# Built once: making a statement anew costs more than running it on a local SQLite.
_ARTIFACT_BY_HASH = select(Artifact.__table__).where(
    Artifact.key_hash == bindparam("kh"), Artifact.replica == bindparam("replica"))
_SYMBOL_TABLE = select(SymbolTableRow.__table__).where(
    SymbolTableRow.scope == bindparam("scope"), SymbolTableRow.build_id == bindparam("bid"))
_SET_FILE_LAYOUT = update(SymbolTableRow).where(
    SymbolTableRow.scope == bindparam("in_scope"), SymbolTableRow.build_id == bindparam("bid"),
).values(file_layout=bindparam("layout"))
_NEGATIVES_BY_HASH = select(Negative.upstream, Negative.outcome, Negative.misses,
                            Negative.expires_at).where(Negative.key_hash == bindparam("kh"))
_ARTIFACT_READ = PointRead(_ARTIFACT_BY_HASH)
_SYMBOL_TABLE_READ = PointRead(_SYMBOL_TABLE)
_NEGATIVES_READ = PointRead(_NEGATIVES_BY_HASH)


class Repository:
    def __init__(self, engine: AsyncEngine, replica: str = "", *,
                 timeout_s: float | None = None) -> None:
        """`replica`: the replica whose artifact rows this one reads and writes (its disk's
        files, proxy.store.replica); reads marked so cover every replica's. `timeout_s`
        (database.timeout_s): how long a write waits for its turn in this process's queue
        (SQLite) before it fails as a database out of reach."""
        self.engine = engine
        self.replica = replica
        self._write_wait_s = timeout_s or None
        self._session = async_sessionmaker(engine, expire_on_commit=False)
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        self._local = LocalReads.of(engine)
        self._upserts: dict[tuple[object, ...], Any] = {}
        # SQLite takes one writer at a time and makes the others sleep and try again (its
        # busy handler sleeps 1, 2, 5, 10, ... ms): a cold profile's 60 builds writing their
        # rows at once took 134 ms, against 31 ms one after another (max 106 against 0.5 ms
        # a write). This process's writes queue here instead; another process's still meet
        # the busy handler. PostgreSQL locks rows, not the database: no queue.
        self._writes = asyncio.Lock() if engine.dialect.name == "sqlite" else None
        # The SQLite file as it is now (made by the migrations): which file the connections
        # opened, told from one put at its path later.
        self._opened = _identity(self.sqlite_file)

    @contextlib.asynccontextmanager
    async def _writing(self) -> AsyncIterator[None]:
        if self._writes is None:
            yield
            return
        # Bounded: a file locked elsewhere (another process's long transaction, an
        # operator's `BEGIN EXCLUSIVE`) fails each write after busy_timeout, and unbounded,
        # the N-th write queued behind it would fail after N of those, its request with it.
        try:
            async with asyncio.timeout(self._write_wait_s):
                await self._writes.acquire()
        except TimeoutError:
            raise TimeoutError(f"no turn to write to SQLite within {self._write_wait_s:g} s: "
                               "the writes before it wait for a lock on the file") from None
        try:
            yield
        finally:
            self._writes.release()

    @contextlib.asynccontextmanager
    async def _begin(self) -> AsyncIterator[AsyncSession]:
        """A session in a write transaction: no write transaction nests in another."""
        async with spending(), self._writing(), self._session.begin() as s:
            if self._writes is not None:
                await self._bound_busy_wait(await s.connection())
            yield s

    @contextlib.asynccontextmanager
    async def _begin_connection(self) -> AsyncIterator[AsyncConnection]:
        """A connection in a write transaction, as _begin."""
        async with spending(), self._writing(), self.engine.begin() as c:
            if self._writes is not None:
                await self._bound_busy_wait(c)
            yield c

    async def _bound_busy_wait(self, conn: AsyncConnection) -> None:
        """SQLite: a write waits for another process's lock on the file in its thread, where a
        cancel at the end of its request's database time (proxy.store.budget) does not reach:
        the request, or a stop's last flush, waited the connection's whole busy_timeout. Past
        half of it spent, the wait is what is left; the next write there gets the whole again.
        Rarely a statement more: a request spends milliseconds on a database that answers."""
        if self._write_wait_s is None:
            return
        whole = int(self._write_wait_s * 1000)
        left = budget_left_s()
        wanted = whole if left is None or left > self._write_wait_s / 2 \
            else max(1, int(left * 1000))
        if conn.info.get("busy_ms", whole) != wanted:
            await conn.exec_driver_sql(f"PRAGMA busy_timeout={wanted}")
            conn.info["busy_ms"] = wanted

    @contextlib.asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncSession]:
        """A session for reading, its time spent from its request's budget."""
        async with spending(), self._session() as s:
            yield s

    @contextlib.asynccontextmanager
    async def _connect(self) -> AsyncIterator[AsyncConnection]:
        """A connection, its time spent from its request's budget."""
        async with spending(), self.engine.connect() as c:
            yield c

    @property
    def sqlite_file(self) -> Path | None:
        """The SQLite database's file; None for PostgreSQL, or a SQLite in memory."""
        url = self.engine.url
        if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
            return None
        return Path(url.database)

    def file_gone(self) -> bool:
        """Whether the SQLite file this repository opened is no longer at its path (deleted,
        or another moved there): its open connections go on writing to the old one, which
        nothing will open again. False for PostgreSQL."""
        if self._opened is None:
            self._opened = _identity(self.sqlite_file)
            return False
        return _identity(self.sqlite_file) != self._opened

    async def close(self) -> None:
        if self._local is not None:
            self._local.close()
        # A stop signal cancels a start under way (proxy.web.app._started), and this close in
        # it: cut while aiosqlite closes a connection, the pool logged a traceback on a start
        # that failed cleanly.
        await to_the_end(self.engine.dispose())

    # -- artifacts ---------------------------------------------------------------------------
    async def _point(self, read: PointRead, params: dict[str, Any]) -> Sequence[Any]:
        """The rows of a point read: on this thread from a SQLite file (LocalReads), else
        through the engine."""
        if self._local is not None and (here := self._local.rows(read, params)) is not None:
            return here
        async with self._connect() as c:
            rows: Sequence[Any] = (await c.execute(read.statement, params)).all()
            return rows

    async def get_artifact(self, key_hash: str) -> ArtifactRecord | None:
        rows = await self._point(_ARTIFACT_READ, {"kh": key_hash, "replica": self.replica})
        return _record(rows[0]) if rows else None

    async def upload_anywhere(self, key_hash: str) -> ArtifactRecord | None:
        """The upload of this key on whichever replica took it (its pinned row), if any: an
        upload is the cluster's, not only its own replica's."""
        async with self._read() as s:
            row = (await s.scalars(select(Artifact).where(
                Artifact.key_hash == key_hash, Artifact.pinned.is_(True))
                .order_by(Artifact.fetched_at.desc()).limit(1))).first()
            return _record(row) if row is not None else None

    async def artifacts_of(self, build_id: str | None, *, every_replica: bool = True
                           ) -> Sequence[ArtifactRecord]:
        """All artifacts, or those of one build ID; most recently used first. Every
        replica's copies, or with `every_replica=False` this replica's."""
        query = select(Artifact).order_by(Artifact.last_access.desc())
        if not every_replica:
            query = query.where(Artifact.replica == self.replica)
        if build_id is not None:
            query = query.where(Artifact.build_id == build_id)
        async with self._read() as s:
            return [_record(r) for r in (await s.scalars(query)).all()]

    async def named(self, scopes: Sequence[str], *, build_id: str | None = None,
                    filenames: Sequence[str] = ()) -> Sequence[ArtifactRecord]:
        """Cached ELF files (debuginfo, executable) of these scopes, of one build ID or of
        these file names (all of them when neither is given): what /metadata lists. Each
        artifact once, whichever replicas hold it."""
        query = select(Artifact).where(Artifact.scope.in_(list(scopes)),
                                       Artifact.kind.in_(("debuginfo", "executable")))
        if build_id is not None:
            query = query.where(Artifact.build_id == build_id)
        if filenames:
            query = query.where(Artifact.filename.in_(list(filenames)))
        async with self._read() as s:
            rows = (await s.scalars(query.order_by(Artifact.key))).all()
        return list({r.key_hash: _record(r) for r in rows}.values())

    async def all_artifacts(self) -> Sequence[ArtifactRecord]:
        """This replica's, least recently used first: the order eviction works in."""
        return await self._artifacts_of_replica(self.replica)

    async def unclaimed_artifacts(self) -> Sequence[ArtifactRecord]:
        """Rows from before replicas were told apart (migration 0005), for a replica to take."""
        return await self._artifacts_of_replica(UNCLAIMED)

    async def _artifacts_of_replica(self, replica: str) -> Sequence[ArtifactRecord]:
        async with self._read() as s:
            rows = (await s.scalars(select(Artifact).where(Artifact.replica == replica)
                                    .order_by(Artifact.last_access))).all()
            return [_record(r) for r in rows]

    async def claim_artifacts(self, key_hashes: Iterable[str]) -> None:
        """Make these unclaimed rows this replica's: their files are on its disk."""
        hashes = list(key_hashes)
        if not hashes:
            return
        async with self._begin() as s:
            await s.execute(update(Artifact).where(
                Artifact.replica == UNCLAIMED, Artifact.key_hash.in_(hashes)
            ).values(replica=self.replica))

    async def totals(self, *, pinned: bool = False) -> tuple[int, int]:
        """(artifacts, bytes) of this replica's cache under its budget, as every process on it
        has written it; with `pinned`, of the uploads instead."""
        async with self._read() as s:
            count, size = (await s.execute(select(
                func.count(), func.coalesce(func.sum(Artifact.size), 0)
            ).where(Artifact.pinned == pinned, Artifact.replica == self.replica))).one()
            return int(count), int(size)

    async def upload_scopes(self) -> set[str]:
        """The scopes that hold an upload on some replica."""
        async with self._read() as s:
            return set((await s.scalars(select(Artifact.scope).where(
                Artifact.pinned.is_(True)).distinct())).all())

    async def least_recently_used(self, limit: int) -> Sequence[ArtifactRecord]:
        """The files of this replica eviction may take (uploads are pinned), least recently
        used first."""
        async with self._read() as s:
            rows = (await s.scalars(
                select(Artifact).where(Artifact.pinned.is_(False),
                                       Artifact.replica == self.replica)
                .order_by(Artifact.last_access).limit(limit))).all()
            return [_record(r) for r in rows]

    async def _upsert(
        self, model: type[Base], values: Mapping[str, Any], keys: Sequence[str],
        update_only: Sequence[str] | None = None,
    ) -> None:
        """INSERT ... ON CONFLICT (keys) DO UPDATE, the same on SQLite and PostgreSQL, in a
        transaction of its own."""
        columns = tuple(update_only if update_only is not None
                        else [k for k in values if k not in keys])
        shape = (model, tuple(values), tuple(keys), columns)
        stmt = self._upserts.get(shape)
        if stmt is None:
            # The new values are the statement's parameters (`excluded`), not part of it: one
            # statement a shape, compiled once, where values inlined made a new one each time
            # (1.3 -> 0.8 ms a write on SQLite, on the event loop of every build's record).
            insert = self._insert(model)
            stmt = self._upserts[shape] = insert.on_conflict_do_update(
                index_elements=list(keys), set_={c: insert.excluded[c] for c in columns})
        async with self._begin_connection() as c:
            await c.execute(stmt, dict(values))

    async def put_artifact(self, rec: ArtifactRecord) -> None:
        values = {**_columns(rec), "replica": self.replica}
        insert = self._insert(Artifact).values(**values)
        # A download committed over an upload of the same key leaves it an upload.
        stmt = insert.on_conflict_do_update(index_elements=["key_hash", "replica"], set_={
            **{c: values[c] for c in values if c not in ("key_hash", "replica")},
            "pinned": or_(Artifact.pinned, insert.excluded.pinned)})
        async with self._begin() as s:
            await s.execute(stmt)
            # Having the file now makes any remembered miss for it wrong.
            await s.execute(delete(Negative).where(Negative.key_hash == rec.key_hash))

    async def delete_artifacts(self, key_hashes: Iterable[str]) -> None:
        """Delete this replica's rows of these keys: its files are gone."""
        hashes = list(key_hashes)
        if not hashes:
            return
        async with self._begin() as s:
            await s.execute(delete(Artifact).where(Artifact.key_hash.in_(hashes),
                                                   Artifact.replica == self.replica))

    async def delete_commits(self, commits: Iterable[tuple[str, datetime]]) -> set[str]:
        """Delete this replica's rows of these (key hash, fetched_at) pairs, each only while it
        still describes that commit; the key hashes whose rows went. A row another process has
        written since (it evicted the key and fetched it again) describes a newer file, which
        is not the caller's to remove."""
        pairs = list(commits)
        if not pairs:
            return set()
        async with self._begin_connection() as c:
            result = await c.execute(delete(Artifact).where(
                Artifact.replica == self.replica,
                tuple_(Artifact.key_hash, Artifact.fetched_at).in_(pairs),
            ).returning(Artifact.key_hash))
            return set(result.scalars())

    async def commits_of(self, key_hashes: Iterable[str]) -> dict[str, datetime]:
        """When this replica's rows of these keys were fetched (what tells one commit of a key
        from another), by key hash; a key without a row is left out."""
        hashes = list(key_hashes)
        if not hashes:
            return {}
        async with self._connect() as c:
            rows = await c.execute(select(Artifact.key_hash, Artifact.fetched_at).where(
                Artifact.replica == self.replica, Artifact.key_hash.in_(hashes)))
            return {r.key_hash: aware(r.fetched_at) for r in rows}

    async def purge_artifacts(self, records: Iterable[ArtifactRecord], when: datetime) -> None:
        """Delete every replica's rows of these artifacts, and leave a notice for each serving
        process to remove its own copy (proxy.artifacts.purges): a replica that is down
        finds its files without rows at its next start, and removes them then."""
        recs = {r.key_hash: r for r in records}
        if not recs:
            return
        async with self._begin() as s:
            await s.execute(delete(Artifact).where(Artifact.key_hash.in_(list(recs))))
            await s.execute(self._insert(Purge), [
                {"key_hash": kh, "scope": r.scope, "key": r.key, "purged_at": when}
                for kh, r in recs.items()])

    async def retire_artifact(self, rec: ArtifactRecord, when: datetime) -> None:
        """Remove this commit of its key for good (an upload deleted, a download an upload
        replaces), in one transaction: this replica's row while it is still that commit, the
        other replicas' rows of the same file (their copies, taken from the bucket), and a
        notice of that version for every serving process (proxy.artifacts.purges). A newer
        commit of the key, here or anywhere, is left alone: a different file is another
        version, and this replica's row tells its commits apart by fetched_at."""
        async with self._begin() as s:
            await s.execute(delete(Artifact).where(
                Artifact.key_hash == rec.key_hash, Artifact.replica == self.replica,
                Artifact.fetched_at == rec.fetched_at))
            await s.execute(delete(Artifact).where(
                Artifact.key_hash == rec.key_hash, Artifact.replica != self.replica,
                Artifact.sha256 == rec.sha256))
            await s.execute(self._insert(Purge), [{
                "key_hash": rec.key_hash, "scope": rec.scope, "key": rec.key, "purged_at": when,
                "sha256": rec.sha256, "fetched_at": rec.fetched_at, "replica": self.replica}])

    async def purge_notices(self, after: int) -> Sequence[PurgeNotice]:
        """Purge notices newer than the notice `after` (0: all of them), oldest first."""
        async with self._read() as s:
            rows = (await s.execute(
                select(Purge.id, Purge.key_hash, Purge.scope, Purge.key, Purge.sha256,
                       Purge.fetched_at, Purge.replica)
                .where(Purge.id > after).order_by(Purge.id))).all()
            return [PurgeNotice(r.id, r.key_hash, r.scope, r.key, r.sha256,
                                aware(r.fetched_at) if r.fetched_at else None, r.replica)
                    for r in rows]

    async def newest_purge_notice(self) -> int:
        """The id of the newest purge notice; 0 when there is none."""
        async with self._read() as s:
            return int((await s.execute(select(func.coalesce(func.max(Purge.id), 0)))).scalar_one())

    async def delete_purge_notices(self, before: datetime) -> None:
        """Delete the notices made before `before`, but the newest: on SQLite an id is one
        past the largest there, and with none left the next notice would take an id that
        running processes have seen already, and never apply it."""
        newest = select(func.max(Purge.id)).scalar_subquery()
        async with self._begin() as s:
            await s.execute(delete(Purge).where(Purge.purged_at < before, Purge.id < newest))

    async def record_access(self, batch: Mapping[str, tuple[int, datetime]]) -> None:
        """Apply hit counts and last-access times gathered since the last flush."""
        if not batch:
            return
        async with self._begin() as s:
            # In one order for every process: each batch in the order of its own hits, two
            # processes' flushes of the same rows waited on each other until PostgreSQL failed
            # one of them (deadlock detected).
            for key_hash, (hits, when) in sorted(batch.items()):
                await s.execute(
                    update(Artifact)
                    .where(Artifact.key_hash == key_hash, Artifact.replica == self.replica)
                    .values(hits=Artifact.hits + hits, last_access=when)
                )

    # -- negatives ---------------------------------------------------------------------------
    async def get_negatives(self, key_hash: str) -> Sequence[NegativeRecord]:
        return [NegativeRecord(r.upstream, r.outcome, r.misses, aware(r.expires_at))
                for r in await self._point(_NEGATIVES_READ, {"kh": key_hash})]

    async def put_negative(
        self, *, key_hash: str, scope: str, key: str, build_id: str, upstream: str,
        outcome: str, misses: int, first_seen: datetime, expires_at: datetime,
    ) -> None:
        values = {"key_hash": key_hash, "upstream": upstream, "scope": scope, "key": key,
                  "build_id": build_id, "outcome": outcome, "misses": misses,
                  "first_seen": first_seen, "expires_at": expires_at}
        # first_seen stays what it was: it tells how long a build ID has been missing.
        await self._upsert(Negative, values, ["key_hash", "upstream"],
                           update_only=["outcome", "misses", "expires_at"])

    async def negatives_of(self, build_id: str | None) -> Sequence[Negative]:
        query = select(Negative).order_by(Negative.expires_at.desc())
        if build_id is not None:
            query = query.where(Negative.build_id == build_id)
        async with self._read() as s:
            return list((await s.scalars(query)).all())

    async def delete_negatives(self, build_id: str | None) -> int:
        """Forget remembered misses (of one build ID, or all): the next request asks again."""
        stmt = delete(Negative)
        if build_id is not None:
            stmt = stmt.where(Negative.build_id == build_id)
        async with self._begin() as s:
            return int((await s.execute(stmt)).rowcount or 0)  # type: ignore[attr-defined]

    async def delete_negatives_of_key(self, key: str) -> int:
        """Forget every scope's remembered misses of one artifact key (an upload answers
        them all: the uploader's tenant, and everyone for a shared upload)."""
        async with self._begin() as s:
            return int((await s.execute(  # type: ignore[attr-defined]
                delete(Negative).where(Negative.key == key))).rowcount or 0)

    async def delete_expired_negatives(self, before: datetime, keep_misses_s: float) -> int:
        """Drop negatives expired for longer than keep_misses_s.

        A recently expired row is kept so the next miss can grow its TTL from the count.
        """
        cutoff = before.timestamp() - keep_misses_s
        async with self._begin() as s:
            result = await s.execute(
                delete(Negative).where(
                    Negative.expires_at < datetime.fromtimestamp(cutoff, UTC)
                )
            )
            return int(result.rowcount or 0)  # type: ignore[attr-defined]

    # -- symbol tables -----------------------------------------------------------------------
    async def get_symbol_table(self, scope: str, build_id: str) -> SymbolTableRecord | None:
        # A cold profile asks this of every one of its build IDs at once: through aiosqlite
        # 30 of them took 0.1-0.19 s, queued on its one thread.
        rows = await self._point(_SYMBOL_TABLE_READ, {"scope": scope, "bid": build_id})
        if not rows:
            return None
        row = rows[0]
        return SymbolTableRecord(
            row.scope, row.build_id, row.outcome, row.format, row.source_key, row.size,
            row.load_address, row.code_ranges, row.cold_ranges, row.has_lines,
            row.file_layout, row.error,
            aware(row.built_at), row.build_seconds,
            aware(row.expires_at) if row.expires_at else None,
        )

    async def put_symbol_table(self, rec: SymbolTableRecord) -> None:
        await self._upsert(SymbolTableRow, _columns(rec), ["scope", "build_id"])

    async def set_file_layout(self, scope: str, build_id: str, layout: str) -> None:
        async with self._begin_connection() as c:
            await c.execute(_SET_FILE_LAYOUT, {"in_scope": scope, "bid": build_id,
                                               "layout": layout})

    async def delete_symbol_tables(self, tables: Iterable[tuple[str, str]]) -> None:
        """Forget the tables of these (scope, build ID) pairs."""
        pairs = list(tables)
        if pairs:
            async with self._begin() as s:
                await s.execute(delete(SymbolTableRow).where(
                    tuple_(SymbolTableRow.scope, SymbolTableRow.build_id).in_(pairs)))

    async def symbol_tables_of(self, build_id: str | None, outcome: str
                               ) -> list[tuple[str, str]]:
        """(scope, build ID) of every table of this outcome (of one build ID, or all)."""
        query = select(SymbolTableRow.scope, SymbolTableRow.build_id).where(
            SymbolTableRow.outcome == outcome)
        if build_id is not None:
            query = query.where(SymbolTableRow.build_id == build_id)
        async with self._read() as s:
            return [(r.scope, r.build_id) for r in (await s.execute(query)).all()]

    async def delete_symbol_tables_but(self, outcome: str, build_id: str | None) -> int:
        """Forget the rows of another outcome than `outcome` (of one build ID, or all) in
        every scope; how many were forgotten."""
        condition = SymbolTableRow.outcome != outcome
        if build_id is not None:
            condition = condition & (SymbolTableRow.build_id == build_id)
        async with self._begin() as s:
            result = await s.execute(delete(SymbolTableRow).where(condition))
        return int(getattr(result, "rowcount", 0) or 0)

    # -- the shared bucket's catalogue -------------------------------------------------------
    async def bucket_objects(self, key_hashes: Sequence[str]) -> dict[str, BucketRecord]:
        """The rows of these keys' objects that are whole in the bucket, by key hash."""
        async with self._read() as s:
            rows = (await s.scalars(select(BucketObject).where(
                BucketObject.key_hash.in_(list(key_hashes))))).all()
            return {r.key_hash: _bucket_record(r) for r in rows}

    async def bucket_objects_of(self, build_id: str | None) -> Sequence[BucketRecord]:
        """Every object of one build ID in the bucket (or all of them)."""
        query = select(BucketObject)
        if build_id is not None:
            query = query.where(BucketObject.build_id == build_id)
        async with self._read() as s:
            return [_bucket_record(r) for r in (await s.scalars(query)).all()]

    async def put_bucket_object(self, rec: BucketRecord) -> None:
        await self._upsert(BucketObject, _columns(rec), ["key_hash"])

    async def touch_bucket_object(self, key_hash: str, when: datetime) -> None:
        async with self._begin() as s:
            await s.execute(update(BucketObject).where(BucketObject.key_hash == key_hash)
                            .values(last_access=when))

    async def delete_bucket_objects(self, key_hashes: Iterable[str]) -> None:
        hashes = list(key_hashes)
        if hashes:
            async with self._begin() as s:
                await s.execute(delete(BucketObject).where(BucketObject.key_hash.in_(hashes)))

    async def purged_since(self, key_hash: str, sha256: str, since: datetime) -> bool:
        """Whether a purge of the key, or a removal of this version of it (a notice with its
        sha256), was made at `since` or after."""
        async with self._read() as s:
            return bool((await s.execute(select(func.count()).select_from(Purge).where(
                Purge.key_hash == key_hash, Purge.purged_at >= since,
                or_(Purge.sha256.is_(None), Purge.sha256 == sha256)))).scalar_one())

    async def delete_bucket_versions(self, versions: Iterable[tuple[str, str]]) -> list[str]:
        """Delete the rows of these (key hash, sha256) pairs that are still that version; the
        key hashes of those deleted. A key's row may have been replaced since it was read (an
        upload over a download, a fetch published again): the newer version is not this
        caller's to drop."""
        pairs = list(versions)
        if not pairs:
            return []
        async with self._begin() as s:
            result = await s.execute(delete(BucketObject).where(
                tuple_(BucketObject.key_hash, BucketObject.sha256).in_(pairs)
            ).returning(BucketObject.key_hash))
            return list(result.scalars().all())

    async def bucket_totals(self) -> tuple[int, int]:
        """(objects, bytes) in the bucket that its eviction may take (uploads are pinned)."""
        async with self._read() as s:
            count, size = (await s.execute(select(
                func.count(), func.coalesce(func.sum(BucketObject.size), 0)
            ).where(BucketObject.pinned.is_(False)))).one()
            return int(count), int(size)

    async def oldest_bucket_objects(self, limit: int) -> Sequence[BucketRecord]:
        """Least recently read first; uploads (pinned) never."""
        async with self._read() as s:
            rows = (await s.scalars(select(BucketObject).where(BucketObject.pinned.is_(False))
                                    .order_by(BucketObject.last_access).limit(limit))).all()
            return [_bucket_record(r) for r in rows]

    async def unpublished_artifacts(self, limit: int, before: datetime
                                    ) -> Sequence[ArtifactRecord]:
        """This replica's files fetched before `before` that never were in the bucket (their
        upload failed, or came before the bucket did), most recently used first."""
        async with self._read() as s:
            rows = (await s.scalars(select(Artifact).where(
                Artifact.replica == self.replica, Artifact.fetched_at < before,
                Artifact.shared.is_(False),
            ).order_by(Artifact.last_access.desc()).limit(limit))).all()
            return [_record(r) for r in rows]

    async def unshare(self, key_hash: str, sha256: str) -> None:
        """This version of the key is no longer in the bucket: every replica's copy of it is
        written there again by its catch-up (the first to take the key's lease)."""
        async with self._begin() as s:
            await s.execute(update(Artifact).where(
                Artifact.key_hash == key_hash, Artifact.sha256 == sha256).values(shared=False))

    async def mark_shared(self, key_hash: str) -> None:
        """This replica's copy of the key is in the bucket now."""
        async with self._begin() as s:
            await s.execute(update(Artifact).where(
                Artifact.key_hash == key_hash, Artifact.replica == self.replica
            ).values(shared=True))

    # -- leases ------------------------------------------------------------------------------
    async def take_lease(self, name: str, holder: str, now: datetime, until: datetime) -> bool:
        """Hold `name` until `until`: if nobody holds it, its holder's time is up, or `holder`
        has it already. One statement, so two replicas never both get it."""
        insert = self._insert(Lease).values(name=name, holder=holder, expires_at=until)
        stmt = insert.on_conflict_do_update(
            index_elements=["name"],
            set_={"holder": insert.excluded.holder, "expires_at": insert.excluded.expires_at},
            where=or_(Lease.expires_at < now, Lease.holder == holder),
        ).returning(Lease.holder)
        async with self._begin() as s:
            return (await s.execute(stmt)).scalar_one_or_none() == holder

    async def renew_lease(self, name: str, holder: str, until: datetime) -> bool:
        """False when the lease is no longer `holder`'s (it expired and was taken)."""
        async with self._begin() as s:
            done = await s.execute(update(Lease).where(Lease.name == name,
                                                       Lease.holder == holder)
                                   .values(expires_at=until))
            return bool(done.rowcount)  # type: ignore[attr-defined]

    async def drop_lease(self, name: str, holder: str) -> None:
        async with self._begin() as s:
            await s.execute(delete(Lease).where(Lease.name == name, Lease.holder == holder))

    async def lease_of(self, name: str) -> tuple[str, datetime] | None:
        """(holder, until) of the lease, held or lapsed; None when nobody has taken it."""
        async with self._read() as s:
            row = (await s.execute(select(Lease.holder, Lease.expires_at)
                                   .where(Lease.name == name))).first()
            return (row.holder, aware(row.expires_at)) if row else None
