"""Point reads of a SQLite file on the calling thread, for the lookups before a cold fetch.

Through aiosqlite, a one-row SELECT costs ~1.3 ms: a session, and a trip to the connection's
thread and back for each step. Done in the caller's thread it costs far less, and a cold fetch
does two of them before it may ask upstream, a cold profile one per build ID. Even so, a read
through a SQLAlchemy Connection (a pool checkout, its reset, the result's machinery) cost 42 us
in a loop and 0.4-0.6 ms in a server's cold fetch, where its code is not in the CPU's caches;
through the sqlite3 driver it costs 3 us. So each statement is compiled once by SQLAlchemy
(`PointRead`), and its rows are read with sqlite3 and turned into what SQLAlchemy would give
by the statement's own column types: the schema and the conversions stay SQLAlchemy's.

In WAL mode a reader does not wait for writers; what could make it wait (a recovery, a
checkpoint resetting the log) answers SQLITE_BUSY at once here (busy_timeout 0), and the
caller then asks through the async engine, which waits in its own thread. Each read is a
transaction of its own (autocommit), so no snapshot is held between reads. Only reads go
this way; writes stay async.
"""

from __future__ import annotations

import collections
import sqlite3
import threading
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Select
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncEngine

_DIALECT = sqlite.dialect()  # pysqlite's: the sqlite3 driver that reads here


class PointRead:
    """A SELECT compiled once for SQLite: its SQL, the order of its parameters, and how each
    of its columns becomes what SQLAlchemy's result would hold (a datetime from its text, a
    bool from its integer)."""

    def __init__(self, statement: Select[*tuple[Any, ...]]) -> None:
        self.statement = statement
        compiled = statement.compile(dialect=_DIALECT)
        self.sql = str(compiled)
        names = [str(name) for name in compiled.positiontup or ()]
        # The dialect's own type of each (SQLite's DATETIME, which stores text), whose
        # processors are the ones SQLAlchemy's results apply.
        self._binds: list[tuple[str, Callable[[Any], Any] | None]] = [
            (name, compiled.binds[name].type.dialect_impl(_DIALECT).bind_processor(_DIALECT))
            for name in names]
        columns = list(statement.selected_columns)
        self._convert: list[Callable[[Any], Any] | None] = [
            c.type.dialect_impl(_DIALECT).result_processor(_DIALECT, None) for c in columns]
        # Rows read by attribute, as SQLAlchemy's are.
        self._row = collections.namedtuple(  # type: ignore[misc]
            "Row", [str(c.key) for c in columns], rename=True)

    def arguments(self, params: Mapping[str, Any]) -> tuple[Any, ...]:
        return tuple(params[name] if bind is None else bind(params[name])
                     for name, bind in self._binds)

    def row(self, values: Sequence[Any]) -> Any:
        return self._row(*(v if convert is None or v is None else convert(v)
                           for v, convert in zip(values, self._convert, strict=True)))


class LocalReads:
    def __init__(self, url: URL) -> None:
        # mode=rw: a database file that is gone stays gone, rather than made anew and empty.
        self._uri = f"file:{urllib.parse.quote(str(url.database))}?mode=rw"
        # One connection per thread, used and closed by that thread alone (a connection
        # closed by another thread in the middle of a read crashes the process), and freed
        # with the thread's locals when the thread ends.
        self._here = threading.local()
        self._closed = False

    @classmethod
    def of(cls, engine: AsyncEngine) -> LocalReads | None:
        """For a SQLite file; None for PostgreSQL (already quick) or an in-memory SQLite."""
        url = engine.url
        if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
            return None
        return cls(url)

    def _connection(self) -> sqlite3.Connection:
        connection: sqlite3.Connection | None = getattr(self._here, "connection", None)
        if connection is None:
            # check_same_thread off: the thread's locals may be freed, and the connection
            # with them, from another thread; no two threads ever use it at once.
            connection = sqlite3.connect(self._uri, uri=True, isolation_level=None,
                                         check_same_thread=False)
            try:
                connection.execute("PRAGMA busy_timeout=0")
                connection.execute("PRAGMA query_only=1")
            except sqlite3.Error:
                connection.close()
                raise
            self._here.connection = connection
        return connection

    def rows(self, read: PointRead, params: Mapping[str, Any]) -> list[Any] | None:
        """The rows of `read`, or None when the read could not be done here (busy, the file
        gone or broken): then the caller asks the usual way, which waits or reports the
        fault."""
        if self._closed:
            return None
        try:
            found = self._connection().execute(read.sql, read.arguments(params)).fetchall()
        except (sqlite3.Error, OSError):
            return None
        return [read.row(values) for values in found]

    def close(self) -> None:
        """No more reads here (they go to the engine). The calling thread's connection is
        closed now; any other thread's goes with that thread's locals, or with this object:
        never from under a read."""
        self._closed = True
        connection = getattr(self._here, "connection", None)
        if connection is not None:
            del self._here.connection
            connection.close()
