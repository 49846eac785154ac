"""A profile's locations as columns: mapping IDs, addresses, whether they have lines.

Reading `mapping_id` and `address` through protobuf's message objects costs about a
microsecond a location, most of what a warm /symbolize of 100,000 locations may spend. Here
they are read for all locations at once with numpy, from the encoded locations of a RawProfile.

Only the common shape is read in bulk: a location that is nothing but one-byte tags of varint
fields 1, 2, 3 and 5 (id, mapping_id, address, is_folded), which is every location a profiler
sends before symbolization. Any other location (lines, unknown fields) is parsed by protobuf,
one at a time, and so is validated by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from .codec import ProfileError
from .profile_pb2 import Location

U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
_SIMPLE_TAG = np.zeros(256, dtype=np.bool_)
_SIMPLE_TAG[[0x08, 0x10, 0x18, 0x28]] = True
_MAPPING_ID, _ADDRESS = 0x10, 0x18
_MAX_VARINT = 10
# Fields a simple location has (id, mapping_id, address, is_folded), with room for repeats.
_MAX_FIELDS = 8


class MalformedLocation(ProfileError):
    """A location's bytes are not a Location message."""


@dataclass(frozen=True, slots=True)
class LocationColumns:
    mapping_id: U64
    address: U64
    has_lines: npt.NDArray[np.bool_]


def location_columns(encoded: Sequence[bytes]) -> LocationColumns:
    """The columns of encoded Location messages, in their order."""
    n = len(encoded)
    mapping_id = np.zeros(n, dtype=np.uint64)
    address = np.zeros(n, dtype=np.uint64)
    has_lines = np.zeros(n, dtype=np.bool_)
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=n)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    buf = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    rest = np.flatnonzero(lengths > 0)
    if len(rest):
        # next_end[i]: the first byte at or after i that ends a varint (len(buf) if none).
        index = np.int32 if len(buf) < 2**31 else np.int64
        next_end = np.where(buf < 0x80, np.arange(len(buf), dtype=index), len(buf))
        next_end = np.minimum.accumulate(next_end[::-1])[::-1]
        rest = _read_canonical(buf, next_end, rest, starts, ends, mapping_id, address)
        rest = _read_simple(buf, next_end, rest, starts, ends, mapping_id, address)
    for i in rest.tolist():
        try:
            loc = Location.FromString(encoded[i])
        except DecodeError as e:
            raise MalformedLocation(f"location {i}: {e}") from None
        mapping_id[i], address[i], has_lines[i] = loc.mapping_id, loc.address, bool(loc.line)
    return LocationColumns(mapping_id, address, has_lines)


def _read_canonical(buf: npt.NDArray[np.uint8], next_end: npt.NDArray[np.integer],
                    which: I64, starts: I64, ends: I64, mapping_id: U64, address: U64) -> I64:
    """Read the locations that are id, mapping_id, address in that order, as encoders write
    them when all three are set; return the others."""
    last = len(buf) - 1
    at = starts[which]
    end = ends[which]
    spans = []
    ok = np.ones(len(which), dtype=np.bool_)
    for tag in (0x08, _MAPPING_ID, _ADDRESS):
        value = np.minimum(at + 1, last)
        value_end = next_end[value].astype(np.int64)
        ok &= (buf[np.minimum(at, last)] == tag) & (value_end < end) \
            & (value_end - at <= _MAX_VARINT)
        spans.append((value, value_end - at))
        at = value_end + 1
    ok &= at == end
    for (first, width), column in zip(spans[1:], (mapping_id, address), strict=True):
        column[which[ok]] = _varint_values(buf, first[ok], width[ok])
    return which[~ok]


def _read_simple(buf: npt.NDArray[np.uint8], next_end: npt.NDArray[np.integer], which: I64,
                 starts: I64, ends: I64, mapping_id: U64, address: U64) -> I64:
    """Read the other simple locations (fields left out, repeated or in another order, or
    is_folded); return those that are not simple.

    They are walked together, a field a step: a one-byte tag, then a varint, which ends at the
    first byte below 0x80 and must end inside its location.
    """
    n = len(which)
    last = len(buf) - 1
    spans = {_MAPPING_ID: (np.zeros(n, np.int64), np.zeros(n, np.int64)),
             _ADDRESS: (np.zeros(n, np.int64), np.zeros(n, np.int64))}
    other = np.zeros(n, dtype=np.bool_)
    pos = starts[which]
    end_of = ends[which]
    walking = np.arange(n)
    for _step in range(_MAX_FIELDS):
        if not len(walking):
            break
        at = pos[walking]
        end = end_of[walking]
        tag = buf[np.minimum(at, last)]
        value_end = next_end[np.minimum(at + 1, last)].astype(np.int64)
        ok = (_SIMPLE_TAG[tag] & (at + 1 < end) & (value_end < end)
              & (value_end - at <= _MAX_VARINT))
        other[walking[~ok]] = True
        walking, at, tag, value_end, end = walking[ok], at[ok], tag[ok], value_end[ok], end[ok]
        for field, (first, width) in spans.items():
            sel = tag == field
            first[walking[sel]] = at[sel] + 1
            width[walking[sel]] = value_end[sel] - at[sel]
        pos[walking] = value_end + 1
        walking = walking[value_end + 1 < end]
    other[walking] = True  # more fields than a simple location has
    for field, column in ((_MAPPING_ID, mapping_id), (_ADDRESS, address)):
        first, width = spans[field]
        column[which] = _varint_values(buf, first, width)
    return which[other]


def _varint_values(buf: npt.NDArray[np.uint8], first: I64, width: I64) -> U64:
    """The varints of `width` bytes at `first` (0 where width is 0); bits past 64 dropped."""
    values = np.zeros(len(first), dtype=np.uint64)
    for k in range(int(width.max(initial=0))):
        part = np.flatnonzero(width > k)
        byte = (buf[first[part] + k] & 0x7F).astype(np.uint64)
        values[part] |= byte << np.uint64(7 * k)
    return values
