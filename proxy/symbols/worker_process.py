"""What runs in a worker process before its first job: it dies with the server, however the
server dies, and yields the CPU to the server's event loop.

A worker's parent is the forkserver, not the server, so it watches the server's pid itself (a
pidfd), and takes the parent-death signal for the forkserver. Once the workers are gone, the
forkserver and the resource tracker see their pipes close and exit too: a SIGKILLed server
leaves nothing behind.

This module is loaded by the forkserver (through forkserver_preload) and by the server, which
names `init` as the pools' initializer: it imports nothing of the server's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from symbolize.parse_memory import bound_parses

T = TypeVar("T")
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
# Workers yield the CPU to the server's event loop: on a machine whose cores they fill, a
# /buildid hit still gets its share at once (CFS weight 1024 against 335).
_NICENESS = 5
_LIBC = ctypes.CDLL(None, use_errno=True)


def init(server_pid: int, then: Callable[..., None] | None, args: tuple[Any, ...]) -> None:
    """A ProcessPoolExecutor initializer: die with the server, lower the priority, then
    `then(*args)`."""
    # A terminal's Ctrl-C or hangup reaches every process of its foreground group: the server
    # drains then, and the work under way must finish, not die with a KeyboardInterrupt (a
    # 503 for the profile the drain waits for). Workers end with the server (_die_with).
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    _die_with(server_pid)
    name_process("symgate-worker")
    with contextlib.suppress(OSError):
        os.nice(_NICENESS)
    _trimmer.start()
    # One job at a time, beside threads that map nothing of note: its parses of a client's
    # bytes can be bounded (a profile of millions of empty entries is a 422, not gigabytes).
    bound_parses()
    if then is not None:
        then(*args)


def name_process(name: str) -> None:
    """What top and ps -o comm show for this process (15 bytes at most): the workers and the
    helpers have the command line of the process they were forked from."""
    with contextlib.suppress(OSError, AttributeError):
        _LIBC.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _die_with(server_pid: int) -> None:
    """Kill this process when the server or the forkserver (its parent) exits."""
    with contextlib.suppress(OSError, AttributeError):
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        pidfd = os.pidfd_open(server_pid)
    except ProcessLookupError:  # gone before this worker started
        os._exit(1)
    except OSError:  # no pidfd (Linux before 5.3): look every second instead
        threading.Thread(target=_poll, args=(server_pid,), daemon=True).start()
        return
    threading.Thread(target=_watch, args=(pidfd,), daemon=True).start()


def die_with_parent(parent: int) -> None:
    """Kill this process, forked from `parent`, when that one exits (or has already)."""
    with contextlib.suppress(OSError, AttributeError):
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _watch(pidfd: int) -> None:
    select.select([pidfd], [], [])  # readable once the process has exited
    os.kill(os.getpid(), signal.SIGKILL)


def _poll(pid: int) -> None:
    while True:
        time.sleep(1)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGKILL)


def ready() -> None:
    """A job that does nothing: run once, the worker is up."""


def run(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, and once no job has followed it for a moment, the heap it freed given back
    to the system: a build of libc's table leaves some 35 MB free in glibc's heap, which would
    count as the worker's until it exits.

    Not at once after every job: the next job's arrays would take those pages back from the
    kernel one fault at a time. A trim after every job cost a warm profile of 100,000
    locations some 10,000 page faults in its finish (and its scan's too), 20 ms of 80-90.
    """
    _trimmer.job_started()
    try:
        return fn(*args)
    finally:
        _trimmer.job_done()


# The heap is trimmed once no job has come for this long (a /symbolize's scan and finish, and
# profiles sent back to back, come sooner).
_TRIM_AFTER_S = 1.0


class _Trimmer:
    """One thread per worker that trims the heap `_TRIM_AFTER_S` after the last job ended,
    unless another has started since. A job only sets a time and notifies: no thread is
    started per job (a start waits for the thread to run, which a loaded machine makes long)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._due: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._changed:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="symgate-trim",
                                                daemon=True)
                self._thread.start()

    def job_started(self) -> None:
        with self._changed:
            self._due = None

    def job_done(self) -> None:
        self.start()  # started by `init` in a worker; here for a process that ran no init
        with self._changed:
            self._due = time.monotonic() + _TRIM_AFTER_S
            self._changed.notify()

    def _run(self) -> None:
        while True:
            with self._changed:
                while self._due is None or (left := self._due - time.monotonic()) > 0:
                    self._changed.wait(None if self._due is None else left)
                self._due = None
            trim()  # outside the lock: a job that starts meanwhile does not wait for it


_trimmer = _Trimmer()


def trim() -> None:
    """Give the heap's free memory back to the system (glibc)."""
    with contextlib.suppress(AttributeError):  # not glibc
        _LIBC.malloc_trim(0)
