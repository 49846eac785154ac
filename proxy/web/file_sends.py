"""How a cached file leaves with sendfile(2), on aiohttp's path (proxy.web.artifacts) and on
the quick one (proxy.web.connections) alike: the bound on what its socket holds unsent, and a
file shorter than its index entry cut, never ended as a short body."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import IO

log = logging.getLogger(__name__)

# The most a client's socket may hold that TCP has not sent yet (TCP_NOTSENT_LOWAT), while a
# cached file is sent with sendfile(2). Unbounded, sendfile queues the whole file at once (the
# send buffer grows to 4 MiB), and the client copies it out long after: a 4.2 MB hit cost wrk
# 2.4 ms of kernel time (perf: _copy_to_iter) against 1.0 ms with this bound, 0.85x nginx's
# rate against 1.1-1.3x (bench/hit_cpu.py). What is in flight is not bounded, so a distant
# client is not slowed, as a fixed SO_SNDBUF would slow it; the loop refills the socket as it
# drains. The price: the response holds its file (and its lease) until the last bytes are
# nearly sent, not only until they are queued. The bound stays on the connection: a later
# streamed download or small hit on it is written in more steps when the client lags, but
# taking it off after each file cost 10% of the 4.2 MB hit rate with 2 workers (0.89x against
# 1.01x nginx's, four interleaved runs each).
UNSENT_BYTES = 128 * 1024
# Linux's option number; named in socket since Python 3.7 where the platform has it.
_TCP_NOTSENT_LOWAT: int | None = getattr(socket, "TCP_NOTSENT_LOWAT", None)


def bound_unsent(sock: socket.socket | None) -> None:
    """UNSENT_BYTES on a TCP socket; nothing on another (a Unix socket) or a kernel without it."""
    if _TCP_NOTSENT_LOWAT is not None and sock is not None \
            and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # a socket gone already: as before
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, UNSENT_BYTES)


class ShortFile(ConnectionResetError):
    """The cached file holds fewer bytes than its index entry (damaged from outside): the
    response is cut, as for a client gone."""


async def send_whole(transport: asyncio.Transport, file: IO[bytes], size: int, name: str, *,
                     fallback: bool = True) -> None:
    """The first `size` bytes of `file` after what `transport` sent so far, with sendfile(2)
    under the unsent bound; raises what the send failed with, or ShortFile."""
    bound_unsent(transport.get_extra_info("socket"))
    sent = await asyncio.get_running_loop().sendfile(transport, file, 0, size,
                                                     fallback=fallback)
    if sent != size:
        log.warning("cached %s is shorter than its index entry (%d of %d bytes); its response "
                    "was cut", name, sent, size)
        raise ShortFile("cached file shorter than its index entry")
