"""Clients that stop reading: the kernel closes a client connection on which bytes sent stay
unacknowledged for server.send_timeout_s (TCP_USER_TIMEOUT), as nginx's send_timeout closes
one; here, that is counted and logged.

A client that starts a response and never reads it would otherwise hold its connection (one of
server.max_connections) and, for a cached file, the file's lease, which keeps it from
eviction, for as long as it stayed connected. The kernel's timer runs while data are in flight
and while the client's window stays shut (its zero-window probes count too, on the kernels
tests/test_send_timeout.py runs on), and is reset by every acknowledgement: a client is cut
when it takes nothing for that long, whatever the response and wherever its bytes wait,
asyncio's buffer, a socket that asyncio is closing, or a sendfile(2) waiting for room, which
the error then wakes. It costs one setsockopt a connection. A sweep of every connection's
TCP_INFO from the loop, tried first, cost ~3.4 us a connection a sweep and missed the
connections asyncio was closing with bytes still in its buffer.

A reader is cut only if it frees no room in a whole timeout: its kernel reopens the window a
segment or more at a time, so one that reads a few bytes a second can be.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)
# Linux's option number, named in socket where the platform has it.
_TCP_USER_TIMEOUT: int | None = getattr(socket, "TCP_USER_TIMEOUT", None)
# Its value is a C int of milliseconds: some 24.8 days, as good as never, is the most it takes.
_LONGEST_MS = 2**31 - 1


class SocketLike(Protocol):
    """What asyncio's transports give as their "socket" (asyncio.trsock.TransportSocket)."""

    @property
    def family(self) -> int: ...

    def setsockopt(self, level: int, option: int, value: int) -> None: ...


def limit_unacknowledged(sock: SocketLike, timeout_s: float) -> None:
    """Have the kernel close `sock` once bytes sent on it stay unacknowledged `timeout_s`."""
    if _TCP_USER_TIMEOUT is None or timeout_s <= 0 \
            or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):  # a socket gone already: nothing to watch
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_USER_TIMEOUT,
                        min(max(1, round(timeout_s * 1000)), _LONGEST_MS))


def is_send_timeout(error: BaseException | None) -> bool:
    """Whether `error` is how the kernel's closing of such a connection surfaced."""
    return isinstance(error, OSError) and error.errno == errno.ETIMEDOUT


class SendTimeouts:
    """The connections closed so: counted (`count`, a metric's inc) and logged."""

    def __init__(self, timeout_s: float, count: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self._count = count

    def note(self, peer: str | None) -> None:
        self._count()
        log.warning("closed the connection of %s: it took none of the bytes sent to it for "
                    "%g s (server.send_timeout_s)", peer or "a client", self.timeout_s)
