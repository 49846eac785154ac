"""Clients that stop reading: a connection whose client takes none of the bytes waiting for it
for server.send_timeout_s is cut, as nginx's send_timeout cuts one.

A client that starts a response and never reads it would otherwise hold its connection (one
of server.max_connections) and, for a cached file, the file's lease, which keeps it from
eviction, for as long as it stays connected. Progress is what the client's TCP acknowledges
(TCP_INFO's tcpi_bytes_acked), not what the server manages to write: sendfile(2), which
asyncio runs out of the response's sight, is watched as well as writes, and a client that
reads slowly but reads is never cut. Every connection is looked at once a sweep, by two
system calls for each that has bytes waiting and one for each that has none: nothing is
added to the path of a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
from collections.abc import Callable, Iterable
from typing import Protocol

log = logging.getLogger(__name__)

# struct tcp_info (linux/tcp.h): tcpi_bytes_acked, a u64 at this offset since Linux 4.1.
_BYTES_ACKED = 120
_TCP_INFO_LEN = _BYTES_ACKED + 8
# A cut connection is closed with a reset at the latest this long after its socket is shut
# down (which is what wakes a sendfile(2) waiting for room, whose response then ends itself).
ABORT_AFTER_S = 1.0
# Sweeps come this often, at most, and at least four times per timeout.
LONGEST_SWEEP_S = 5.0


class SocketLike(Protocol):
    """What asyncio's transports give as their "socket" (asyncio.trsock.TransportSocket)."""

    def fileno(self) -> int: ...

    def getsockopt(self, level: int, option: int, buflen: int) -> bytes: ...

    def setsockopt(self, level: int, option: int, value: bytes) -> None: ...

    def shutdown(self, how: int) -> None: ...


def send_state(sock: SocketLike) -> tuple[int, int] | None:
    """(bytes the client has not acknowledged yet, bytes it has acknowledged since the
    connection began), or None where the socket cannot tell: not TCP, or not Linux."""
    try:
        waiting = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ,
                                                 b"\0\0\0\0"))[0]
        if waiting == 0:
            return 0, 0  # nothing waits: progress does not matter
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError, ValueError):
        return None
    if len(info) < _TCP_INFO_LEN:
        return None
    return waiting, struct.unpack_from("Q", info, _BYTES_ACKED)[0]


def sweep_interval(timeout_s: float) -> float:
    return min(LONGEST_SWEEP_S, timeout_s / 4)


class SendWatch:
    """Cuts the connections, among those it is shown each sweep, whose client has
    acknowledged nothing for `timeout_s` while bytes wait for it."""

    def __init__(self, timeout_s: float, on_cut: Callable[[], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.cut = 0
        self._on_cut = on_cut
        # transport -> (bytes acknowledged when last seen to move, when that was)
        self._moved: dict[asyncio.Transport, tuple[int, float]] = {}

    def sweep(self, transports: Iterable[asyncio.Transport], now: float) -> None:
        moved: dict[asyncio.Transport, tuple[int, float]] = {}
        for transport in transports:
            if transport.is_closing():
                continue
            sock = transport.get_extra_info("socket")
            state = send_state(sock) if sock is not None else None
            if state is None:
                continue
            waiting, acked = state
            if waiting == 0 and transport.get_write_buffer_size() == 0:
                continue
            last = self._moved.get(transport)
            if last is None or last[0] != acked:
                moved[transport] = (acked, now)
            elif now - last[1] >= self.timeout_s:
                self._cut(transport, sock, waiting)
            else:
                moved[transport] = last
        self._moved = moved

    def _cut(self, transport: asyncio.Transport, sock: SocketLike, waiting: int) -> None:
        self.cut += 1
        if self._on_cut is not None:
            self._on_cut()
        peer = transport.get_extra_info("peername")
        log.warning("closing the connection of %s: it took none of %d bytes for %.0f s "
                    "(server.send_timeout_s)", peer[0] if isinstance(peer, tuple) else "a client",
                    waiting, self.timeout_s)
        with contextlib.suppress(OSError):
            # A reset, not a queue the kernel would go on trying to deliver after the close.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            # Not transport.abort() at once: a response being sent with sendfile(2) has taken
            # the socket from its transport, and would wait forever for a room that an abort
            # never announces. A shut-down socket is writable at once: sendfile fails, and the
            # response ends, releasing its file; a write buffer fails alike.
            sock.shutdown(socket.SHUT_RDWR)
        asyncio.get_running_loop().call_later(ABORT_AFTER_S, transport.abort)

    async def run(self, transports: Callable[[], Iterable[asyncio.Transport]]) -> None:
        """Sweep the connections `transports()` gives, until cancelled."""
        loop = asyncio.get_running_loop()
        interval = sweep_interval(self.timeout_s)
        while True:
            await asyncio.sleep(interval)
            self.sweep(transports(), loop.time())
