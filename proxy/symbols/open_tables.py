"""Symbol tables known to the server (their files and what their builds recorded), least
recently used dropped first. The files themselves are opened by the symbolize workers."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from symbolize.elf import LoadSegment
from symbolize.symtab import TableSpec


@dataclass(slots=True)
class OpenTable:
    table: TableSpec
    segments: tuple[LoadSegment, ...] | None  # None until an executable's layout is known
    # Whether the executable was looked for: a table without one is not searched again.
    layout_searched: bool = False
    # Program headers from a tenant's own executable, for that tenant's requests only.
    scoped_segments: dict[str, tuple[LoadSegment, ...]] = field(default_factory=dict)
    # A table from an executable: when (wall clock) its debug file is asked for again.
    recheck_at: float | None = None
    # Tenants with sources of their own that asked them for what this shared table lacks
    # (its debug file, supplementary file or executable), and had nothing better: it answers
    # them too, until it is asked about again. Others ask theirs first (SymbolResolver).
    judged_by: set[str] = field(default_factory=set)


class OpenTables:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._tables: OrderedDict[tuple[str, str], OpenTable] = OrderedDict()

    def get(self, scope: str, build_id: str) -> OpenTable | None:
        """A hit makes the table the most recently used."""
        opened = self._tables.get((scope, build_id))
        if opened is not None:
            self._tables.move_to_end((scope, build_id))
        return opened

    def put(self, scope: str, build_id: str, opened: OpenTable) -> None:
        self._tables[(scope, build_id)] = opened
        self._tables.move_to_end((scope, build_id))
        while len(self._tables) > self._capacity:
            self._tables.popitem(last=False)

    def drop(self, scope: str, build_id: str) -> None:
        self._tables.pop((scope, build_id), None)
