"""One build of a symbol table at a time among the processes on one data dir.

A process that builds a table holds an flock(2) on `<table>.lock`, beside the table, from
before the build until its row is written; another process that needs the same table waits
for that lock rather than building the table again, and then reads the row. The kernel drops
the lock of a process that dies, however it dies: the waiter then builds the table itself.

The holder removes the lock file as it lets go, so none pile up beside the tables (one left by
a killed holder is removed by the next build of that table). A waiter that gets the lock of a
file removed meanwhile opens the path again: only a lock on the file at the path counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from pathlib import Path

from proxy.store.disk import flocked, same_file


class BuildLock:
    """A held lock, until release()."""

    def __init__(self, path: Path, fd: int, *, waited: bool) -> None:
        self.path = path
        self._fd: int | None = fd
        # Whether another process held it first: its build may have made the table meanwhile.
        self.waited = waited

    def release(self) -> None:
        if self._fd is not None:
            _release(self.path, self._fd)
            self._fd = None


def try_acquire(path: Path) -> BuildLock | None:
    """The lock of `path` if no other process holds it; None if one does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _lock(path, blocking=False)
    return BuildLock(path, fd, waited=False) if fd is not None else None


async def wait_for(path: Path) -> BuildLock:
    """The lock of `path`, once the process that holds it lets go."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Waited for in a thread of its own, not the loop's pool: a wait cannot be cancelled, and
    # a process that stops while another builds must not wait for that build to end.
    loop = asyncio.get_running_loop()
    got: asyncio.Future[int] = loop.create_future()

    def hand_over(fd: int | None, error: OSError | None) -> None:
        if got.cancelled():  # the waiter gave up meanwhile
            if fd is not None:
                _release(path, fd)
        elif fd is not None:
            got.set_result(fd)
        else:
            got.set_exception(error or OSError(f"no lock on {path}"))

    def wait() -> None:
        try:
            fd, error = _lock(path, blocking=True), None
        except OSError as e:
            fd, error = None, e
        try:
            loop.call_soon_threadsafe(hand_over, fd, error)
        except RuntimeError:  # the loop is closed: nobody to hand it to
            if fd is not None:
                _release(path, fd)

    threading.Thread(target=wait, name="symgate-build-lock", daemon=True).start()
    return BuildLock(path, await got, waited=True)


def _lock(path: Path, *, blocking: bool) -> int | None:
    """A descriptor holding the lock of the file now at `path`; None if another holds it
    (when not `blocking`)."""
    while True:
        fd = flocked(path, wait=blocking)
        if fd is None:
            return None
        if same_file(fd, path):
            return fd
        os.close(fd)  # its holder removed it as it let go: lock the file there now


def _release(path: Path, fd: int) -> None:
    # Removed while held, so that whoever locks it next knows to open the path again.
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.close(fd)
