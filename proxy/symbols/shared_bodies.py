"""A profile's bytes between a serving process and a worker through memory files (memfd), not
through the pool's pipes.

Through the pipes, the bytes of a /symbolize crossed three times (to scan, to finish, and the
answer back), each time pickled, written a pipe's size at a time, read into a buffer, joined
and unpickled: some 2 ms a megabyte on this machine, 20 ms of a warm profile of 100,000
locations (2.5 MB in, 3.9 MB out) that the rewrite itself does in some 80. Here the serving
process writes the body once into a memfd, which the scan, the check and the finish read, and
gives the finish an empty one to write its answer into: a copy in and a copy out each.

A worker opens the serving process's memfd by /proc/<pid>/fd/<fd> (a worker is no child of
the serving process, so it cannot inherit it). Where that is refused (no memfd, no /proc, a
stricter ptrace policy), `Unshareable` says so once and the bytes go through the pipes again.

The worker's side (`scan`, `check_samples`, `finish`) imports nothing of the server's: the
forkserver preloads it (forkserver_preload.py).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass

from symbolize import worker
from symbolize.rewrite import Report
from symbolize.worker import Answer, Limits, Scanned

# Written at a time: a single call of a gigabyte would hold a buffer of that size twice.
_CHUNK = 1 << 24


class Unshareable(Exception):
    """The worker cannot open the serving process's memory file."""


@dataclass(frozen=True, slots=True)
class SharedBytes:
    """Where bytes are: a memfd of process `pid`, `size` bytes long (or to be written)."""

    pid: int
    fd: int
    size: int
    # The memfd's device and inode: a job of a request that has ended may run after the
    # serving process has closed the descriptor and opened another file under its number,
    # which the job must not read (a file cut short under a mapping is a SIGBUS) or write.
    # The inode alone is not enough: another file system may have a file of the same number.
    identity: tuple[int, int]

    @classmethod
    def of(cls, pid: int, fd: int, size: int) -> SharedBytes:
        return cls(pid, fd, size, _identity(fd))


@dataclass(frozen=True, slots=True)
class Written:
    """A finish's answer: how many bytes it wrote (None: nothing was filled in), its report."""

    size: int | None
    report: Report


def create(name: str) -> int:
    """A new, empty memory file of this process (closed on exec)."""
    return os.memfd_create(name, os.MFD_CLOEXEC)


def write_all(fd: int, data: bytes | memoryview, offset: int = 0) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + _CHUNK], offset + done)


def mapped(fd: int, size: int) -> memoryview:
    """The `size` bytes of memory file `fd`, mapped rather than copied out: an answer of a
    million locations is 39 MB, whose reading back took 15 ms beside the event loop. The
    mapping outlives `fd`, and is gone with the last reference to the view."""
    if size == 0:
        return memoryview(b"")
    if os.fstat(fd).st_size != size:
        raise OSError(f"a memory file said to hold {size} bytes has {os.fstat(fd).st_size}")
    return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))


def _open(ref: SharedBytes, flags: int) -> int:
    try:
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", flags | os.O_CLOEXEC)
    except OSError as e:
        raise Unshareable(f"cannot open the serving process's memory file: {e}") from None
    if _identity(fd) != ref.identity:
        os.close(fd)
        raise OSError(f"descriptor {ref.fd} of process {ref.pid} is another file now: the "
                      "request it was for has ended")
    return fd


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def scan(body: SharedBytes, limits: Limits) -> Scanned:
    """worker.scan of the bytes in `body`; in a worker."""
    with _mapped_body(body) as view:
        return worker.scan(view, limits)


def check_samples(body: SharedBytes, limits: Limits) -> None:
    """worker.check_samples of the bytes in `body`; in a worker."""
    with _mapped_body(body) as view:
        worker.check_samples(view, limits)


def finish(body: SharedBytes, out: SharedBytes, limits: Limits,
           answers: dict[str, Answer]) -> Written:
    """worker.finish of the bytes in `body`, its answer written into `out`; in a worker."""
    fd = _open(out, os.O_WRONLY)  # before the work: refused, it is not done for nothing
    try:
        with _mapped_body(body) as view:
            done = worker.finish(view, limits, answers)
        if done.body is None:
            return Written(None, done.report)
        write_all(fd, done.body)
        return Written(len(done.body), done.report)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _mapped_body(ref: SharedBytes) -> Iterator[memoryview]:
    """The request's bytes, mapped rather than read (a copy of 26 MB took 4.4 ms, and the
    scan and the finish each took one), and unmapped when the job is done with them, whatever
    still refers to the view: a failed job's exception keeps the frames that had it, and the
    pool keeps a worker's last exception until its next."""
    fd = _open(ref, os.O_RDONLY)
    try:
        view = mapped(fd, ref.size)
    finally:
        os.close(fd)
    try:
        yield view
    finally:
        with contextlib.suppress(BufferError):  # something still reads it: it goes with that
            view.release()
