"""How a profile reaches a worker process and comes back: through memory files of the serving
process (proxy/symbols/shared_bodies.py), the same bytes as through the pool's pipes, the
pipes again where a worker cannot open them, and nothing left open after the request; and a
worker's heap trimmed once it idles, not between a request's two jobs."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.config import SymbolizeConfig
from proxy.symbols import shared_bodies, worker_process
from proxy.symbols.shared_bodies import SharedBytes, Unshareable
from proxy.symbols.workers import SymbolizeWorkers, worker_pool
from symbolize.elf import executable_segments
from symbolize.pprof.codec import ProfileError
from symbolize.pprof.profile_pb2 import Profile
from symbolize.symtab import TableSpec, build_symbol_table
from symbolize.worker import Answer, Limits
from tests.elfs import ElfSet
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES

LIMITS = Limits(1 << 30, 16)


@pytest.fixture
async def workers() -> AsyncIterator[SymbolizeWorkers]:
    # This process's memory files are counted: those of an earlier test's garbage (an answer
    # a traceback's cycle still held, say) go first. One still open after this is kept by
    # something alive, and the test fails on it.
    gc.collect()
    cfg = SymbolizeConfig(workers=1, build_workers=1)
    workers = SymbolizeWorkers(cfg, worker_pool(cfg))
    try:
        yield workers
    finally:
        await workers.close()


def _request(elfs: ElfSet, tmp_path: Path) -> tuple[bytes, dict[str, Answer]]:
    prog = elfs.prog
    built = build_symbol_table(prog.debug, tmp_path / "prog.symc", prog.build_id,
                               prog.executable)
    spec = TableSpec(tmp_path / "prog.symc", built.load_address, built.code_ranges,
                     built.cold_ranges, built.has_lines)
    segments = executable_segments(prog.executable, prog.build_id)
    assert segments
    body = make_profile([(place(prog, BASES["prog"]), code_addresses(prog)[:50])]
                        ).SerializeToString()
    return body, {prog.build_id: Answer(spec, segments)}


def _open_memfds() -> list[str]:
    return [target for fd in os.listdir("/proc/self/fd")
            if "symgate-" in (target := _target(fd))]


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


async def test_a_profile_through_memory_files_gives_the_bytes_the_pipes_give(
        workers: SymbolizeWorkers, elfs: ElfSet, tmp_path: Path) -> None:
    body, answers = _request(elfs, tmp_path)
    by_pipes = await workers.finish(body, LIMITS, answers)
    with workers.for_request() as work:
        layouts = (await work.scan(body, LIMITS)).layouts
        assert _open_memfds()  # the body, written once for both jobs
        shared = await work.finish(body, LIMITS, answers)
    assert workers.sharing
    assert layouts == (await workers.scan(body, LIMITS)).layouts == {elfs.prog.build_id: True}
    assert shared.body == by_pipes.body and shared.body is not None
    assert shared.report == by_pipes.report and shared.report.locations_symbolized > 40
    # The body's closed with the request; the answer's is mapped until the answer is gone.
    assert _open_memfds() == ["/memfd:symgate-answer (deleted)"]
    del shared
    assert not _open_memfds()


async def test_a_large_profile_is_written_and_read_beside_the_event_loop(
        workers: SymbolizeWorkers, elfs: ElfSet, tmp_path: Path) -> None:
    body, answers = _request(elfs, tmp_path)
    profile = Profile.FromString(body)
    profile.string_table.append("x" * (5 << 20))  # past what is copied on the event loop
    body = profile.SerializeToString()
    expected = await workers.finish(body, LIMITS, answers)
    with workers.for_request() as work:
        await work.scan(body, LIMITS)
        done = await work.finish(body, LIMITS, answers)
    assert done.body == expected.body and done.body is not None and len(done.body) > 5 << 20
    del done
    assert not _open_memfds()


async def test_nothing_filled_in_comes_back_as_none(
        workers: SymbolizeWorkers, elfs: ElfSet, tmp_path: Path) -> None:
    body, answers = _request(elfs, tmp_path)
    with workers.for_request() as work:
        done = await work.finish(body, LIMITS, {bid: Answer(None) for bid in answers})
    assert done.body is None and not done.report.changed


async def test_where_a_worker_cannot_open_them_the_pipes_carry_the_profile(
        workers: SymbolizeWorkers, elfs: ElfSet, tmp_path: Path) -> None:
    body, answers = _request(elfs, tmp_path)
    expected = await workers.finish(body, LIMITS, answers)
    with workers.for_request() as work:
        # A pid whose memory files no worker can open: as where /proc or ptrace forbids it.
        # (Not os.getpid patched: multiprocessing would take the workers it starts meanwhile
        # for another process's children and never join them.)
        work._pid = 0x3FFFFFFF
        assert (await work.scan(body, LIMITS)).layouts == {elfs.prog.build_id: True}
        done = await work.finish(body, LIMITS, answers)
    assert not workers.sharing  # said once, and not tried again
    assert done.body == expected.body
    with workers.for_request() as work:
        assert (await work.finish(body, LIMITS, answers)).body == expected.body
        assert not _open_memfds()


def test_a_memory_file_that_cannot_be_opened_is_unshareable() -> None:
    with pytest.raises(Unshareable):
        shared_bodies.scan(SharedBytes(0x3FFFFFFF, 3, 10, (0, 0)), LIMITS)


def test_a_job_whose_descriptor_names_another_file_now_leaves_that_file_alone(
        elfs: ElfSet, tmp_path: Path) -> None:
    """A job of a request that has ended may run after the serving process closed its memory
    file and opened another file under the same number: the job refuses it, by its inode,
    rather than read it (a regular file cut short under a mapping would be a SIGBUS) or write
    the answer into it."""
    body, answers = _request(elfs, tmp_path)
    fd = shared_bodies.create("symgate-profile")
    shared_bodies.write_all(fd, body)
    ref = SharedBytes.of(os.getpid(), fd, len(body))
    assert shared_bodies.scan(ref, LIMITS).layouts == {elfs.prog.build_id: True}
    os.close(fd)
    other = tmp_path / "other"
    other.write_bytes(b"\0" * len(body))
    opened = os.open(other, os.O_RDWR)
    if opened != fd:  # the number just closed, as the next open may well take it
        os.dup2(opened, fd)
        os.close(opened)
    reused = fd
    try:
        with pytest.raises(OSError, match="another file now"):
            shared_bodies.scan(ref, LIMITS)
        out = SharedBytes(os.getpid(), reused, 0, ref.identity)
        with pytest.raises(OSError, match="another file now"):
            shared_bodies.finish(ref, out, LIMITS, answers)
        # The same inode number on another file system (the memfd's) is another file too.
        st = os.fstat(reused)
        elsewhere = SharedBytes(os.getpid(), reused, 0, (st.st_dev + 1, st.st_ino))
        with pytest.raises(OSError, match="another file now"):
            shared_bodies.finish(ref, elsewhere, LIMITS, answers)
    finally:
        os.close(reused)
    assert other.read_bytes() == b"\0" * len(body)


def test_a_failed_job_leaves_the_body_unmapped_though_its_exception_lives_on() -> None:
    """A job maps the request's bytes. A failed job's exception keeps the frames that had the
    view (and the pool keeps a worker's last exception until its next): the mapping is let go
    of when the job ends all the same."""
    fd = shared_bodies.create("symgate-profile")
    shared_bodies.write_all(fd, b"not a profile at all")
    ref = SharedBytes.of(os.getpid(), fd, 20)
    try:
        with pytest.raises(ProfileError) as failed:
            shared_bodies.scan(ref, LIMITS)
        assert failed.value.__traceback__ is not None  # the frames are still there
        with open("/proc/self/maps") as f:
            assert not [line for line in f if "symgate-profile" in line]
    finally:
        os.close(fd)


def test_a_worker_trims_its_heap_once_no_job_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[float] = []
    trimmed = threading.Event()

    def trim() -> None:
        trims.append(time.monotonic())
        trimmed.set()

    monkeypatch.setattr(worker_process, "trim", trim)
    monkeypatch.setattr(worker_process, "_TRIM_AFTER_S", 0.3)
    for _ in range(5):  # jobs back to back: the next one comes before any trim
        assert worker_process.run(len, b"abc") == 3
    assert not trims
    started = time.monotonic()
    assert trimmed.wait(5)
    time.sleep(0.5)
    assert len(trims) == 1 and trims[0] - started >= 0.2
