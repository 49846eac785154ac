"""Protobuf varints of many values at once, with numpy.

The rewrite reads and writes hundreds of thousands of small messages (locations, their Line
entries, functions); a varint a time from Python costs a microsecond, a column of them a few
nanoseconds a value.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

MAX_WIDTH = 10  # a 64-bit value takes at most ten 7-bit groups
_LIMITS = np.array([1 << (7 * k) for k in range(1, MAX_WIDTH)], dtype=np.uint64)
# The low k bytes of a word, for k from 0 to 8.
_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(9)], dtype=np.uint64)
# The 7-bit groups of eight bytes packed in three steps: pairs into 14 bits, then 28, then 56.
_PACK = [(np.uint64(low), np.uint64(low << lane), np.uint64(lane - 7 * lane // 8))
         for low, lane in ((0x007F007F007F007F, 8), (0x00003FFF00003FFF, 16),
                           (0x000000000FFFFFFF, 32))]


def widths(values: U64) -> I64:
    """How many bytes the varint of each value takes (1 to 10)."""
    # A comparison per width the largest value reaches: most columns (lengths, lines, ids)
    # need two or three, a third to a fifth of the time of a binary search of all nine.
    top = np.uint64(values.max(initial=0))
    out = np.ones(len(values), dtype=np.int64)
    for limit in _LIMITS[: int(np.searchsorted(_LIMITS, top, side="right"))]:
        out += values >= limit
    return out


def put(out: U8, at: I64, values: U64, width: I64) -> None:
    """Write the varint of each value at out[at:at + width]; `width` is `widths(values)`."""
    for k in range(int(width.max(initial=0))):
        part = np.flatnonzero(width > k)
        group = (values[part] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = np.where(width[part] > k + 1, np.uint64(0x80), np.uint64(0))
        out[at[part] + k] = (group | more).astype(np.uint8)


def get(buf: U8, first: I64, width: I64) -> U64:
    """The varints of `width` bytes at `first` (0 where width is 0); bits past 64 dropped."""
    # Each varint's first eight bytes as one little-endian word (a view of the buffer at every
    # byte offset), its 7-bit groups then packed together in three steps for all at once: a
    # sixth of the time of a pass per byte (0.64 against 4.2 ms for 65,000 addresses).
    if not len(first) or not len(buf):
        return np.zeros(len(first), dtype=np.uint64)
    if int(width.max()) <= 1:  # a byte each (mapping ids, mostly): the bytes themselves
        one: U64 = np.where(width > 0, np.take(buf, np.minimum(first, len(buf) - 1)) & 0x7F, 0
                            ).astype(np.uint64)
        return one
    if len(buf) < 8:
        buf = np.concatenate((buf, np.zeros(8 - len(buf), dtype=np.uint8)))
    words = np.ndarray((len(buf) - 7,), dtype="<u8", buffer=buf, strides=(1,))
    x = _words_at(words, first) & _BYTES[np.minimum(width, 8)]
    for low, high, shift in _PACK:
        x = (x & low) | ((x & high) >> shift)
    if len(long := np.flatnonzero(width > 8)):  # 57 to 64 bits: two bytes more
        rest = _words_at(words, first[long] + 8) & _BYTES[width[long] - 8]
        x[long] |= ((rest & np.uint64(0x7F)) << np.uint64(56)) \
            | ((rest & np.uint64(0x100)) << np.uint64(55))
    return x


def _words_at(words: U64, at: I64) -> U64:
    """The eight bytes from each of `at` as a word, zeros past the buffer's end: those of its
    last whole word, shifted (the buffer is not copied to be padded: it may be megabytes)."""
    last = len(words) - 1
    out: U64 = words[np.minimum(at, last)]
    if len(over := np.flatnonzero(at > last)):
        out[over] >>= (np.minimum(at[over] - last, 8) * 8).astype(np.uint64)
    return out


def messages(tag: int, fields: list[tuple[int, U64]]) -> tuple[U8, I64]:
    """Length-delimited messages of varint fields, one per row, each behind `tag`.

    `fields` is (field number, column) per field, in the order they are written; a field
    whose value is 0 is left out, as protobuf does in proto3. Rows must encode to at most 127
    bytes. Returns the bytes and where each message ends.
    """
    rows = len(fields[0][1]) if fields else 0
    widths_of = [np.where(v > 0, widths(v), 0) for _number, v in fields]
    inner = sum(((w > 0) + w for w in widths_of), np.zeros(rows, dtype=np.int64))
    if rows and int(inner.max()) > 0x7F:
        raise ValueError("a message longer than 127 bytes")
    size = 2 + inner
    end = np.cumsum(size)
    at = end - size
    out = np.zeros(int(end[-1]) if rows else 0, dtype=np.uint8)
    out[at] = tag
    out[at + 1] = inner
    at = at + 2
    for (number, values), width in zip(fields, widths_of, strict=True):
        has = width > 0
        out[at[has]] = number << 3  # wire type 0: varint
        put(out, at[has] + 1, values[has], width[has])
        at = at + has + width
    return out, end


def encode_one(value: int) -> bytes:
    """One varint, for the few values that are not worth a column."""
    out = bytearray()
    while value > 0x7F:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.append(value)
    return bytes(out)
