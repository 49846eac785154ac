"""One upstream download shared by every client that wants the same artifact.

The download is written to a temp file; each client reads that file with pread(2) on its own
duplicated descriptor, as far as has been written. Memory stays flat whatever the size.

The last byte is held back from readers until the file has been verified: a client never
receives a complete-looking body that the cache then rejects. If the download fails, readers
raise FlightFailed and cut their response off. Committing the verified file to the cache
(fsync, rename, its SQL row) comes after the last byte is released: clients never wait for it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from enum import Enum

from proxy.errors import SymgateError
from proxy.sources.base import ArtifactMeta

READ_CHUNK = 256 * 1024


class FlightFailed(Exception):
    def __init__(self, error: SymgateError) -> None:
        super().__init__(error.reason)
        self.error = error


class _State(Enum):
    RUNNING = 1
    DONE = 2
    FAILED = 3


class Flight:
    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._fd_open = True
        self.written = 0
        self._state = _State.RUNNING
        self.error: SymgateError | None = None
        self._meta: ArtifactMeta | None = None
        # One future per client waiting for the upstream's headers (see wait_meta).
        self._meta_waiters: list[asyncio.Future[None]] = []
        self._progress = asyncio.Event()
        self._finished = asyncio.Event()
        self._settled = asyncio.Event()
        # The upstream's body has ended: what remains is verification, not more bytes.
        self.received_all = False

    # -- writer side (the fetch task) -----------------------------------------------------------
    def started(self, meta: ArtifactMeta) -> None:
        if self._meta is None and self._state is _State.RUNNING:
            self._meta = meta
            self._release_meta_waiters()

    def wrote(self, n: int) -> None:
        self.written += n
        self._wake()

    def body_ended(self) -> None:
        self.received_all = True
        self._wake()

    def settle(self) -> None:
        """The fetch is over, the file committed to the cache or given up."""
        self._settled.set()

    def succeed(self) -> None:
        self._state = _State.DONE
        self._end()

    def fail(self, error: SymgateError) -> None:
        if self._state is _State.DONE:
            return  # verified and released: what fails after (the commit) is not the clients'
        self._state = _State.FAILED
        self.error = error
        self._release_meta_waiters()
        self._end()

    @property
    def writer_fd(self) -> int:
        return self._fd

    def close_fd(self) -> None:
        """The writer's descriptor; readers hold duplicates and close their own."""
        if self._fd_open:
            os.close(self._fd)
            self._fd_open = False

    def _release_meta_waiters(self) -> None:
        for waiter in self._meta_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._meta_waiters.clear()

    def _wake(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    def _end(self) -> None:
        self._finished.set()
        self._wake()

    # -- reader side (each client) -------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._state is not _State.RUNNING

    @property
    def succeeded(self) -> bool:
        return self._state is _State.DONE

    async def wait_meta(self) -> ArtifactMeta:
        """The upstream's headers once it has answered; raises what the fetch failed with
        before that. Each client waits on a future of its own: one whose client goes away
        cancels nobody else's wait (a shared future would need a shield, and its wake-up then
        takes two steps of the loop, in which the download reads on and the first byte
        waits)."""
        if self._meta is None and self.error is None:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._meta_waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._meta_waiters:
                    self._meta_waiters.remove(waiter)
        if self._meta is not None:
            return self._meta
        assert self.error is not None
        raise self.error

    async def wait_finished(self) -> None:
        await self._finished.wait()

    async def wait_settled(self) -> None:
        """Until the file is in the cache (or will not be): what readers of the cache wait for."""
        await self._settled.wait()

    async def wait_streamable(self) -> None:
        """Until the response can start: the first bytes are in, or the download has ended.

        A body that came whole before its response started (a small file, in one read) waits
        for its verdict too, which is quick, so that its failure reaches the client as a proper
        status line instead of a cut-off body.
        """
        while not self.finished and (self.written == 0 or self.received_all):
            await self._progress.wait()

    def reader(self) -> FlightReader:
        if not self._fd_open:
            raise RuntimeError("flight already closed")
        return FlightReader(self, os.dup(self._fd))


class FlightReader:
    """One client's view of a flight: yields the bytes in order as they become safe to send."""

    def __init__(self, flight: Flight, fd: int) -> None:
        self._flight = flight
        self._fd = fd
        self.pos = 0

    async def chunks(self) -> AsyncIterator[bytes]:
        flight = self._flight
        while True:
            if flight._state is _State.FAILED:
                assert flight.error is not None
                raise FlightFailed(flight.error)
            # Hold one byte back until the file is committed (see the module docstring).
            limit = flight.written if flight.succeeded else flight.written - 1
            if self.pos < limit:
                data = os.pread(self._fd, min(READ_CHUNK, limit - self.pos), self.pos)
                if not data:  # cannot happen while the writer owns the file; never spin
                    raise FlightFailed(SymgateError("cache file shrank while being read"))
                self.pos += len(data)
                yield data
            elif flight.succeeded:
                return
            else:
                await flight._progress.wait()

    @property
    def fd(self) -> int:
        """Its own descriptor of the file: valid until close(), even once the file is unlinked."""
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
