"""Symbol tables at rest: their SQL rows (what was built, from what, with which outcome, until
when) and their files, which the Store places. No other module reads or writes either."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Awaitable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from proxy.errors import DatabaseUnavailable
from proxy.expiry import Expiry
from proxy.store.disk import Store
from proxy.store.repository import (
    DATABASE_ERRORS,
    Repository,
    SymbolTableRecord,
    is_disk_full,
    is_unreachable,
    sql_failure,
)
from symbolize.elf import LoadSegment
from symbolize.outcome import Outcome
from symbolize.symtab import FORMAT, BuildResult

if TYPE_CHECKING:
    from proxy.bucket.tier import SharedTier

log = logging.getLogger(__name__)
T = TypeVar("T")
# What a query of the tables' rows may raise when the database is gone or not answering
# (is_unreachable tells which of them say so; the others, a wrong query's, are bugs to show).
_FAILURES = DATABASE_ERRORS


def layout_to_json(segments: Sequence[LoadSegment]) -> str:
    return json.dumps([[s.offset, s.vaddr, s.filesz, s.memsz, s.executable] for s in segments])


def layout_from_json(text: str) -> tuple[LoadSegment, ...]:
    return tuple(LoadSegment(int(o), int(v), int(f), int(m), bool(x))
                 for o, v, f, m, x in json.loads(text))


def ranges_from_json(text: str) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in json.loads(text))


class TableStore:
    def __init__(self, repo: Repository, store: Store, expiry: Expiry,
                 shared: SharedTier | None = None) -> None:
        """`shared`: the cluster's bucket, where tables built on any replica are kept, so
        that each is built once per cluster (rows are shared in SQL already)."""
        self._repo = repo
        self._store = store
        self._expiry = expiry
        self._shared = shared

    def clear_leftovers(self) -> int:
        """Blocking (walks the folder): half-written tables of dead build workers, removed."""
        return self._store.clear_symtab_temp()

    def clear_leftovers_of(self, scope: str, build_id: str) -> int:
        """Those of one table (one folder's glob), whoever wrote them: for the holder of its
        build lock alone, as its build ends."""
        return self._store.clear_table_temp(scope, build_id)

    def path(self, scope: str, build_id: str) -> Path:
        return self._store.symtab_path(scope, build_id)

    def lock_path(self, scope: str, build_id: str) -> Path:
        """Beside the table: held by the process that builds it (build_lock.py)."""
        table = self.path(scope, build_id)
        return table.with_name(table.name + ".lock")

    async def usable(self, scope: str, build_id: str) -> SymbolTableRecord | None:
        """The row of a built table in this format, or of an outcome still believed; None when
        a build is worth trying."""
        return (await self.find(scope, build_id))[0]

    async def find(self, scope: str, build_id: str) -> tuple[SymbolTableRecord | None, bool]:
        """usable(), and whether the table came from the shared bucket just now (built by
        another replica)."""
        rec = await _sql(self._repo.get_symbol_table(scope, build_id))
        if rec is None or rec.format != FORMAT:
            return None, False
        if rec.outcome == Outcome.OK:
            present, from_bucket = await self._bring(rec)
            return (rec if present else None), from_bucket
        if rec.expires_at is not None and self._expiry.believed(rec.outcome, rec.expires_at,
                                                                datetime.now(UTC)):
            return rec, False
        return None, False

    async def get(self, scope: str, build_id: str) -> SymbolTableRecord | None:
        return await _sql(self._repo.get_symbol_table(scope, build_id))

    async def here(self, scope: str, build_id: str) -> SymbolTableRecord | None:
        """The row, as get(); for a built table in this format whose file another replica
        made, only once its copy from the shared bucket is on this disk (None when it cannot
        be had: build it)."""
        rec = await self.get(scope, build_id)
        if (rec is not None and rec.outcome == Outcome.OK and rec.format == FORMAT
                and not (await self._bring(rec))[0]):
            return None
        return rec

    async def _bring(self, rec: SymbolTableRecord) -> tuple[bool, bool]:
        """Whether the built table's file is on this disk, copied from the shared bucket if
        need be; and whether it was copied just now."""
        path = self.path(rec.scope, rec.build_id)
        if path.exists():
            return True, False
        if self._shared is not None and await self._shared.table(rec.scope, rec.build_id, path):
            return True, True
        return False, False

    async def record(self, scope: str, build_id: str, outcome: Outcome, source_key: str,
                     result: BuildResult | None, error: str | None) -> SymbolTableRecord:
        """Write a build's outcome, believed for as long as the expiry policy says; a table
        built from an executable until the debug file is worth asking for again (stale()),
        and one without its supplementary file or its executable until that one is."""
        now = datetime.now(UTC)
        keep = self._expiry.seconds(
            Outcome.NOT_FOUND if outcome == Outcome.OK and rechecked(source_key) else outcome)
        rec = SymbolTableRecord(
            scope=scope, build_id=build_id, outcome=outcome, format=FORMAT,
            source_key=source_key, size=result.size if result else 0,
            load_address=result.load_address if result else 0,
            code_ranges=json.dumps(result.code_ranges if result else []),
            cold_ranges=json.dumps(result.cold_ranges if result else []),
            has_lines=result.has_lines if result else False,
            file_layout=(layout_to_json(result.file_layout)
                         if result is not None and result.file_layout is not None else None),
            error=error, built_at=now, build_seconds=result.seconds if result else 0.0,
            expires_at=now + timedelta(seconds=keep) if keep is not None else None,
        )
        await _sql(self._repo.put_symbol_table(rec))
        if outcome == Outcome.OK and self._shared is not None:
            self._shared.publish_table(scope, build_id, self.path(scope, build_id))
        return rec

    def stale(self, rec: SymbolTableRecord) -> bool:
        """A table from an executable whose debug file is worth asking for again (or from a
        debug file whose supplementary file or executable is): one may have been published,
        or the upstream that failed may answer now. Its table still serves until a better one
        is built. Asked again as a miss is (Expiry.believed): a clock stepped back must not
        put it off."""
        return (rec.outcome == Outcome.OK and rec.expires_at is not None
                and not self._expiry.believed(Outcome.NOT_FOUND, rec.expires_at,
                                              datetime.now(UTC)))

    async def renew(self, rec: SymbolTableRecord) -> SymbolTableRecord:
        """A stale table, believed again: what it lacks (its debug file, supplementary file or
        executable) is still not had."""
        keep = self._expiry.seconds(Outcome.NOT_FOUND)
        assert keep is not None
        renewed = dataclasses.replace(rec, expires_at=datetime.now(UTC) + timedelta(seconds=keep))
        await _sql(self._repo.put_symbol_table(renewed))
        return renewed

    async def set_layout(self, scope: str, build_id: str,
                         segments: Sequence[LoadSegment]) -> None:
        """Recorded where it can be: the caller has the program headers in memory, and
        without the row they are searched again after a restart."""
        try:
            await self._repo.set_file_layout(scope, build_id, layout_to_json(segments))
        except _FAILURES as e:  # SQLite's full disk too: an OperationalError
            if not is_unreachable(e):
                raise
            log.warning("program headers of %s not recorded (%s): searched again after a "
                        "restart", build_id, sql_failure(e))

    def remove_file(self, scope: str, build_id: str) -> None:
        """The table's file alone: built, but its row could not be written (a full disk)."""
        self._store.remove_symtab(scope, build_id)

    async def drop(self, scope: str, build_id: str) -> None:
        """Its source left this replica's disk. With a shared bucket the table stays the
        cluster's (its row, its object): only this replica's copy goes."""
        self._store.remove_symtab(scope, build_id)
        if self._shared is None:
            await _sql(self._repo.delete_symbol_tables([(scope, build_id)]))


async def _sql(call: Awaitable[T]) -> T:
    """`call`, a query of the tables' rows; a database that does not answer raises
    DatabaseUnavailable (503 with Retry-After: a profile is refused, never answered with its
    mappings bare, which a backend keeps for good). A full disk stays what it is, for the
    caller to make room (SymbolResolver._with_room)."""
    try:
        return await call
    except _FAILURES as e:
        if is_disk_full(e) or not is_unreachable(e):
            raise
        raise DatabaseUnavailable(f"the database does not answer ({sql_failure(e)}); "
                                  "try again") from e


# The source key of a table built from an executable of the local debug directories.
_LOCAL_EXECUTABLE = "local-executable:"


# Marks the source key of a debug file's table built without the supplementary file that dwz
# gave it (symbolize/supplementary.py): named by its symbols alone, as a table from an
# executable is, and asked about again as that one is.
WITHOUT_SUPPLEMENT = "#without-supplement"


# Marks the source key of a debug file's table built without its executable (not had, or not
# asked for): the executable's .dynsym may name exported functions otherwise
# (symbolize/function_names.py) and its program headers translate exactly, so the table is
# asked about again as a partial one is, and built again once the executable is had. Before
# WITHOUT_SUPPLEMENT, which _with_supplement appends later.
WITHOUT_EXECUTABLE = "#without-executable"


def without_executable(source_key: str) -> bool:
    return WITHOUT_EXECUTABLE in source_key


def built_from(source_key: str) -> str:
    """The key of the file a table was built from, without the marks of what it lacked."""
    return source_key.removesuffix(WITHOUT_SUPPLEMENT).removesuffix(WITHOUT_EXECUTABLE)


def rechecked(source_key: str) -> bool:
    """Whether a table is asked about again after the miss TTL: a later build may have more
    (lines, or the executable's names)."""
    return partial(source_key) or without_executable(source_key)


def partial(source_key: str) -> bool:
    """Whether a table lacks the lines that a later build may have: one from an executable,
    or one from a debug file without its supplementary file."""
    return from_executable(source_key) or source_key.endswith(WITHOUT_SUPPLEMENT)


def from_executable(source_key: str) -> bool:
    """Whether a table was built from an executable (its bare symbols, no lines)."""
    return source_key.endswith("/executable") or source_key.startswith(_LOCAL_EXECUTABLE)


def local_source_key(path: Path, *, executable: bool) -> str:
    return f"{_LOCAL_EXECUTABLE if executable else 'local:'}{path}"
