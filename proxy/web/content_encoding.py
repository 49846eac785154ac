"""Request bodies sent with a Content-Encoding, inflated by symgate rather than by aiohttp.

aiohttp's server inflates a body on the event loop as it reads it, and goes on reading (and
inflating) a body its handler refused for its lingering time: one 4 MB gzip bomb POSTed with
`Content-Encoding: gzip` held the loop, /healthz and every /buildid hit of the process, for
10 s. The server runs without it (`auto_decompress=False`, proxy.web.app); the handlers that
take bodies inflate them here instead, a mebibyte at most at a time, each in a thread, and
only as far as their reader takes them: a reader that has had enough stops the inflating.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Callable

from aiohttp import web

from proxy.errors import InvalidRequest, PayloadTooLarge, UnsupportedMediaType
from proxy.inflating import CODINGS, COUNTED_PIECE, PIECE, Inflater, Unreadable, hop

# What one thread's hop of measure_body counts at most: a few milliseconds of inflating.
COUNTED_HOP = 8 << 20


def coding_of(request: web.BaseRequest) -> int | None:
    """The window bits of the request's Content-Encoding; None when it has none. Any other
    coding (br, zstd, several stacked) is a 415, as RFC 7694 has it."""
    coding = request.headers.get("Content-Encoding", "").strip().lower()
    if coding in ("", "identity"):
        return None
    if coding not in CODINGS:
        raise UnsupportedMediaType(f"unsupported Content-Encoding {coding!r}: send the body "
                                   "as it is, or with gzip or deflate")
    return CODINGS[coding]


def _unreadable(why: str) -> InvalidRequest:
    # The words aiohttp's own failure was answered with (proxy.web.errors), so that a client
    # sees one message for a broken body whoever inflates it.
    return InvalidRequest(f"the request body is unreadable: Content-Encoding: {why}")


async def inflated(chunks: AsyncIterable[bytes], wbits: int) -> AsyncGenerator[bytes, None]:
    """`chunks` inflated, about a mebibyte (proxy.inflating.PIECE) at a time, each in a
    thread: never on the event loop, and no further than the caller reads. Small pieces
    joined a hop's worth: gzip's members each end a piece, and a piece a hop made an upload
    of 150,000 one-byte members take as many hops."""
    inflater = Inflater(wbits)
    try:
        async for chunk in chunks:
            pieces = inflater.pieces(chunk, COUNTED_PIECE)
            while True:
                grown, part = await asyncio.to_thread(hop, pieces, PIECE, True)
                if not grown:
                    break
                yield part
        inflater.end()
    except Unreadable as e:
        raise _unreadable(str(e)) from None


async def measure_body(body: bytes, wbits: int, limit: int, setting: str,
                       gone: Callable[[], bool] = lambda: False) -> None:
    """413 the moment `body` inflates past `limit` bytes (`setting` names it);
    ConnectionResetError once `gone()` says its client left (looked at between hops).

    Counted in a thread, each small piece thrown away as it comes, as codec does a gzipped
    profile: a bomb is refused without ever being held (kept as it came, it would be the whole
    limit, 256 MiB by default, in memory before its 413), and only what is known to fit is
    inflated whole, by inflate_measured, when it is wanted: a profile waiting for a slot holds
    it as sent."""
    await _in_hops(body, wbits, limit, setting, keep=False, gone=gone)


async def inflate_measured(body: bytes, wbits: int, limit: int, setting: str) -> bytes:
    """A whole body that measure_body has passed, inflated in hops as it was measured: a
    piece a hop, a gzip body of a million one-byte members took a million of them."""
    return await _in_hops(body, wbits, limit, setting, keep=True)


async def _in_hops(body: bytes, wbits: int, limit: int, setting: str, keep: bool,
                   gone: Callable[[], bool] = lambda: False) -> bytes:
    inflater = Inflater(wbits)
    # Small pieces: each gzip member ends a piece fed whole (a copy of what is left of it),
    # which 1 MiB pieces made 12 s for a body of 300,000 one-byte members.
    pieces = inflater.pieces(body, COUNTED_PIECE)
    parts: list[bytes] = []
    size = 0
    try:
        # A hop at a time: no thread is held for long, and a stop (a cancel) or a client's
        # leaving ends it at the next hop. aiohttp cancels no handler whose client left: a
        # bomb under a large limit was measured to its end for nobody (seconds a GiB).
        while True:
            if gone():
                raise ConnectionResetError("the client left while its body was measured")
            grown, part = await asyncio.to_thread(hop, pieces, COUNTED_HOP, keep)
            if not grown:
                break
            size += grown
            if size > limit:
                raise _too_large(limit, setting)
            parts.append(part)
        inflater.end()
    except Unreadable as e:
        raise _unreadable(str(e)) from None
    return b"".join(parts)


def _too_large(limit: int, setting: str) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body inflates to more than {limit} bytes ({setting})")
