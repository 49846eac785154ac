"""How a cached file leaves with sendfile(2), on aiohttp's path (proxy.web.artifacts) and on
the quick one (proxy.web.connections) alike: corked from its head to its last byte, and a
file shorter than its index entry cut, never ended as a short body."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import IO

log = logging.getLogger(__name__)

# A cached file's response is corked (TCP_CORK, nginx's tcp_nopush) from its head to its last
# byte: TCP then sends full frames only, the head in the first with the file's first bytes, and
# the tail when uncorked. The socket's unsent bytes are not bounded (TCP_NOTSENT_LOWAT was,
# at 128 KiB): sendfile(2) queues as much as the send buffer takes, and ACKs pull the rest out.
# A 4.2 MB hit, against the earlier bounded, uncorked send (bench/hit_ab.py, two vCPUs, wrk on
# loopback, medians of interleaved rounds): one worker 682 against 609 req/s (0.90x nginx's
# rate against 0.80x), server CPU 1.38 against 1.63 ms a response; two workers 776 against
# 800 req/s (0.92x against 0.94x), 1.35 against 1.43 ms. On loopback the client's kernel
# takes on what the server's no longer does (wrk 0.79 against 0.70 ms, 1.13 against 1.06).
_TCP_CORK: int | None = getattr(socket, "TCP_CORK", None)


def cork(sock: socket.socket | None, on: bool = True) -> None:
    """TCP_CORK on (or off) a TCP socket; nothing on another (a Unix socket), a kernel
    without it, or a socket gone already."""
    if _TCP_CORK is not None and sock is not None \
            and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, int(on))


class ShortFile(ConnectionResetError):
    """The cached file holds fewer bytes than its index entry (damaged from outside): the
    response is cut, as for a client gone."""


async def send_whole(transport: asyncio.Transport, file: IO[bytes], size: int, name: str, *,
                     fallback: bool = True) -> None:
    """The first `size` bytes of `file` after what `transport` sent so far (its head, corked
    by the caller), with sendfile(2), then uncorked; raises what the send failed with, or
    ShortFile."""
    sock = transport.get_extra_info("socket")
    cork(sock)
    try:
        sent = await asyncio.get_running_loop().sendfile(transport, file, 0, size,
                                                         fallback=fallback)
    finally:
        cork(sock, on=False)  # the tail goes now, and a next response on the connection too
    if sent != size:
        log.warning("cached %s is shorter than its index entry (%d of %d bytes); its response "
                    "was cut", name, sent, size)
        raise ShortFile("cached file shorter than its index entry")
