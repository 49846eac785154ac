"""Bulk varints and messages are byte for byte what protobuf writes."""

from __future__ import annotations

import random

import numpy as np

from symbolize.chains import encode_lines
from symbolize.pprof import varint
from symbolize.pprof.profile_pb2 import Function, Line, Location, Profile

EDGES = [0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**35, 2**63, 2**64 - 1]
# The last value of each width, and the first: 1 to 10 bytes.
WIDTHS = [v for k in range(1, 10) for v in (2 ** (7 * k) - 1, 2 ** (7 * k))] + [2**64 - 1]


def test_put_and_get_are_protobufs_varints() -> None:
    values = np.array([*EDGES, *(random.Random(1).getrandbits(64) for _ in range(500))],
                      dtype=np.uint64)
    width = varint.widths(values)
    at = np.cumsum(width) - width
    out = np.zeros(int(width.sum()), dtype=np.uint8)
    varint.put(out, at, values, width)
    # Location.id is a uint64: its encoding is the tag 0x08 and the varint (none for 0).
    assert out.tobytes() == b"".join(Location(id=v).SerializeToString()[1:] or b"\0"
                                     for v in values.tolist())
    assert out.tobytes() == b"".join(varint.encode_one(v) for v in values.tolist())
    assert varint.get(out, at, width).tolist() == values.tolist()


def test_get_reads_every_width_at_every_place_up_to_the_buffers_end() -> None:
    """get reads eight bytes at a time: a varint of any width, at any offset (the buffer's
    last bytes included), gives its value, and bytes after it never leak into it."""
    for value in WIDTHS:
        one = varint.encode_one(value)
        for before in range(9):
            for after in (b"", b"\xff" * 3, b"\x01"):  # continuation bits that are not its own
                buf = np.frombuffer(b"\x80" * before + one + after, dtype=np.uint8)
                got = varint.get(buf, np.array([before]), np.array([len(one)]))
                assert got.tolist() == [value], (value, before, after)
    values = np.array(WIDTHS, dtype=np.uint64)
    assert varint.widths(values).tolist() == [len(varint.encode_one(v)) for v in WIDTHS]
    for k in range(1, len(WIDTHS) + 1):  # the largest value decides the comparisons made
        assert varint.widths(values[:k]).tolist() == \
            [len(varint.encode_one(v)) for v in WIDTHS[:k]]
    assert varint.widths(np.zeros(0, np.uint64)).tolist() == []
    assert varint.get(np.zeros(0, np.uint8), np.zeros(0, np.int64),
                      np.zeros(0, np.int64)).tolist() == []
    zero_width = varint.get(np.frombuffer(b"\x05", np.uint8), np.array([0]), np.array([0]))
    assert zero_width.tolist() == [0]
    nothing = varint.get(np.zeros(0, np.uint8), np.array([0]), np.array([0]))
    assert nothing.tolist() == [0]
    # A byte each, the last at the buffer's end, beside ones of no bytes at all.
    ones = varint.get(np.frombuffer(b"\x05\x7f\x01", np.uint8), np.array([0, 1, 2, 0]),
                      np.array([1, 1, 1, 0]))
    assert ones.tolist() == [5, 127, 1, 0]
    # Said to be one byte long where that byte has its continuation bit: its seven bits, as
    # the wider reads take them.
    for width in ([1], [2]):
        assert varint.get(np.frombuffer(b"\x85\x00", np.uint8), np.array([0]),
                          np.array(width)).tolist() == [5]


def test_messages_are_protobufs_functions() -> None:
    rng = random.Random(2)
    rows = [[rng.choice([*EDGES[:9], rng.getrandbits(30)]) for _ in range(4)] for _ in range(400)]
    cols = np.array(rows, dtype=np.uint64)
    out, end = varint.messages(0x2A, [(k + 1, cols[:, k]) for k in range(4)])
    want = Profile(function=[Function(id=a, name=b, system_name=c, filename=d)
                             for a, b, c, d in rows]).SerializeToString()
    assert out.tobytes() == want
    assert end[-1] == len(want)


def test_encode_lines_is_protobufs_line_entries() -> None:
    rng = random.Random(3)
    chains = [[(rng.choice([1, 300, 2**20 + rng.randrange(1000)]), rng.choice([0, 7, 99999]),
                rng.choice([0, 1, 200]))
               for _ in range(rng.randrange(4))] for _ in range(300)]
    owner = np.array([c for c, frames in enumerate(chains) for _ in frames], dtype=np.int64)
    fids = np.array([f for frames in chains for f, _, _ in frames], dtype=np.uint64)
    lines = np.array([n for frames in chains for _, n, _ in frames], dtype=np.uint64)
    columns = np.array([c for frames in chains for _, _, c in frames], dtype=np.uint64)
    got = encode_lines(owner, fids, lines, columns, len(chains))
    want = [Location(line=[Line(function_id=f, line=n, column=c) for f, n, c in frames])
            .SerializeToString() for frames in chains]
    assert got == want
