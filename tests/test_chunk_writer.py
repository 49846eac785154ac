"""A download's chunks reach its clients from memory before they reach the disk, and the disk
gets them all, in order, with memory bounded (proxy.artifacts.chunk_writer, .flight).

The disk's pace is set by the test: each write waits for the test to let it finish, so what a
reader sees while the disk is behind is checked at each step, not left to timing."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from proxy.artifacts.chunk_writer import Backlog, ChunkWriter
from proxy.artifacts.flight import Flight, FlightReader
from proxy.sources.base import ArtifactMeta
from symbolize.elf import build_id_of_notes, build_id_of_reads
from tests.elfs import ElfSet


class HeldDisk:
    """Writes into `fd` one chunk at a time, each only when the test releases it."""

    def __init__(self, fd: int, flight: Flight) -> None:
        self.fd, self.flight = fd, flight
        self.started: list[int] = []
        self.release = asyncio.Semaphore(0)
        self.fail_at: int | None = None

    async def write(self, chunk: bytes, offset: int) -> None:
        self.started.append(offset)
        await self.release.acquire()
        if offset == self.fail_at:
            raise OSError(28, "No space left on device")
        os.pwrite(self.fd, chunk, offset)
        self.flight.wrote(len(chunk))


@pytest.fixture
def part(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path / "download.part", os.O_RDWR | os.O_CREAT, 0o644)
    yield fd
    os.close(fd)


def started(size: int | None, fd: int) -> Flight:
    flight = Flight(os.dup(fd))
    flight.started(ArtifactMeta("up", size, None, None, None))
    return flight


async def take(chunks: AsyncIterator[bytes | memoryview], wanted: int) -> bytes:
    """Exactly `wanted` bytes from a reader, however they come."""
    out = b""
    while len(out) < wanted:
        out += bytes(await asyncio.wait_for(anext(chunks), 5))
    assert len(out) == wanted
    return out


@pytest.mark.parametrize("announced", [True, False], ids=["size", "no-size"])
async def test_a_reader_that_keeps_up_is_sent_chunks_the_disk_has_not_got(
    part: int, announced: bool
) -> None:
    data = [bytes([i]) * 1000 for i in range(1, 5)]
    total = sum(map(len, data))
    flight = started(total if announced else None, part)
    disk = HeldDisk(part, flight)
    writer = ChunkWriter(disk.write, Backlog(10_000), floor=10_000)
    reader: FlightReader = flight.reader()
    chunks = reader.chunks()
    whole = b"".join(data)
    try:
        offset = 0
        for chunk in data:
            flight.arrived(chunk)
            await writer.put(chunk, offset)  # returns though no write has finished
            offset += len(chunk)
            # Every byte that came so far; but the last one is held back, unverified, where
            # it may be the body's last: no size tells otherwise, or the size is reached.
            limit = offset if announced and offset < total else offset - 1
            sent = reader.pos
            assert await take(chunks, limit - sent) == whole[sent:limit]
        assert flight.written == 0 and disk.started == [0]
        last = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0.05)
        assert not last.done()  # the last byte waits for the verdict
        flight.body_ended()
        flight.succeed()
        assert bytes(await asyncio.wait_for(last, 5)) == whole[-1:]
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(chunks), 5)
        for _ in data:
            disk.release.release()
        await writer.flush()
        assert flight.written == total and disk.started == [0, 1000, 2000, 3000]
        assert os.pread(part, total + 1, 0) == b"".join(data)
    finally:
        reader.close()
        flight.close_fd()


async def test_a_reader_behind_the_disk_reads_the_file_then_memory(part: int) -> None:
    data = [bytes([i]) * 1000 for i in range(1, 5)]
    flight = started(4000, part)
    disk = HeldDisk(part, flight)
    writer = ChunkWriter(disk.write, Backlog(10_000), floor=10_000)
    offset = 0
    for chunk in data:
        flight.arrived(chunk)
        await writer.put(chunk, offset)
        offset += len(chunk)
    disk.release.release()
    disk.release.release()
    while flight.written < 2000:
        await asyncio.sleep(0)
    # A client that joins now: two chunks from the file, two from memory.
    reader = flight.reader()
    try:
        assert await take(reader.chunks(), 3999) == b"".join(data)[:3999]
        # read() spans the two as the verdict reads them.
        assert flight.read(2000, 1000) == data[1] + data[2]
        assert flight.read(10, 3995) == data[3][:5]
    finally:
        reader.close()
        disk.release.release()
        disk.release.release()
        await writer.flush()
        flight.close_fd()


async def test_memory_waiting_for_the_disk_is_bounded(part: int) -> None:
    flight = started(None, part)
    disk = HeldDisk(part, flight)
    writer = ChunkWriter(disk.write, Backlog(2500), floor=0)
    offset = 0
    for _ in range(3):  # 3000 bytes queued: over the limit by the third
        flight.arrived(b"x" * 1000)
        put = asyncio.ensure_future(writer.put(b"x" * 1000, offset))
        offset += 1000
    await asyncio.sleep(0.05)
    assert not put.done()  # the upstream is not read on while 3000 bytes wait
    disk.release.release()
    await asyncio.wait_for(put, 5)
    assert flight.written == 1000
    for _ in range(2):
        disk.release.release()
    await writer.flush()
    assert flight.written == 3000
    flight.close_fd()


async def test_a_failed_write_is_raised_and_what_follows_is_not_written(part: int) -> None:
    flight = started(None, part)
    disk = HeldDisk(part, flight)
    disk.fail_at = 1000
    writer = ChunkWriter(disk.write, Backlog(10_000), floor=10_000)
    for offset in (0, 1000, 2000):
        flight.arrived(b"y" * 1000)
        await writer.put(b"y" * 1000, offset)
    for _ in range(3):
        disk.release.release()
    with pytest.raises(OSError, match="No space"):
        await writer.flush()
    assert disk.started == [0, 1000] and flight.written == 1000
    # The next chunk is refused with the same error, not queued behind it.
    flight.arrived(b"y" * 1000)
    with pytest.raises(OSError, match="No space"):
        await writer.put(b"y" * 1000, 3000)
    writer.abandon()
    assert os.fstat(part).st_size == 1000
    flight.close_fd()


async def test_the_build_id_is_read_from_what_came_disk_or_memory(
    part: int, elfs: ElfSet
) -> None:
    """The verdict of a download does not wait for the disk: the build ID is read across the
    file and the chunks still in memory, and it is the one read from the whole file."""
    body = elfs.big.debug.read_bytes()
    flight = started(len(body), part)
    disk = HeldDisk(part, flight)
    writer = ChunkWriter(disk.write, Backlog(len(body)), floor=len(body))
    step = 256 * 1024
    for offset in range(0, len(body), step):
        flight.arrived(body[offset:offset + step])
        await writer.put(body[offset:offset + step], offset)
    for _ in range(len(body) // step // 2):  # half on disk, half in memory
        disk.release.release()
    while flight.written < len(body) // step // 2 * step:
        await asyncio.sleep(0)
    found = build_id_of_reads(flight.read, flight.received)
    assert found == elfs.big.build_id
    for _ in range(len(body) // step + 1):
        disk.release.release()
    await writer.flush()
    assert build_id_of_notes(part) == found
    flight.close_fd()


async def test_downloads_share_the_backlog_and_each_keeps_its_floor(tmp_path: Path) -> None:
    """One download alone may run far ahead of the disk; beside others, the process's backlog
    bounds them all together, and none waits while its own queue is under its floor (its
    writes go on, so no wait lasts)."""
    backlog = Backlog(3000)
    fds = [os.open(tmp_path / f"{i}.part", os.O_RDWR | os.O_CREAT, 0o644) for i in range(2)]
    flights = [started(None, fd) for fd in fds]
    disks = [HeldDisk(fd, f) for fd, f in zip(fds, flights, strict=True)]
    writers = [ChunkWriter(d.write, backlog, floor=1000) for d in disks]
    try:
        a, b = writers
        for offset in (0, 1000, 2000):  # 3000 bytes held: at the limit, not past it
            flights[0].arrived(b"a" * 1000)
            await asyncio.wait_for(a.put(b"a" * 1000, offset), 5)
        flights[1].arrived(b"b" * 1000)
        await asyncio.wait_for(b.put(b"b" * 1000, 0), 5)  # its floor: room however full
        flights[1].arrived(b"b" * 1000)
        second = asyncio.ensure_future(b.put(b"b" * 1000, 1000))
        flights[0].arrived(b"a" * 1000)
        fourth = asyncio.ensure_future(a.put(b"a" * 1000, 3000))
        await asyncio.sleep(0.05)
        assert not second.done() and not fourth.done()  # 6000 held, both past their floor
        assert backlog.total == 6000
        disks[0].release.release()  # a's first chunk written: 5000 held, still too many
        await asyncio.sleep(0.05)
        assert not second.done() and not fourth.done() and backlog.total == 5000
        for _ in range(2):
            disks[0].release.release()
        await asyncio.wait_for(asyncio.gather(second, fourth), 5)  # 3000 held
        for _ in range(4):
            disks[0].release.release()
            disks[1].release.release()
        for w in writers:
            await w.flush()
        assert backlog.total == 0
        assert [f.written for f in flights] == [4000, 2000]
    finally:
        for flight in flights:
            flight.close_fd()
        for fd in fds:
            os.close(fd)


async def test_an_abandoned_download_leaves_the_backlog(part: int) -> None:
    backlog = Backlog(1 << 20)
    flight = started(None, part)
    disk = HeldDisk(part, flight)
    writer = ChunkWriter(disk.write, backlog, floor=0)
    for offset in (0, 1000):
        flight.arrived(b"z" * 1000)
        await writer.put(b"z" * 1000, offset)
    await asyncio.sleep(0)  # the first write under way, held
    writer.abandon()
    assert backlog.total == 0
    flight.close_fd()
