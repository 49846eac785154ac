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
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from . import varint
from .codec import Buffer, ProfileError, as_bytes
from .profile_pb2 import Location
from .profile_raw_pb2 import RawLocations

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
    length: I64  # of the encoding
    # The encodings one after another, when asked for (`keep_encodings`): in parts, each of
    # PART locations but the last (not joined: that would hold them twice at once).
    encodings: list[npt.NDArray[np.uint8]] | None = None
    # Bytes before each encoding in `encodings`: 2 where they are Profile.location fields
    # (record_columns), the tag and a one-byte length.
    head: int = 0


# Locations read at a time: the positions of a batch's varint ends are eight bytes for each
# byte of it, which for a whole profile of a million locations was 160 MB at once.
_BATCH = 1 << 16
PART = _BATCH  # locations of a part of LocationColumns.encodings


def location_columns(encoded: Sequence[bytes], keep_encodings: bool = False
                     ) -> LocationColumns:
    """The columns of encoded Location messages, in their order; with `keep_encodings`, their
    bytes too (the rewrite writes the locations out again from them)."""
    if len(encoded) <= _BATCH:
        # As a list: a protobuf repeated field copies an item out at every reading.
        one = _columns(list(encoded), keep_encodings)
        return replace(one, encodings=one.encodings and [one.encodings[0]])
    n = len(encoded)
    out = LocationColumns(np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64),
                          np.zeros(n, dtype=np.bool_), np.zeros(n, dtype=np.int64))
    kept = []
    for i in range(0, n, _BATCH):  # into columns made once: no second copy to join
        part = _columns(encoded[i: i + _BATCH], keep_encodings, first=i)
        for f in ("mapping_id", "address", "has_lines", "length"):
            getattr(out, f)[i: i + _BATCH] = getattr(part, f)
        kept += part.encodings or []
        del part  # not alive beside the next batch's
    return replace(out, encodings=kept) if keep_encodings else out


def encoded_locations(raw: Buffer) -> bytes:
    """The Profile.location fields of the encoded profile `raw` (tag, length, Location), one
    after another as protobuf writes them: for 100,000 locations 1.5 ms, against 5.4 for taking
    them out of a RawProfile as bytes objects and joining them."""
    locations = RawLocations.FromString(as_bytes(raw))
    locations.DiscardUnknownFields()  # the rest of the profile
    return locations.SerializeToString()


_LOCATION_FIELD = 0x22  # Profile.location: field 4, length-delimited
# The varint ends of such a field when its Location is canonical (_read_canonical) and shorter
# than 128 bytes: the tag, the one-byte length, then the Location's six.
_RECORD_STOPS = 8
_MAX_RECORD = 2 + 3 * (1 + _MAX_VARINT)


def record_columns(records: bytes, count: int) -> LocationColumns | None:
    """The columns of `count` Profile.location fields one after another (encoded_locations),
    their bytes kept as they are (LocationColumns.head 2), when every Location is of the
    canonical shape (_read_canonical) with a one-byte length, as profilers write them: the
    varint ends of a batch are then rows of eight, and no location needs reading alone. None
    when any is not, for location_columns to read them one by one."""
    buf = np.frombuffer(records, dtype=np.uint8)
    mapping_id = np.zeros(count, dtype=np.uint64)
    address = np.zeros(count, dtype=np.uint64)
    length = np.zeros(count, dtype=np.int64)
    parts: list[npt.NDArray[np.uint8]] = []
    at = 0
    # Fields of a profile are much of a size: a batch's are looked for in a window of their
    # average size, past which a field at most _MAX_RECORD bytes long is not needed.
    typical = len(buf) / max(count, 1) * 1.25 + 1
    for first in range(0, count, _BATCH):
        n = min(_BATCH, count - first)
        for reach in (int(typical * n) + _MAX_RECORD, _MAX_RECORD * n):
            window = buf[at: at + reach]
            stops = np.flatnonzero(window < 0x80)
            if len(stops) >= _RECORD_STOPS * n:
                break
        else:
            return None
        run = _rows(stops[: _RECORD_STOPS * n], _RECORD_STOPS)
        size = window[run[1]].astype(np.int64)  # the Location's length
        # The fields tile the window from its start, each a tag, its length and as many bytes
        # of a canonical Location.
        ok = run[7] == run[1] + size
        ok &= run[0] == np.concatenate(([0], run[7][:-1] + 1))
        ok &= (window[run[0]] == _LOCATION_FIELD) & (run[1] == run[0] + 1)
        ok &= _canonical(window, run[2:], run[1] + 1)
        if not ok.all():
            return None
        for j, column in ((4, mapping_id), (6, address)):
            column[first: first + n] = varint.get(window, run[j] + 1, run[j + 1] - run[j])
        length[first: first + n] = size
        end = int(run[7][-1]) + 1
        parts.append(window[:end])
        at += end
    if at != len(buf):
        return None
    return LocationColumns(mapping_id, address, np.zeros(count, dtype=np.bool_), length, parts,
                           head=2)


def _columns(encoded: Sequence[bytes], keep_encodings: bool, first: int = 0
             ) -> LocationColumns:
    """`first`: the index in the profile of the first of `encoded`, for errors."""
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
        # Where varints end: every byte below 0x80, one-byte tags included, in order.
        stops = _Stops(np.flatnonzero(buf < 0x80), len(buf))
        rest = _read_canonical(buf, stops, rest, starts, ends, mapping_id, address)
        rest = _read_simple(buf, stops, rest, starts, ends, mapping_id, address)
    for i in rest.tolist():
        try:
            loc = Location.FromString(encoded[i])
        except DecodeError as e:
            # The words codec.check_samples says it in, whichever of the two finds it first.
            raise MalformedLocation(f"not a pprof profile: location {first + i} is not a valid "
                                    f"Location message ({e})") from None
        mapping_id[i], address[i], has_lines[i] = loc.mapping_id, loc.address, bool(loc.line)
    return LocationColumns(mapping_id, address, has_lines, lengths,
                           [buf] if keep_encodings else None)


class _Stops:
    """The positions of the bytes below 0x80 in a buffer: where its varints end."""

    def __init__(self, positions: I64, size: int) -> None:
        # A sentinel past the end: "no varint ends here" without a bounds check.
        self.positions = np.append(positions, size)

    def index_from(self, at: I64) -> I64:
        """The index in `positions` of the first stop at or after each of `at`."""
        found: I64 = np.searchsorted(self.positions[:-1], at)
        return found

    def first_from(self, at: I64) -> I64:
        """The first stop at or after each of `at` (the buffer's size where there is none)."""
        found: I64 = self.positions[self.index_from(at)]
        return found


def _read_canonical(buf: npt.NDArray[np.uint8], stops: _Stops, which: I64, starts: I64,
                    ends: I64, mapping_id: U64, address: U64) -> I64:
    """Read the locations that are id, mapping_id, address in that order, as encoders write
    them when all three are set; return the others.

    Such a location is six varint ends in a row: a tag, its value, a tag, its value, a tag
    and the value that ends the location.
    """
    at = starts[which]
    stop = stops.positions
    last = len(stop) - 1  # the sentinel
    run: Rows
    if 6 * len(which) == last:
        # As many stops as if every location were canonical: their six stops are rows of a
        # table (the checks below catch any location for which that is not so).
        run = _rows(stop[:-1], 6)
    else:
        k = stops.index_from(at)
        run = [stop[np.minimum(k + j, last)] for j in range(6)]
    ok: npt.NDArray[np.bool_] = _canonical(buf, run, at) & (run[5] == ends[which] - 1)
    for j, column in ((2, mapping_id), (4, address)):
        first = run[j][ok] + 1
        column[which[ok]] = varint.get(buf, first, run[j + 1][ok] - first + 1)
    return which[~ok]


Rows = Sequence[I64] | npt.NDArray[np.int32] | I64


def _canonical(buf: npt.NDArray[np.uint8], run: Rows, start: I64) -> npt.NDArray[np.bool_]:
    """Whether the six varint ends in `run` (a row each) are those of a canonical Location
    beginning at `start`: the tags of its id, mapping_id and address in that order, each
    where the value before it ends, and values of ten bytes at most."""
    ok: npt.NDArray[np.bool_] = run[0] == start
    for j, tag in ((0, 0x08), (2, _MAPPING_ID), (4, _ADDRESS)):
        if j:
            ok &= run[j] == run[j - 1] + 1
        ok &= np.take(buf, np.minimum(run[j], len(buf) - 1)) == tag
        ok &= run[j + 1] - run[j] <= _MAX_VARINT
    return ok


def _rows(stops: I64, width: int) -> npt.NDArray[np.int32] | I64:
    """The stops of each location, `width` in a row, as a table of a row per place in the
    location: contiguous, as the checks on them want them (a comparison of strided ones took
    ten times as long, 0.32 against 0.03 ms for 65,000, and there are a dozen), and 32-bit
    where a batch's bytes allow it (always, but for locations of tens of kilobytes): half the
    memory of the stops themselves."""
    narrow = not len(stops) or int(stops[-1]) < 1 << 31  # sorted: the last is the largest
    table = np.empty((width, len(stops) // width), dtype=np.int32 if narrow else np.int64)
    table[...] = stops.reshape(-1, width).T
    return table


def _read_simple(buf: npt.NDArray[np.uint8], stops: _Stops, which: I64, starts: I64,
                 ends: I64, mapping_id: U64, address: U64) -> I64:
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
        value_end = stops.first_from(at + 1)
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
        column[which] = varint.get(buf, first, width)
    return which[other]
