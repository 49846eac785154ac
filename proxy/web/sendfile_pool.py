"""Cached files sent with sendfile(2) from a small thread pool, off the event loop's thread.

A client that reads as fast as the file comes (kept alive, on the LAN or loopback) takes a
cached file of a few MB in one sendfile(2) call: the kernel's copy and its TCP work, ~1 ms for
the 4.2 MB libc debuginfo here. Made on the loop's thread, that call stalls every other request
of the process meanwhile and holds the process to one core's worth of sending. Made in a
thread, it runs on another core while the loop serves on.

One non-blocking call per response is made there, no more: what the socket cannot take at once
(a slow client) is left to asyncio's loop.sendfile, which waits on the loop for the socket to
be writable, so a client that does not read never holds a thread. The thread works on
duplicates of both descriptors: the response's file or the connection may be closed meanwhile
and their numbers reused, and a duplicate keeps what it names.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

# Sends under way at once, across the process's clients: each is one syscall, mostly kernel
# time, which more threads than cores would only interleave.
THREADS = 2


class SendfilePool:
    def __init__(self, threads: int = THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="symgate-send")

    async def send(self, transport: asyncio.Transport, file: BinaryIO, offset: int,
                   count: int) -> None:
        """`count` bytes of `file` from `offset` to the client, after what the transport has
        written (the response's headers)."""
        loop = asyncio.get_running_loop()
        sent = 0
        sock = transport.get_extra_info("socket")
        # Only with nothing queued on the transport (the thread's bytes must follow the
        # headers, never overtake them), and never under TLS, whose bytes are not the file's.
        if (sock is not None and count and transport.get_write_buffer_size() == 0
                and transport.get_extra_info("sslcontext") is None):
            reading = transport.is_reading()
            if reading:  # nothing the loop reads meanwhile may make it write on this socket
                transport.pause_reading()
            sock_fd, file_fd = os.dup(sock.fileno()), -1
            try:
                file_fd = os.dup(file.fileno())
            except OSError:
                os.close(sock_fd)
                raise
            job = loop.run_in_executor(self._pool, _send_once, sock_fd, file_fd, offset, count)
            try:
                sent = await asyncio.shield(job)
            except asyncio.CancelledError:
                # Cut off mid-response (server stopping): the thread may still be sending, and
                # the response cannot be whole. Closing the connection says so.
                transport.abort()
                raise
            finally:
                if reading and not transport.is_closing():
                    transport.resume_reading()
        if sent < count:
            await loop.sendfile(transport, file, offset + sent, count - sent)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _send_once(sock_fd: int, file_fd: int, offset: int, count: int) -> int:
    """One sendfile(2) on the (non-blocking) socket: the bytes it took, 0 when it took none."""
    try:
        return os.sendfile(sock_fd, file_fd, offset, count)
    except BlockingIOError:
        return 0
    except BrokenPipeError as e:  # as the transport reports a client gone
        raise ConnectionResetError("Connection lost") from e
    finally:
        os.close(sock_fd)
        os.close(file_fd)
