"""A body sent with a Content-Encoding, inflated a bounded piece at a time: a request's
(proxy.web.content_encoding) and an upstream's (proxy.sources.debuginfod) alike. Neither is
left to aiohttp, which inflates on the event loop as it reads, and checks that a stream
reached its end for deflate only.

A piece is inflated only when its reader asks for it, so a reader that has had enough (a
limit passed) stops the inflating: a bomb costs what its reader takes, not what it holds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from isal import isal_zlib

# isal's stubs declare its error an instance of Exception; it is the class.
_ZLIB_ERROR = cast("type[Exception]", isal_zlib.error)
GZIP = 16 + isal_zlib.MAX_WBITS
# HTTP's "deflate" is the zlib format (RFC 9110 8.4.1.2).
DEFLATE = isal_zlib.MAX_WBITS
# The codings taken, as window bits.
CODINGS = {"gzip": GZIP, "x-gzip": GZIP, "deflate": DEFLATE}
# Inflated at most this much per piece.
PIECE = 1 << 20
# A piece only counted, or joined to a hop's (hop): small, one allocation the
# allocator keeps reusing.
# Six gzip bombs measured at once with 1 MiB pieces, each made in a thread of its own,
# grew the process by 15-35 MiB (a freed piece stays in its thread's malloc arena).
COUNTED_PIECE = 64 << 10


class Unreadable(Exception):
    """The body is not the compressed stream it says it is, or ends before that does."""


class Inflater:
    """One body's inflating, fed as its bytes come. gzip's members are inflated one after
    another, as gzip itself reads `cat a.gz b.gz`. With `raw_deflate`, a "deflate" body
    without the zlib header (as some servers send it) is taken as the raw stream it is."""

    def __init__(self, wbits: int, *, raw_deflate: bool = False) -> None:
        self._wbits = wbits
        self._sniff = raw_deflate and wbits == DEFLATE
        self._inflater = isal_zlib.decompressobj(wbits=wbits)

    def pieces(self, data: bytes, piece: int = PIECE) -> Iterator[bytes]:
        """What `data` inflates to, `piece` bytes at most at a time."""
        if self._sniff and data:
            self._sniff = False
            if data[0] & 0x0F != 8:  # not a zlib header's deflate method
                self._wbits = -DEFLATE
                self._inflater = isal_zlib.decompressobj(wbits=self._wbits)
        # Fed a piece's worth at a time: what the inflater leaves of its input (a piece of
        # output short of its end) is a new copy each time, and left of a whole body it was
        # the rest of the body, copied for every piece (a 27 MB profile, 3200 times over).
        rest = memoryview(data)
        # isal's inflater of the zlib format takes in all its input and keeps back what came
        # past a full piece: asked again, with no more input, it gives that out.
        full = False
        try:
            while rest or (full and not self._inflater.eof):
                if self._inflater.eof:  # a member ended and more bytes came
                    if self._wbits != GZIP:
                        raise Unreadable("bytes after the end of its deflate stream")
                    self._inflater = isal_zlib.decompressobj(wbits=self._wbits)
                fed = rest[:piece]
                out = self._inflater.decompress(fed, piece)
                if not self._inflater.eof:
                    rest = rest[len(fed) - len(self._inflater.unconsumed_tail):]
                elif len(after := self._inflater.unused_data) <= len(fed):
                    rest = rest[len(fed) - len(after):]
                else:  # it had taken in bytes past its end before this call (kept back above)
                    rest = memoryview(after + rest[len(fed):])
                full = len(out) == piece
                if out:
                    yield out
        except _ZLIB_ERROR as e:
            raise Unreadable(str(e)) from None

    def end(self) -> None:
        """The body ended: Unreadable unless its compressed stream did too."""
        if not self._inflater.eof:
            raise Unreadable("it ends before its compressed stream does")


def hop(pieces: Iterator[bytes], most: int, keep: bool) -> tuple[int, bytes]:
    """How many bytes the next of `pieces` hold (all of them, or those up to the first that
    passes `most`), and with `keep` those bytes joined; without, each is thrown away as it
    comes. Blocks: call it in a thread."""
    size = 0
    kept = bytearray()
    for piece in pieces:
        size += len(piece)
        if keep:
            kept += piece
        if size > most:
            break
    return size, bytes(kept)
