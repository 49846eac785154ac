"""How a cached file leaves with sendfile(2), on aiohttp's path (proxy.web.artifacts) and on
the quick one (proxy.web.connections) alike: corked from its head to its last byte (but a
range's or a conditional request's, which FileResponse heads), and a file shorter than its
index entry cut, never ended as a short body."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import struct
import termios
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
_OUTQ = struct.Struct("i")  # SIOCOUTQ's answer (Linux's TIOCOUTQ on a socket)


def cork(sock: socket.socket | None, on: bool = True) -> None:
    """TCP_CORK on (or off) a TCP socket; nothing on another (a Unix socket), a kernel
    without it, or a socket gone already."""
    if _TCP_CORK is not None and sock is not None:
        # Refused on a socket of another kind: asking its family first (an enum made at
        # every call) cost more than the option itself, twice a response.
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_CORK, int(on))


_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST, not FIN


def cut_connection(transport: asyncio.Transport) -> None:
    """Close a connection whose response is cut short with a TCP reset, not a FIN: libcurl
    takes a FIN before the body's end for CURLE_PARTIAL_FILE, which elfutils' client counts as
    "not found" and keeps in its cache as a miss for cache_miss_s (10 minutes), while a reset
    (CURLE_RECV_ERROR) is an error it retries and never caches."""
    reset_on_close(transport.get_extra_info("socket"))
    transport.abort()


def reset_on_close(sock: socket.socket | None) -> None:
    """Have the socket's close, whoever makes it (aiohttp's, or the process's exit), send a
    reset and drop what its buffer still holds: the end of a response cut short."""
    if sock is not None:
        with contextlib.suppress(OSError):  # a socket gone already, or not TCP's
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)


class ShortFile(ConnectionResetError):
    """The cached file holds fewer bytes than its index entry (damaged from outside): the
    response is cut, as for a client gone."""


async def send_whole(transport: asyncio.Transport, file: IO[bytes], size: int, name: str, *,
                     fallback: bool = True, offset: int = 0) -> None:
    """The first `size` bytes of `file` from `offset` (those before it went out already),
    after what `transport` sent so far (its head, corked by the caller), with sendfile(2), then
    uncorked; raises what the send failed with, or ShortFile."""
    sock = transport.get_extra_info("socket")
    cork(sock)
    try:
        if offset and sock is not None:
            # After a send_at_once that filled the buffer: loop.sendfile's first call must
            # find room (_writable).
            await _writable(transport, sock)
        sent = offset + await asyncio.get_running_loop().sendfile(
            transport, file, offset, size - offset, fallback=fallback)
    finally:
        cork(sock, on=False)  # the tail goes now, and a next response on the connection too
    if sent != size:
        _cut_short(name, sent, size)


async def send_part(transport: asyncio.Transport, file: IO[bytes], offset: int, count: int,
                    name: str) -> None:
    """`count` bytes of `file` from `offset` (a range of it, or all), after what `transport`
    sent so far, with sendfile(2), as FileResponse sends them; raises what the send failed
    with, or ShortFile: FileResponse ends its response however few bytes loop.sendfile sent,
    and a file cut short from outside while it went out was a short body on a kept-alive
    connection, the next response's head read by the client as the rest of this one."""
    sent = await asyncio.get_running_loop().sendfile(transport, file, offset, count)
    if sent != count:
        _cut_short(name, offset + sent, offset + count)


async def send_file(transport: asyncio.Transport, file: IO[bytes], size: int, name: str, *,
                    fallback: bool = True) -> None:
    """send_whole, with what the socket's send buffer has room for sent at once first
    (send_if_room)."""
    sent = send_if_room(transport, file, size, name)
    if sent != size:
        await send_whole(transport, file, size, name, fallback=fallback, offset=sent)


def send_if_room(transport: asyncio.Transport, file: IO[bytes], size: int, name: str) -> int:
    """send_at_once where nothing waits in the transport's buffer and the socket's has room
    for the whole file (else none is sent); uncorked once all went. Raises as send_at_once.

    Only where it has room for it all: a client that reads nothing then fills the buffer once
    and what continues (send_whole) waits first, not on asyncio's first sendfile(2), whose
    failure asyncio reports as "sendfile not available" (_writable)."""
    sock = transport.get_extra_info("socket")
    sent = 0
    if size and sock is not None and not transport.get_write_buffer_size() \
            and size <= room_for(sock):
        sent = send_at_once(sock, file, size, name)
    if sent == size:  # an empty file too: nothing to wait for
        cork(sock, on=False)  # the tail goes now, and a next response on the connection too
    return sent


def room_for(sock: socket.socket) -> int:
    """How many bytes the socket's send buffer takes now: its size less what it still holds
    (sent and not acknowledged, or not sent yet); 0 where that cannot be told."""
    try:
        size = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        held = _OUTQ.unpack(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(_OUTQ.size)))[0]
    except OSError:
        return 0
    return int(size) - int(held)


def send_at_once(sock: socket.socket, file: IO[bytes], size: int, name: str) -> int:
    """As many of the first `size` bytes of `file` as the socket (non-blocking) takes in one
    sendfile(2): how many, the file's position left past them, as asyncio's sendfile leaves
    it. Raises what sendfile(2) failed with but EAGAIN, or ShortFile.

    A kept-alive loopback or LAN client's send buffer takes a 4.2 MB file at once: sent
    here, it needs no task, no paused reading and no writer registered, as loop.sendfile sets
    up for any. One call, as asyncio makes one a turn of the loop: a bigger file's rest waits
    its turn. The quick path's 4.2 MB hit (bench/hit_ab.py, one worker, medians of six
    interleaved rounds): 675 against 613 req/s (0.95x nginx's rate against 0.87x), server CPU
    1.40 against 1.54 ms a response."""
    sent = 0
    try:
        sent = os.sendfile(sock.fileno(), file.fileno(), 0, size)
        if sent == 0 and size:
            _cut_short(name, 0, size)
    except BlockingIOError:
        pass
    file.seek(sent)
    return sent


async def _writable(transport: asyncio.Transport, sock: socket.socket) -> None:
    """Until the socket has room again; raises the error that ended the connection instead.

    asyncio's sendfile reports a failure of its first sendfile(2) as "sendfile not available"
    (its fallback, or a RuntimeError): after a send_at_once that sendfile(2) took only part
    of (room_for counts the buffer's own overhead as room), a first call that waited for a
    client that stopped reading would hide the kernel's cut of it (ETIMEDOUT: send_timeout.py)
    from the count. Waited for on a duplicate of the descriptor: the loop lets no other
    watcher on a transport's own."""
    loop = asyncio.get_running_loop()
    fd = os.dup(sock.fileno())
    try:
        ready: asyncio.Future[None] = loop.create_future()

        def woken() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_writer(fd, woken)
        try:
            await ready
        finally:
            loop.remove_writer(fd)
    finally:
        os.close(fd)
    if error := sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
        raise OSError(error, os.strerror(error))
    if transport.is_closing():  # a read that saw the error first: the protocol was told
        raise ConnectionResetError("Connection lost")


def _cut_short(name: str, sent: int, size: int) -> None:
    log.warning("cached %s is shorter than its index entry (%d of %d bytes); its response "
                "was cut", name, sent, size)
    raise ShortFile("cached file shorter than its index entry")
