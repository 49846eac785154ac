"""The bulk readers of the rewrite agree with protobuf and with the scalar translation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from symbolize.elf import LoadSegment
from symbolize.pprof.columns import (
    MalformedLocation,
    encoded_locations,
    location_columns,
    record_columns,
)
from symbolize.pprof.profile_pb2 import Profile
from symbolize.pprof.profile_raw_pb2 import RawProfile
from symbolize.translate import to_vaddr, to_vaddrs

EDGES = [0, 1, 127, 128, 16383, 16384, 2**63, 2**64 - 1]


def test_location_columns_match_protobuf_for_every_shape() -> None:
    rng = random.Random(7)
    p = Profile()
    for i in range(4000):
        loc = p.location.add(id=rng.choice([0, i + 1, 2**63 + i]),
                             mapping_id=rng.choice([0, 1, 300, 2**64 - 1]),
                             address=rng.choice([*EDGES, rng.getrandbits(64)]))
        if rng.random() < 0.1:
            loc.is_folded = True
        if rng.random() < 0.1:
            loc.line.add(function_id=rng.getrandbits(64), line=-1)
    encoded = list(RawProfile.FromString(p.SerializeToString()).location)
    # Non-canonical encodings a merge of two messages produces: fields repeated, out of order.
    encoded.append(b"\x18\x05\x10\x02\x08\x01\x10\x03")
    p.location.add().MergeFromString(encoded[-1])
    cols = location_columns(encoded)
    assert cols.address.tolist() == [loc.address for loc in p.location]
    assert cols.mapping_id.tolist() == [loc.mapping_id for loc in p.location]
    assert cols.has_lines.tolist() == [bool(loc.line) for loc in p.location]


def test_a_location_that_is_not_protobuf_is_malformed() -> None:
    with pytest.raises(MalformedLocation):
        location_columns([b"\x08\x01", b"\x22\x05\x08"])


def test_a_malformed_location_is_named_by_its_place_in_the_profile() -> None:
    """Past the first batch of 65,536 it was named by its place in its batch."""
    encoded = [b"\x08\x01"] * 70_000
    encoded[66_000] = b"\x22\x05\x08"
    with pytest.raises(MalformedLocation, match="location 66000 is not a valid Location"):
        location_columns(encoded)


def test_to_vaddrs_is_to_vaddr_for_every_address() -> None:
    rng = random.Random(3)
    segments = (LoadSegment(0, 0, 0x1000, 0x1000, False),
                LoadSegment(0x1000, 0x401000, 0x5000, 0x5000, True),
                LoadSegment(0x2000, 0x10, 0x100, 0x100, True))  # vaddr below its offset
    mappings = [(0, 0, 0), (0x7F0000001000, 0x7F0000006000, 0x1000),
                (0x1000, 0x3000, 0x8000), (0x10, 0, 0x20000)]
    addresses = [*EDGES, *(rng.getrandbits(64) for _ in range(200)),
                 *(0x7F0000000000 + rng.randrange(0x8000) for _ in range(500))]
    for start, limit, offset in mappings:
        got, ok = to_vaddrs(np.array(addresses, dtype=np.uint64), memory_start=start,
                            memory_limit=limit, file_offset=offset, segments=segments)
        for a, v, k in zip(addresses, got.tolist(), ok.tolist(), strict=True):
            want = to_vaddr(a, memory_start=start, memory_limit=limit, file_offset=offset,
                            segments=segments)
            assert (v if k else None) == want, (hex(a), start, limit, offset)


def test_six_varints_a_location_that_are_not_all_canonical() -> None:
    """As many varint ends as six per location, yet one location has five and one seven: the
    table-shaped fast read must not take them for canonical ones."""
    encoded = [b"\x08\x01\x10\x02\x18\x03", b"\x10\x02\x18\x83\x01",
               b"\x08\x01\x10\x02\x18\x03\x28\x01", b"\x08\x05\x10\x06\x18\x07"]
    cols = location_columns(encoded)
    assert cols.mapping_id.tolist() == [2, 2, 2, 6]
    assert cols.address.tolist() == [3, 131, 3, 7]
    assert cols.length.tolist() == [len(e) for e in encoded]


def _fields(encoded: list[bytes]) -> bytes:
    """Profile.location fields of these encodings, as a profile has them."""
    return RawProfile(location=encoded).SerializeToString()


def test_record_columns_read_canonical_locations_as_location_columns_does() -> None:
    """Locations as profilers write them (id, mapping_id, address, all set), taken from a
    whole profile's encoding, over more than one batch: the same columns as one by one, each
    field's bytes kept in order behind its two-byte head."""
    rng = random.Random(8)
    p = Profile(string_table=["", "x"], comment=[1])
    p.sample.add(location_id=[1], value=[1])
    for i in range(1, 150_001):
        p.location.add(id=rng.choice([i, 2**63 + i]), mapping_id=rng.choice([1, 300, 2**64 - 1]),
                       address=rng.choice([1, 127, 128, 2**64 - 1, rng.getrandbits(47)]))
    raw = p.SerializeToString()
    records = encoded_locations(raw)
    encoded = list(RawProfile.FromString(raw).location)
    assert records == _fields(encoded)
    got = record_columns(records, len(encoded))
    want = location_columns(encoded, keep_encodings=True)
    assert got is not None and got.head == 2 and want.encodings is not None
    for name in ("mapping_id", "address", "has_lines", "length"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name
    assert got.encodings is not None and len(got.encodings) == len(want.encodings) == 3
    assert b"".join(part.tobytes() for part in got.encodings) == records


@pytest.mark.parametrize("odd", [
    b"\x08\x01\x10\x02\x18\x03\x22\x02\x08\x01",  # has a line
    b"\x08\x01\x10\x02\x18\x03\x28\x01",  # is_folded
    b"\x10\x02\x08\x01\x18\x03",  # fields out of order
    b"\x08\x01\x18\x03",  # no mapping_id
    b"\x08\x01\x10\x02\x18\x03\x18\x04",  # a field twice
    b"\x08\x01\x10\x02\x18" + b"\x80" * 9 + b"\x01",  # a ten-byte address: still canonical
], ids=["lines", "folded", "order", "missing", "twice", "widest"])
def test_record_columns_leave_any_other_shape_to_location_columns(odd: bytes) -> None:
    """One location of another shape among canonical ones, at the start, the middle or the
    end: record_columns says None (location_columns reads them then), or, for the one that
    is canonical after all, what location_columns says."""
    plain = [bytes(Profile(location=[{"id": i, "mapping_id": 1, "address": 0x1000 + i}])
                   .SerializeToString()[2:]) for i in range(1, 100)]
    for at in (0, 50, len(plain)):
        encoded = [*plain[:at], odd, *plain[at:]]
        got = record_columns(_fields(encoded), len(encoded))
        if odd.endswith(b"\x80" * 9 + b"\x01"):
            want = location_columns(encoded)
            assert got is not None and got.address.tolist() == want.address.tolist()
        else:
            assert got is None, odd


def test_record_columns_refuse_fields_that_do_not_tile_the_buffer() -> None:
    plain = [Profile(location=[{"id": i, "mapping_id": 1, "address": 7}])
             .SerializeToString()[2:] for i in range(1, 10)]
    records = _fields(plain)
    assert record_columns(records, len(plain)) is not None
    assert record_columns(records, len(plain) - 1) is None  # a field more than said
    assert record_columns(records + b"\x22", len(plain)) is None  # trailing bytes
    assert record_columns(records[:-1], len(plain)) is None  # cut short
    assert record_columns(records.replace(b"\x22", b"\x2a", 1), len(plain)) is None
    long = Profile(location=[{"id": 1, "mapping_id": 1, "address": 7,
                              "line": [{"function_id": 1, "line": 1}] * 30}])
    assert record_columns(long.SerializeToString(), 1) is None  # a two-byte length
    assert record_columns(b"", 0) is not None
