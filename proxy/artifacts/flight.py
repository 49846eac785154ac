"""One upstream download shared by every client that wants the same artifact.

The download is written to a temp file behind the upstream's reads (proxy.artifacts.
chunk_writer). A client that keeps up is sent each chunk from memory as it arrives; one that
falls behind reads the file with pread(2) on its own duplicated descriptor. Memory stays flat
whatever the size: the chunks not on disk yet, within the process's backlog. No client is sent
a byte before the first chunk is on disk, so that a cache that cannot write fails a response
before it starts.

The last byte is held back from readers until the file has been verified: a client never
receives a complete-looking body that the cache then rejects. If the download fails, readers
raise FlightFailed and cut their response off. Committing the verified file to the cache
(fsync, rename, its SQL row) comes after the last byte is released: clients never wait for it.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
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
        # Bytes in the file, and bytes the upstream has sent: those plus the chunks in
        # _unwritten, each at its offset, on their way to the file.
        self.written = 0
        self.received = 0
        self._unwritten: deque[tuple[int, bytes]] = deque()
        self._arrivals = 0  # chunks that came from the upstream (none for a mirror)
        self._state = _State.RUNNING
        self.error: SymgateError | None = None
        # Set when the file failed after the verdict: what followers and readers of the file
        # (rather than of the response) are told.
        self.store_error: SymgateError | None = None
        # Why a file served whole (its part file whole and verified) was not kept: for what
        # waits to read it from the cache (a profile's resolution), a passing want to retry
        # rather than a budget that refuses it. Its followers are told nothing new: the part
        # file they read is whole.
        self.not_kept: SymgateError | None = None
        self._meta: ArtifactMeta | None = None
        # One future per client waiting for the upstream's headers (see wait_meta).
        self._meta_waiters: list[asyncio.Future[None]] = []
        self._progress = asyncio.Event()
        self._finished = asyncio.Event()
        self._settled = asyncio.Event()
        # The upstream's body has ended: what remains is verification, not more bytes.
        self.received_all = False
        # Set before the flight fails for an answer that was not the file (another build ID,
        # not ELF, past its announced or the cache's largest size) where other upstreams are
        # left, which the next fetch asks first (ArtifactService's doubts): a client that got
        # no byte of it asks again at once rather than take the failure. The name of the
        # upstream that answered so, which followers in other processes are told (board).
        self.lied: str | None = None
        # The names of the sources the request that started the fetch asks (the request's,
        # known misses among them); None where every joiner's answer is its answer (a copy of
        # an upload, another process's fetch followed). See ArtifactService._answers.
        self.asking: frozenset[str] | None = None

    # -- writer side (the fetch task) -----------------------------------------------------------
    def started(self, meta: ArtifactMeta) -> None:
        if self._meta is None and self._state is _State.RUNNING:
            self._meta = meta
            self._release_meta_waiters()

    @property
    def size(self) -> int | None:
        """The size the upstream announced, which the writer never lets the body pass."""
        return self._meta.size if self._meta is not None else None

    def arrived(self, chunk: bytes) -> None:
        """The next chunk of the body, readable from memory until wrote() says it is on disk."""
        self._unwritten.append((self.received, chunk))
        self._arrivals += 1
        self.received += len(chunk)
        self._note_whole()
        self._wake()

    def wrote(self, n: int) -> None:
        """`n` more bytes are in the file, in order. A mirror of another process's fetch learns
        of its bytes this way alone: they count as received too."""
        first = self.written == 0
        self.written += n
        unwritten = self._unwritten
        while unwritten and unwritten[0][0] + len(unwritten[0][1]) <= self.written:
            unwritten.popleft()
        if self.written > self.received:
            self.received = self.written
            self._note_whole()
            self._wake()
        elif first:
            self._wake()  # responses wait for the first bytes on disk (wait_streamable)

    def _note_whole(self) -> None:
        """All the announced bytes are in: what remains is the verdict, which a response not
        started yet waits for (wait_streamable), however many steps of the loop it takes."""
        if self.size is not None and self.received >= self.size:
            self.received_all = True

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
            # Verified and released: what fails after (the last writes, the commit) is not
            # its clients', who have their bytes; but the file did not make it.
            self.store_error = error
            return
        self._state = _State.FAILED
        self.error = error
        # Never to be read now (a failed flight's readers raise): let go at once. Whatever
        # still holds the flight (its error's traceback holds the fetch's frames, which hold
        # the flight: a cycle only a full collection frees, many seconds later) would
        # otherwise hold up to the whole backlog of a download cut off, 32 MiB each.
        self._unwritten.clear()
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
        """Until the response can start: the first bytes are on disk (so that a cache that
        cannot write fails the response before its status line), or the download has ended.

        A body that came whole before its response started (a small file, in one read) waits
        for its verdict too, which is quick, so that its failure reaches the client as a proper
        status line instead of a cut-off body. Without an announced size, a first chunk may be
        the whole body: its response starts with the second chunk, or the verdict.
        """
        # Of unknown size, one chunk may be the whole body: wait for a second, or the end.
        while not self.finished and (self.written == 0 or self.received_all
                                     or (self.size is None and self._arrivals == 1)):
            await self._progress.wait()

    async def wait_past(self, n: int) -> None:
        """Until more than `n` bytes came, or the download ended."""
        while not self.finished and self.received <= n:
            await self._progress.wait()

    def read(self, size: int, offset: int) -> bytes:
        """Up to `size` bytes at `offset` of what came so far: from the file as far as it is
        written, the rest from the chunks still in memory."""
        end = min(offset + size, self.received)
        parts: list[bytes] = []
        while offset < end and (piece := self._piece(self._fd, offset, end)):
            parts.append(bytes(piece))
            offset += len(piece)
        return b"".join(parts)

    def _piece(self, fd: int, pos: int, limit: int) -> bytes | memoryview:
        """The next bytes from `pos` up to `limit` (at most what was received): from the
        file on `fd` while `pos` is written (READ_CHUNK at most), else from memory."""
        if pos < self.written:
            return os.pread(fd, min(limit, self.written, pos + READ_CHUNK) - pos, pos)
        return self._unwritten_at(pos, limit)

    def _unwritten_at(self, pos: int, limit: int) -> memoryview:
        """Bytes from `pos` (not yet in the file) up to `limit`, from the chunk holding them."""
        for offset, chunk in self._unwritten:
            if offset <= pos < offset + len(chunk):
                return memoryview(chunk)[pos - offset:limit - offset]
        raise RuntimeError(f"byte {pos} is neither in the file nor in memory")

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

    async def chunks(self) -> AsyncIterator[bytes | memoryview]:
        flight = self._flight
        while True:
            if flight._state is _State.FAILED:
                assert flight.error is not None
                raise FlightFailed(flight.error)
            # Hold the last byte back until the file is verified (see the module docstring):
            # the last of the announced size, or of what came so far where none was.
            size = flight.size
            limit = flight.received if flight.succeeded or (
                size is not None and flight.received < size) else flight.received - 1
            if self.pos < limit:
                data = flight._piece(self._fd, self.pos, limit)
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
