"""What a symbolized address becomes in a pprof profile: its Line entries, encoded once.

A symbol table remembers, per address, a numbered chain: the encoded `Location.line` entries of
its frames (innermost first). A warm rewrite then looks up numbers and copies bytes, in bulk
with numpy, instead of building protobuf messages.

The entries name functions by ids that stay the same across profiles: `FunctionIds` gives
every (name, system name, file) one, from FIRST_ID up, for all tables alike, so a function two
binaries share (an inline function from a header) has one id. A rewrite adds a Function to the
profile for each id it used, or maps the id to the profile's own where the profile already has
that function or that id.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .pprof.profile_pb2 import Line, Location

if TYPE_CHECKING:
    from .symtab import Frame

# Above the ids of any profile's own functions (they count from 1), and a three-byte varint up
# to 2**21: the ids cost a byte more per line than small ones would.
FIRST_ID = 1 << 20
# Functions remembered before the ids start over: about 200 bytes each, 50 MiB in all.
_MAX_FUNCTIONS = 1 << 18
# Addresses a table remembers: continuous profilers send the same hot addresses in every
# profile. About 100 bytes an address, and as much again for each distinct chain.
_MAX_ADDRESSES = 500_000

FunctionKey = tuple[str, str, str]  # name, system_name, filename
I64 = npt.NDArray[np.int64]
ObjectArray = npt.NDArray[np.object_]


class FunctionIds:
    """Stable function ids, shared by every table and every rewrite in the process.

    When there are too many, the ids start over, and so does every table's memory of encoded
    chains (which `generation` tells stale); never while a rewrite is using them.
    """

    def __init__(self, limit: int = _MAX_FUNCTIONS) -> None:
        self._limit = limit
        self._ids: dict[FunctionKey, int] = {}
        self._keys: list[FunctionKey] = []
        self._lock = threading.Lock()
        self._users = 0
        self.generation = 0

    def id_of(self, key: FunctionKey) -> int:
        fid = self._ids.get(key)
        if fid is None:
            with self._lock:  # two threads resolving the same new function get one id
                fid = self._ids.get(key)
                if fid is None:
                    fid = self._ids[key] = FIRST_ID + len(self._keys)
                    self._keys.append(key)
        return fid

    def key_of(self, fid: int) -> FunctionKey:
        return self._keys[fid - FIRST_ID]

    @contextmanager
    def session(self) -> Iterator[None]:
        """Ids stay valid inside; the reset of a full registry happens between sessions."""
        with self._lock:
            if self._users == 0 and len(self._keys) >= self._limit:
                self._ids.clear()
                self._keys.clear()
                self.generation += 1
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1


def encode_lines(function_ids: Sequence[int], lines: Sequence[int]) -> bytes:
    """Line entries as they follow a Location's other fields in its encoding."""
    return Location(line=[Line(function_id=f, line=n)
                          for f, n in zip(function_ids, lines, strict=True)]).SerializeToString()


class _Growing:
    """A numpy array appended to one element at a time, doubling its capacity as it fills."""

    def __init__(self, dtype: type[np.generic]) -> None:
        self.data: npt.NDArray[Any] = np.zeros(1024, dtype=dtype)
        self.size = 0

    def append(self, value: Any) -> None:
        if self.size == len(self.data):
            grown = np.zeros(2 * len(self.data), dtype=self.data.dtype)
            grown[: self.size] = self.data
            self.data = grown  # an earlier snapshot keeps the old array, still valid
        self.data[self.size] = value
        self.size += 1


@dataclass(frozen=True, slots=True)
class _Columns:
    """Per chain number: its encoding, where its function ids are, its flags."""

    encoded: ObjectArray
    first_id: I64
    id_count: I64
    function_ids: npt.NDArray[np.uint64]
    has_filenames: npt.NDArray[np.bool_]
    has_line_numbers: npt.NDArray[np.bool_]
    lines: list[tuple[int, ...]]


class ChainStore:
    """The chains of one symbol table: numbered from 1 (0 is no symbol), per address."""

    def __init__(self, ids: FunctionIds, limit: int = _MAX_ADDRESSES) -> None:
        self._ids = ids
        self._limit = limit
        self._lock = threading.Lock()
        self._start_over()

    def _start_over(self) -> None:
        self._generation = self._ids.generation
        self._numbers: dict[int, int] = {}  # address -> chain number
        self._by_encoding: dict[bytes, int] = {b"": 0}
        self._encoded = _Growing(np.object_)
        self._first_id = _Growing(np.int64)
        self._id_count = _Growing(np.int64)
        self._function_ids = _Growing(np.uint64)
        self._has_filenames = _Growing(np.bool_)
        self._has_line_numbers = _Growing(np.bool_)
        self._lines: list[tuple[int, ...]] = []
        self._add(b"", (), (), False, False)

    def chains(self, vaddrs: list[int], frames_of: Callable[[int], Sequence[Frame]]) -> Chains:
        """The chain of each address; `frames_of` resolves an address not seen before."""
        with self._lock:
            if (self._generation != self._ids.generation
                    or len(self._numbers) + len(vaddrs) > self._limit):
                self._start_over()
            numbers = np.fromiter(map(self._numbers.get, vaddrs, itertools.repeat(-1)),
                                  dtype=np.int64, count=len(vaddrs))
            for i in np.flatnonzero(numbers < 0).tolist():
                vaddr = vaddrs[i]
                number = self._numbers.get(vaddr)
                if number is None:
                    number = self._numbers[vaddr] = self._number_of(frames_of(vaddr))
                numbers[i] = number
            return Chains(numbers, self._snapshot(), self._ids)

    def _number_of(self, frames: Sequence[Frame]) -> int:
        function_ids = tuple(self._ids.id_of((f.name, f.system_name, f.filename))
                             for f in frames)
        lines = tuple(f.line for f in frames)
        encoded = encode_lines(function_ids, lines)
        number = self._by_encoding.get(encoded)
        if number is None:
            number = self._by_encoding[encoded] = self._add(
                encoded, function_ids, lines, any(f.filename for f in frames),
                any(f.line for f in frames))
        return number

    def _add(self, encoded: bytes, function_ids: tuple[int, ...], lines: tuple[int, ...],
             has_filenames: bool, has_line_numbers: bool) -> int:
        number = self._encoded.size
        self._encoded.append(encoded)
        self._first_id.append(self._function_ids.size)
        self._id_count.append(len(function_ids))
        for fid in function_ids:
            self._function_ids.append(fid)
        self._has_filenames.append(has_filenames)
        self._has_line_numbers.append(has_line_numbers)
        self._lines.append(lines)
        return number

    def _snapshot(self) -> _Columns:
        # Arrays only grow, and a grown one is a new array: these stay true for the numbers
        # handed out so far, whatever later lookups add.
        return _Columns(self._encoded.data, self._first_id.data, self._id_count.data,
                        self._function_ids.data, self._has_filenames.data,
                        self._has_line_numbers.data, self._lines)


class Chains:
    """The chains of a profile's addresses in one mapping."""

    def __init__(self, numbers: I64, columns: _Columns, ids: FunctionIds) -> None:
        self.numbers = numbers
        self._c = columns
        self._ids = ids

    @cached_property
    def _used(self) -> I64:
        used: I64 = np.unique(self.numbers)
        nonzero: I64 = used[used != 0]
        return nonzero

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

    def _ids_of(self, chains: I64) -> tuple[npt.NDArray[np.uint64], I64]:
        """The function ids of `chains`, and the chain each is of."""
        counts = self._c.id_count[chains]
        before = np.cumsum(counts) - counts
        at = np.repeat(self._c.first_id[chains] - before, counts) + np.arange(counts.sum())
        owners: I64 = np.repeat(chains, counts)
        return self._c.function_ids[at], owners

    def function_ids(self) -> set[int]:
        return set(np.unique(self._ids_of(self._used)[0]).tolist())

    def encoded(self, remap: dict[int, int]) -> ObjectArray:
        """Per address, its Line entries (b"" for none), with function ids as `remap` says."""
        out: ObjectArray = self._c.encoded[self.numbers]
        if not remap:
            return out
        ids, owners = self._ids_of(self._used)
        touched = np.unique(owners[np.isin(ids, np.array(list(remap), dtype=np.uint64))])
        reencoded: dict[int, bytes] = {}
        for number in touched.tolist():
            start, count = self._c.first_id[number], self._c.id_count[number]
            moved = [remap.get(f, f) for f in self._c.function_ids[start:start + count].tolist()]
            reencoded[number] = encode_lines(moved, self._c.lines[number])
        where = np.isin(self.numbers, touched)
        replacement = np.empty(int(where.sum()), dtype=object)
        replacement[:] = [reencoded[n] for n in self.numbers[where].tolist()]
        out[where] = replacement
        return out
