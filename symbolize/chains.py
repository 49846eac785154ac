"""What a symbolized address becomes in a pprof profile: its Line entries.

A symbol table names the chain of frames of each address by a key (an int: which source
location, see symtab.py) and remembers, per key, a numbered chain: the function ids and lines
of its frames (innermost first). A rewrite then looks up numbers and encodes the
`Location.line` entries of the chains it used, in bulk with numpy, instead of building protobuf
messages.

The entries kept name functions by ids of the process: `FunctionIds` gives every (name,
system name, file, start line) one, from FIRST_ID up, for all tables alike, so a function two
binaries share (an inline function from a header) has one id. They never reach a profile: a
rewrite numbers the functions it used as that profile's own (rewrite._Functions) and encodes
the chains it used again with those numbers (`Chains.encoded`), so that what a profile gets
does not depend on what the process symbolized before.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

# numpy.ma: np.unique imports it on its first call (about 12 ms); at start-up, then, not
# inside the first profile a server symbolizes.
import numpy as np
import numpy.ma
import numpy.typing as npt

from .distinct import distinct_below
from .pprof import varint

# The first id of the process's numbering (never written to a profile).
FIRST_ID = 1 << 20
# Functions remembered before the ids start over: about 200 bytes each, 50 MiB in all.
_MAX_FUNCTIONS = 1 << 18
# Chains a table remembers before it starts over: about 100 bytes each. Continuous profilers
# send the same hot addresses in every profile, so a table rarely gets near it.
_MAX_CHAINS = 1_000_000

_LOCATION_LINE = 0x22  # field 4, length-delimited

FunctionKey = tuple[str, str, str, int]  # name, system_name, filename, start_line
I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]
ObjectArray = npt.NDArray[np.object_]


class FunctionIds:
    """Stable function ids, shared by every table and every rewrite in the process.

    When there are too many, the ids start over, and so does every table's memory of encoded
    chains (which `generation` tells stale); never while a rewrite is using them.
    """

    def __init__(self, limit: int = _MAX_FUNCTIONS) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._users = 0
        self.generation = 0
        self._clear()

    def _clear(self) -> None:
        self._ids: dict[FunctionKey, int] = {}
        self._keys: list[FunctionKey] = []
        # Every function's name, system name and file as numbers of `texts`, and its start
        # line, four a function: a rewrite reads its functions' rows in bulk.
        self._text_ids: dict[str, int] = {}
        self.texts: list[str] = []
        self._rows = _Growing(np.int64)

    def ids_of(self, keys: Sequence[FunctionKey]) -> U64:
        """The id of each key, new ones numbered in order: one lock and one append for a
        table's new functions (a cold profile's thousands cost 4.5 us each one at a time)."""
        ids = self._ids
        found = [ids.get(k, 0) for k in keys]
        if 0 not in found:
            return np.array(found, dtype=np.uint64)
        with self._lock:  # two threads resolving the same new function get one id
            rows: list[int] = []
            # Published once their rows are in: a reader without the lock (above) must never
            # see an id whose row is not there yet.
            fresh: dict[FunctionKey, int] = {}
            for i, key in enumerate(keys):
                fid = ids.get(key) or fresh.get(key)
                if fid is None:
                    fid = fresh[key] = FIRST_ID + len(self._keys)
                    self._keys.append(key)
                    for text in key[:3]:
                        at = self._text_ids.get(text)
                        if at is None:
                            at = self._text_ids[text] = len(self.texts)
                            self.texts.append(text)
                        rows.append(at)
                    rows.append(key[3])
                found[i] = fid
            if rows:
                self._rows.extend(np.array(rows, dtype=np.int64))
            ids.update(fresh)
        return np.array(found, dtype=np.uint64)

    def key_of(self, fid: int) -> FunctionKey:
        return self._keys[fid - FIRST_ID]

    def rows(self, fids: U64) -> I64:
        """Per id: its name, system name and file (numbers of `texts`) and start line."""
        at = (fids - np.uint64(FIRST_ID)).astype(np.int64)
        rows: I64 = self._rows.data[: self._rows.size].reshape(-1, 4)[at]
        return rows

    def __len__(self) -> int:
        return len(self._keys)

    @contextmanager
    def session(self) -> Iterator[None]:
        """Ids stay valid inside; the reset of a full registry happens between sessions."""
        with self._lock:
            if self._users == 0 and len(self._keys) >= self._limit:
                self._clear()
                self.generation += 1
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1


@dataclass(frozen=True, slots=True)
class FrameColumns:
    """The frames of several chains, as a symbol table resolves them, in columns.

    Frames are in order of their chain (`owner`, 0 to chains - 1), innermost first within it.
    """

    chains: int
    owner: I64
    function: I64  # index into `functions`
    line: U64  # 0: unknown
    column: U64  # 0: unknown
    functions: Sequence[FunctionKey]


def encode_lines(owner: I64, function_ids: U64, lines: U64, columns: U64,
                 chains: int) -> list[bytes]:
    """Per chain, its Line entries as they follow a Location's other fields in its encoding.

    Byte for byte what protobuf writes for
    `Location(line=[Line(function_id=f, line=n, column=c)])`: each Line is field 4 of the
    Location, holding its fields 1, 2 and 3.
    """
    out, end = varint.messages(_LOCATION_LINE, [(1, function_ids), (2, lines), (3, columns)])
    bounds = np.concatenate(([0], end))[np.searchsorted(owner, np.arange(chains + 1))].tolist()
    blob = out.tobytes()
    return [blob[a:b] for a, b in itertools.pairwise(bounds)]


class _Growing:
    """A numpy array appended to, doubling its capacity as it fills."""

    def __init__(self, dtype: type[np.generic]) -> None:
        self.data: npt.NDArray[Any] = np.zeros(1024, dtype=dtype)
        self.size = 0

    def extend(self, values: npt.NDArray[Any]) -> None:
        count = len(values)
        if self.size + count > len(self.data):
            grown = np.zeros(max(2 * len(self.data), self.size + count), dtype=self.data.dtype)
            grown[: self.size] = self.data[: self.size]
            self.data = grown  # an earlier snapshot keeps the old array, still valid
        self.data[self.size: self.size + count] = values
        self.size += count


@dataclass(frozen=True, slots=True)
class _Columns:
    """Per chain number: where its function ids and lines are, its flags."""

    first_id: I64
    id_count: I64
    function_ids: U64
    lines: U64
    columns: U64
    has_filenames: npt.NDArray[np.bool_]
    has_line_numbers: npt.NDArray[np.bool_]


class ChainStore:
    """The chains of one symbol table: numbered from 1 (0 is no symbol), per key.

    Keys run from 0 (no symbol) to `keys` - 1; the table that owns the store hands them out.
    """

    def __init__(self, ids: FunctionIds, keys: int, limit: int = _MAX_CHAINS) -> None:
        self._ids = ids
        self._keys = keys
        self._limit = limit
        self._lock = threading.Lock()
        self._start_over()

    def _start_over(self) -> None:
        self._generation = self._ids.generation
        # Zeroed pages cost no memory until touched: a key's number is found by indexing.
        self._numbers = np.zeros(self._keys, dtype=np.int32)
        # Chains by their encoding with the process's ids: chains encoded alike are one.
        self._by_encoding: dict[bytes, int] = {b"": 0}
        self._first_id = _Growing(np.int64)
        self._id_count = _Growing(np.int64)
        self._function_ids = _Growing(np.uint64)
        self._lines = _Growing(np.uint64)
        self._columns = _Growing(np.uint64)
        self._has_filenames = _Growing(np.bool_)
        self._has_line_numbers = _Growing(np.bool_)
        self._append(np.zeros(1, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.uint64),
                     np.zeros(0, np.uint64), np.zeros(1, np.bool_), np.zeros(1, np.bool_))

    def chains(self, keys: I64, resolve: Callable[[I64], FrameColumns]) -> Chains:
        """The chain of each key; `resolve` gives the frames of keys not seen before."""
        with self._lock:
            if self._generation != self._ids.generation:
                self._start_over()
            numbers = self._numbers[keys].astype(np.int64)
            missing = (numbers == 0) & (keys != 0)
            if missing.any():
                fresh = distinct_below(keys[missing], self._keys)
                # Judged by the chains to add, not by the addresses: a profile of a million
                # addresses whose chains are all known must not throw them away.
                if self._id_count.size + len(fresh) > self._limit:
                    self._start_over()
                    fresh = distinct_below(keys[keys != 0], self._keys)
                self._numbers[fresh] = self._number(resolve(fresh))
                numbers = self._numbers[keys].astype(np.int64)
            return Chains(numbers, self._snapshot(), self._ids)

    def _number(self, frames: FrameColumns) -> I64:
        """Number the chains of `frames`: chains encoded alike share a number."""
        ids = self._ids.ids_of(frames.functions)
        function_ids = ids[frames.function] if len(ids) else np.zeros(0, np.uint64)
        encoded = encode_lines(frames.owner, function_ids, frames.line, frames.column,
                               frames.chains)
        known = self._by_encoding
        numbers = np.fromiter(map(known.get, encoded, itertools.repeat(-1)), dtype=np.int64,
                              count=len(encoded))
        unknown = np.flatnonzero(numbers < 0)
        # The chains encoded unlike any known, numbered in the order of their first chain:
        # dict and map do the per-chain work in C (a loop over them in Python was half of a
        # cold rewrite of a million addresses).
        at = unknown.tolist()
        unknown_encoded = list(map(encoded.__getitem__, at))
        firsts = dict(zip(reversed(unknown_encoded), reversed(at), strict=True))
        new = np.array(sorted(firsts.values()), dtype=np.int64)
        fresh = dict(zip(map(encoded.__getitem__, new.tolist()),
                         range(self._id_count.size, self._id_count.size + len(new)),
                         strict=True))
        numbers[unknown] = np.fromiter(map(fresh.__getitem__, unknown_encoded),
                                       dtype=np.int64, count=len(unknown))
        known.update(fresh)
        if len(new):
            is_new = np.zeros(frames.chains, dtype=np.bool_)
            is_new[new] = True
            chosen = is_new[frames.owner]
            with_file = np.array([bool(k[2]) for k in frames.functions], dtype=np.bool_)
            owner = frames.owner[chosen]
            counts = np.bincount(owner, minlength=frames.chains)[new]
            files = np.bincount(owner, weights=with_file[frames.function[chosen]],
                                minlength=frames.chains)[new] > 0
            lines = np.bincount(owner, weights=frames.line[chosen] > 0,
                                minlength=frames.chains)[new] > 0
            self._append(counts, function_ids[chosen], frames.line[chosen],
                         frames.column[chosen], files, lines)
        return numbers

    def _append(self, id_count: I64, function_ids: U64, lines: U64, columns: U64,
                has_filenames: npt.NDArray[np.bool_],
                has_line_numbers: npt.NDArray[np.bool_]) -> None:
        self._first_id.extend(self._function_ids.size + np.cumsum(id_count) - id_count)
        self._id_count.extend(id_count)
        self._function_ids.extend(function_ids)
        self._lines.extend(lines)
        self._columns.extend(columns)
        self._has_filenames.extend(has_filenames)
        self._has_line_numbers.extend(has_line_numbers)

    def _snapshot(self) -> _Columns:
        # Arrays only grow, and a grown one is a new array: these stay true for the numbers
        # handed out so far, whatever later lookups add.
        return _Columns(self._first_id.data, self._id_count.data, self._function_ids.data,
                        self._lines.data, self._columns.data, self._has_filenames.data,
                        self._has_line_numbers.data)


class Chains:
    """The chains of a profile's addresses in one mapping."""

    def __init__(self, numbers: I64, columns: _Columns, ids: FunctionIds) -> None:
        self.numbers = numbers
        self._c = columns
        self._ids = ids

    @cached_property
    def _used(self) -> I64:
        """The chain numbers used, sorted, without 0."""
        distinct = distinct_below(self.numbers, len(self._c.id_count))
        used: I64 = distinct[distinct != 0]
        return used

    @cached_property
    def unresolved(self) -> int:
        return int(np.count_nonzero(self.numbers == 0))

    @property
    def symbolized(self) -> int:
        return len(self.numbers) - self.unresolved

    @property
    def has_filenames(self) -> bool:
        return bool(self._c.has_filenames[self._used].any())

    @property
    def has_line_numbers(self) -> bool:
        return bool(self._c.has_line_numbers[self._used].any())

    @property
    def has_inline_frames(self) -> bool:
        return bool((self._c.id_count[self._used] > 1).any())

    def flags(self, numbers: I64) -> tuple[bool, bool, bool]:
        """has_filenames, has_line_numbers and has_inline_frames of some of the chains (by
        their numbers, none 0): those of one mapping when a lookup served several."""
        if len(numbers) > len(self._c.id_count):  # each chain once: gathers of 3 x a million
            numbers = distinct_below(numbers, len(self._c.id_count))
        return (bool(self._c.has_filenames[numbers].any()),
                bool(self._c.has_line_numbers[numbers].any()),
                bool((self._c.id_count[numbers] > 1).any()))

    def _frames_of(self, chains: I64) -> tuple[I64, I64]:
        """Where the function ids and lines of `chains` are, and the chain (0 to len - 1) each
        is of."""
        counts = self._c.id_count[chains]
        before = np.cumsum(counts) - counts
        at = np.repeat(self._c.first_id[chains] - before, counts) + np.arange(counts.sum())
        owners: I64 = np.repeat(np.arange(len(chains)), counts)
        return at, owners

    def function_ids(self) -> U64:
        """The function ids the chains use, sorted."""
        at, _owners = self._frames_of(self._used)
        ids = self._c.function_ids[at]
        # Ids are dense from FIRST_ID.
        offsets = distinct_below((ids - np.uint64(FIRST_ID)).astype(np.int64),
                                 len(self._ids) + 1)
        used: U64 = offsets.astype(np.uint64) + np.uint64(FIRST_ID)
        return used

    def used_frames(self, renumbered: U64) -> UsedFrames:
        """The frames of the chains used, to be encoded (encode_spans), each function id
        written as `renumbered[id - FIRST_ID]`.

        Every chain used is encoded again: a profile's ids are its own (rewrite._Functions),
        so the encodings kept with the chains hardly ever fit as they are."""
        used = self._used
        at, _owners = self._frames_of(used)
        ids = renumbered[(self._c.function_ids[at] - np.uint64(FIRST_ID)).astype(np.int64)]
        place = np.zeros(len(self._c.id_count), dtype=np.int32)
        place[used] = np.arange(1, len(used) + 1, dtype=np.int32)
        return UsedFrames(ids, self._c.lines[at], self._c.columns[at], self._c.id_count[used],
                          place[self.numbers])


@dataclass(frozen=True, slots=True)
class UsedFrames:
    """The frames of one table's chains used by a profile (Chains.used_frames)."""

    function_ids: U64
    lines: U64
    columns: U64
    counts: I64  # frames of each chain used, in order
    place: npt.NDArray[np.int32]  # per address: 0 for no chain, else 1 + its chain's rank


def encode_spans(tables: list[UsedFrames]
                 ) -> tuple[npt.NDArray[np.uint8], list[tuple[I64, npt.NDArray[np.int32]]]]:
    """The Line entries of every table's chains, one table after another, and per table and
    address where its entries are in those bytes (start, length; 0 for none).

    All tables in one encoding: a profile of many small programs made one per table, whose
    fixed cost (some twenty array operations) was a third of the rewrite of 60 programs'.
    The work is per chain, the per-address part a gather."""
    def joined(column: list[U64]) -> U64:
        return column[0] if len(column) == 1 else np.concatenate(column)

    blob, end = varint.messages(_LOCATION_LINE, [
        (1, joined([t.function_ids for t in tables])),
        (2, joined([t.lines for t in tables])),
        (3, joined([t.columns for t in tables]))])
    spans = []
    frames = 0
    ends = np.concatenate(([0], end))
    for t in tables:
        # Where each chain's frames start and end among all the frames, and so its bytes.
        first_frame = frames + np.concatenate(([0], np.cumsum(t.counts)))
        frames = int(first_frame[-1])
        bounds = ends[first_frame]
        # Per place (0: no chain, then the used ones in order), where its encoding is.
        starts = np.concatenate(([0], bounds[:-1]))
        lengths = np.concatenate(([0], np.diff(bounds))).astype(np.int32)
        spans.append((starts[t.place], lengths[t.place]))
    return blob, spans
