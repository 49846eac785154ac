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
build needs): some milliseconds, against the 3 ms to 0.25 s a build takes.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import select
import signal
import time
from pathlib import Path

from proxy.errors import WorkerLost
from proxy.symbols import worker_process
from symbolize.symtab import BuildResult, MalformedObject, NoSymbols, build_symbol_table

# The kernel's OOM killer takes the child first, not the worker or the server beside it.
_OOM_FIRST = b"1000"
# What a child's build raised that the worker re-raises as it is; anything else that
# unpickles is re-raised too, and one that does not (symbolic's) is a MalformedObject.
_KNOWN = (NoSymbols, MalformedObject, OSError, WorkerLost)
_TIMEOUT = b"timeout"  # _read's answer for a child killed for its time: no pickle is that


def build(timeout_s: float, memory_bytes: int, source: Path, out: Path, build_id: str,
          executable: Path | None = None, supplement: Path | None = None) -> BuildResult:
    """build_symbol_table in a child, which is killed past `timeout_s` (0: never) and may map
    at most `memory_bytes` (0: no bound); blocking. A child that crashes, takes too long or
    runs out of memory: MalformedObject; one killed by another (SIGKILL): WorkerLost."""
    parent = os.getpid()
    reader, writer = os.pipe()
    try:
        pid = os.fork()
    except BaseException:
        os.close(reader)
        os.close(writer)
        raise
    if pid == 0:  # pragma: no cover (the child; its outcome is read below)
        os.close(reader)
        _child(writer, parent, memory_bytes, source, out, build_id, executable, supplement)
    os.close(writer)
    try:
        answer = _read(reader, pid, timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(reader)
        _, status = os.waitpid(pid, 0)
    # By how it ended first: a child killed as it wrote its answer sent part of one.
    if answer is _TIMEOUT or not os.WIFEXITED(status) or os.WEXITSTATUS(status) \
            or not answer:
        _remove_temps(out, pid)
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
    if os.WEXITSTATUS(status) or not answer:
        raise MalformedObject(f"{source.name}: its build ended without an answer "
                              f"(status {os.waitstatus_to_exitcode(status)})")
    kind, value = pickle.loads(answer)
    if kind == "ok":
        assert isinstance(value, BuildResult)
        return value
    raise value


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
    """The child's whole answer (b"" if it sent none), or _TIMEOUT once it was killed for
    taking too long."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    chunks: list[bytes] = []
    while True:
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
            return b"".join(chunks)
        chunks.append(chunk)


def _child(writer: int, parent: int, memory_bytes: int, source: Path, out: Path, build_id: str,
           executable: Path | None, supplement: Path | None) -> None:  # pragma: no cover
    try:
        worker_process.die_with_parent(parent)
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "wb") as f:
            f.write(_OOM_FIRST)
        if memory_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        try:
            answer = pickle.dumps(("ok", build_symbol_table(source, out, build_id, executable,
                                                            supplement)))
        except MemoryError:
            answer = pickle.dumps(("error", MalformedObject(
                f"{source.name}: its build needs more than {memory_bytes} bytes of memory")))
        except Exception as e:
            answer = pickle.dumps(("error", _portable(e, source)))
        view = memoryview(answer)
        while view:
            view = view[os.write(writer, view):]
    finally:
        os._exit(0)


def _portable(error: Exception, source: Path) -> Exception:
    """`error`, if the worker (and the server after it) can unpickle it as it is."""
    if isinstance(error, _KNOWN):
        return error
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return MalformedObject(f"{source.name}: {type(error).__name__}: {error}")
    return error
