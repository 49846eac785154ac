"""The bulk readers of the rewrite agree with protobuf and with the scalar translation."""

from __future__ import annotations

import random

import numpy as np
import pytest

from symbolize.elf import LoadSegment
from symbolize.pprof.columns import MalformedLocation, location_columns
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
