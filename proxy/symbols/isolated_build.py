"""A symbol-table build in a child of its worker process: what a hostile file does to the build
(libdw or symbolic crashing on it, a loop that never ends, an allocation that takes all the
memory there is) ends that child alone, and is the file's outcome, `malformed`, remembered.

Run in the worker, a build that crashed killed the worker, and with it its whole pool: every
profile in work then failed with WorkerLost (503), the build ID was never remembered, and the
next profile that named it built it again, and killed the pool again (symbolic aborts on a
zlib section whose header claims 2^48 bytes). A build that never ended held its worker slot for
good. A child killed with SIGKILL (by the OOM killer, whose first choice it is) still fails
its own profiles alone, with WorkerLost.

The child is a fork of the worker (which runs no event loop, and has imported everything a
build needs), kept for the builds that follow and made again after one that ended it. A fork
per build cost 5-6 ms of page copies a build (Python's reference counts write to every page of
objects it touches): 0.2 s more for a cold profile of 30 small programs, which waited 0.67 s
against 0.47. A child's answers come back over a pipe, framed by their length.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import select
import signal
import struct
import time
from pathlib import Path
from typing import Any

from proxy.errors import BuildBoundTooLow, WorkerLost
from proxy.symbols import worker_process
from symbolize.parse_memory import mapped_bytes
from symbolize.symtab import BuildResult, MalformedObject, NoSymbols, build_symbol_table

# The kernel's OOM killer takes the child first, not the worker or the server beside it.
_OOM_FIRST = b"1000"
# What a child's build raised that the worker re-raises as it is; anything else that
# unpickles is re-raised too, and one that does not (symbolic's) is a MalformedObject.
_KNOWN = (NoSymbols, MalformedObject, OSError, WorkerLost, BuildBoundTooLow)
_TIMEOUT = b"timeout"  # _read's answer for a child killed for its time: no pickle is that
_FRAME = struct.Struct("<Q")  # a message's length, before it
# Sent by the child as it takes a build, before its answer: a child killed between two builds
# (its pipe still takes the next request) is told apart from one killed by the build.
_TAKEN = b"\x01"
_GONE = b"gone"  # _read's answer for a child that ended before it took the build


class _Child:
    """The builder child of this worker: its pid, the pipes to it and back, and the memory
    bound it was made with."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        parent = os.getpid()
        to_child, self._requests = os.pipe()
        self._answers, from_child = os.pipe()
        try:
            self.pid = os.fork()
        except BaseException:
            for fd in (to_child, self._requests, self._answers, from_child):
                os.close(fd)
            raise
        if self.pid == 0:  # pragma: no cover (the child: its answers are read below)
            os.close(self._requests)
            os.close(self._answers)
            _serve(to_child, from_child, parent, memory_bytes)
        os.close(to_child)
        os.close(from_child)

    def ask(self, request: bytes, timeout_s: float) -> bytes:
        """The answer to `request` (b"" if the child ended without one), or _TIMEOUT once
        the child was killed for taking too long. BrokenPipeError: it had ended before it
        was asked (killed from outside between two builds)."""
        _write_all(self._requests, _FRAME.pack(len(request)) + request)
        answer = _read(self._answers, self.pid, timeout_s)
        if answer is _GONE:
            raise BrokenPipeError("the builder ended before it took the build")
        return answer

    def end(self) -> int:
        """Kill it (if need be) and reap it: its wait status."""
        for fd in (self._requests, self._answers):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        _, status = os.waitpid(self.pid, 0)
        return status


_child: _Child | None = None  # this worker's, made by its first build


def build(timeout_s: float, memory_bytes: int, source: Path, out: Path, build_id: str,
          executable: Path | None = None, supplement: Path | None = None) -> BuildResult:
    """build_symbol_table in this worker's builder child, which is killed past `timeout_s`
    (0: never) and may map at most `memory_bytes` (0: no bound); blocking. A child that
    crashes, takes too long or runs out of memory: MalformedObject; one killed by another
    (SIGKILL): WorkerLost."""
    global _child
    if _child is not None and _child.memory_bytes != memory_bytes:
        _child.end()
        _child = None
    request = pickle.dumps((source, out, build_id, executable, supplement))
    for _attempt in range(2):
        child = _child = _child or _Child(memory_bytes)
        try:
            answer = child.ask(request, timeout_s)
            break
        except BrokenPipeError:
            _child = None  # it was gone before this build: another one takes it
            child.end()
        except BaseException:
            _child = None
            child.end()
            raise
    else:
        raise WorkerLost(f"{source.name}: its build process would not start; try again")
    if answer and answer is not _TIMEOUT:
        kind, value, last = pickle.loads(answer)
        if last:  # it answered, and ended: made again for the next build
            _child = None
            child.end()
        if kind == "ok":
            assert isinstance(value, BuildResult)
            return value
        raise value
    # It ended, or was ended, without an answer: by how.
    _child = None
    status = child.end()
    _remove_temps(out, child.pid)
    if answer is _TIMEOUT:
        raise MalformedObject(f"{source.name}: its build took longer than {timeout_s:g} s")
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        # The OOM killer (or an operator): the machine's passing trouble as likely as the
        # file's, so the profile is refused and the build made again, as when a worker dies.
        # build_memory_bytes makes the file's own hunger its outcome.
        raise WorkerLost(f"{source.name}: its build process was killed; try again")
    if os.WIFSIGNALED(status):  # a crash in native code (libdw, symbolic) on the file
        raise MalformedObject(f"{source.name}: its build died of signal "
                              f"{_signal_name(os.WTERMSIG(status))}")
    raise MalformedObject(f"{source.name}: its build ended without an answer "
                          f"(status {os.waitstatus_to_exitcode(status)})")


def _remove_temps(out: Path, pid: int) -> None:
    """What a killed child left beside the table: its half-written table and its copies of
    the source (`<build ID>.[<part>.]<pid>.tmp`), which may be hundreds of MB inflated."""
    for temp in out.parent.glob(f"{out.stem}.*.tmp"):
        if temp.name.split(".")[-2] == str(pid):
            temp.unlink(missing_ok=True)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # a real-time signal
        return str(number)


def _read(reader: int, pid: int, timeout_s: float) -> bytes:
    """One framed answer from the child (b"" if it ended first), or _TIMEOUT once it was
    killed for taking too long."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    got = bytearray()
    want: int | None = None
    while want is None or len(got) < want + len(_TAKEN):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return _TIMEOUT
        ready, _, _ = select.select([reader], [], [], left)
        if not ready:
            continue
        chunk = os.read(reader, 1 << 16)
        if not chunk:
            return b"" if got else _GONE
        got += chunk
        if want is None and len(got) >= len(_TAKEN) + _FRAME.size:
            want = _FRAME.size + _FRAME.unpack_from(got, len(_TAKEN))[0]
    return bytes(got[len(_TAKEN) + _FRAME.size:])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, size: int) -> bytes | None:
    """`size` bytes from `fd`; None where it ends first."""
    got = bytearray()
    while len(got) < size:
        chunk = os.read(fd, size - len(got))
        if not chunk:
            return None
        got += chunk
    return bytes(got)


def _serve(requests: int, answers: int, parent: int,
           memory_bytes: int) -> None:  # pragma: no cover (runs in the child)
    """Build what the worker asks, one after another, until it closes the pipe."""
    try:
        worker_process.die_with_parent(parent)
        worker_process.name_process("symgate-builder")
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "wb") as f:
            f.write(_OOM_FIRST)
        too_low = None
        if memory_bytes and memory_bytes <= (mapped := mapped_bytes()):
            # A bound this process is past already failed every build's first allocation,
            # and each file was remembered as malformed (for malformed_retry_s, a day, past
            # the operator's fix of the setting): said instead, and no file blamed.
            too_low = BuildBoundTooLow(
                f"symbolize.build_memory_bytes ({memory_bytes} bytes) is less than a build "
                f"process maps before it builds anything ({mapped} bytes): no symbol table "
                "can be built; raise it, or make it 0 (no bound)")
        elif memory_bytes:
            # Within the hard limit the server was started under (systemd's LimitAS=, ulimit
            # -v), which binds it anyway: past it, setrlimit raised, this child ended before
            # it took any build, and every profile that needed one was refused (503) for good.
            hard = resource.getrlimit(resource.RLIMIT_AS)[1]
            bound = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
            resource.setrlimit(resource.RLIMIT_AS, (bound, bound))
        while (head := _read_exactly(requests, _FRAME.size)) is not None:
            body = _read_exactly(requests, _FRAME.unpack(head)[0])
            if body is None:
                break
            _write_all(answers, _TAKEN)
            source, out, build_id, executable, supplement = pickle.loads(body)
            last = False
            try:
                if too_low is not None:
                    raise too_low
                answer: tuple[str, Any] = ("ok", build_symbol_table(
                    source, out, build_id, executable, supplement))
            except MemoryError:
                answer = ("error", MalformedObject(
                    f"{source.name}: its build needs more than {memory_bytes} bytes of memory"))
                last = True  # what is left of its heap is not to be built in again
            except Exception as e:
                answer = ("error", _portable(e, source))
            if _size(source) >= _TRIM_FROM:
                # What a big file's build took goes back to the system, as the worker's own
                # heap does after its jobs (worker_process): this child lives on, idle.
                worker_process.trim()
            # Past half its bound, the heap that builds left behind would fail the next
            # build's allocations, not the file's own: made again for it.
            last = last or bool(memory_bytes and mapped_bytes() > memory_bytes // 2)
            data = pickle.dumps((*answer, last))
            _write_all(answers, _FRAME.pack(len(data)) + data)
            if last:
                break
    finally:
        os._exit(0)


# A source past this size leaves a heap worth trimming (libc's debug file: some 150 MB).
_TRIM_FROM = 1 << 20


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _portable(error: Exception, source: Path) -> Exception:
    """`error`, if the worker (and the server after it) can unpickle it as it is."""
    if isinstance(error, _KNOWN):
        return error
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return MalformedObject(f"{source.name}: {type(error).__name__}: {error}")
    return error
