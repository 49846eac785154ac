"""multiprocessing's forkserver and resource tracker for `symgate serve --workers N`, forked
from the supervisor once, instead of started as new interpreters by each serving process.

Started afresh, each serving process's forkserver imports what the workers run (numpy,
protobuf, symbolic) before its first worker can be forked: seconds on a loaded machine, which
the first profile after a start waits for, and with its resource tracker and worker some
55 MiB per serving process. Forked from the supervisor, which has imported all that and frozen
it (gc.freeze) before forking the serving processes, the helpers and every worker forked from
them share the supervisor's pages: one forkserver and one tracker for the whole server, and a
worker that is a fork away (milliseconds), costing the memory it writes to.

The supervisor is single-threaded and runs no event loop when it forks them, which is what
the forkserver exists to guarantee. The parts of multiprocessing set here are private but
stable since 3.8 (what its own tests and executors.py use): where they differ, nothing is
forked and each serving process starts its own helpers, as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from multiprocessing import connection, forkserver, resource_tracker, util
from typing import Any

from proxy.symbols import worker_process

# pids of the helpers this process (the supervisor) forked; empty elsewhere.
_forked: list[int] = []
# In a serving process: the pid of the supervisor's forkserver, not this process's to stop.
_inherited_pid: int | None = None


def supported() -> bool:
    fs: Any = forkserver._forkserver
    tracker: Any = resource_tracker._resource_tracker
    return all(hasattr(fs, a) for a in ("_forkserver_address", "_forkserver_alive_fd",
                                        "_forkserver_pid")) and \
        all(hasattr(tracker, a) for a in ("_fd", "_pid")) and hasattr(forkserver, "main")


def fork_helpers() -> None:
    """In the supervisor, before it forks the serving processes (which inherit them)."""
    if not supported() or _forked:
        return
    tracker: Any = resource_tracker._resource_tracker
    fs: Any = forkserver._forkserver
    if tracker._fd is not None or fs._forkserver_pid is not None:
        return  # started already, the usual way
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _run_child("symgate-tracker", lambda: resource_tracker.main(r), keep={r})
    os.close(r)
    tracker._fd, tracker._pid = w, pid
    _forked.append(pid)

    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # Every holder of alive_w keeps the forkserver up: the supervisor, the serving
        # processes (inherited) and the workers (handed to each); when all are gone, it ends.
        alive_r, alive_w = os.pipe()
        listener_fd = listener.fileno()
        pid = os.fork()
        if pid == 0:
            _run_child("symgate-forksrv", lambda: forkserver.main(listener_fd, alive_r, []),
                       keep={listener_fd, alive_r})
        os.close(alive_r)
    fs._forkserver_address, fs._forkserver_alive_fd, fs._forkserver_pid = \
        address, alive_w, pid
    _forked.append(pid)


def adopt() -> None:
    """In a serving process just forked: use the supervisor's helpers, never wait for or stop
    them (they are not this process's children), and start its own only if they are gone."""
    global _inherited_pid
    fs: Any = forkserver._forkserver
    tracker: Any = resource_tracker._resource_tracker
    _forked.clear()  # the supervisor's to reap
    if not supported() or fs._forkserver_pid is None:
        return
    _inherited_pid = shared_pid = fs._forkserver_pid
    # ensure_running would waitpid() a pid that is not ours; None is what multiprocessing
    # itself leaves in a child whose parent started the tracker.
    tracker._pid = None

    def ensure_running() -> None:
        resource_tracker.ensure_running()
        if fs._forkserver_pid == shared_pid and _alive(shared_pid):
            return
        with fs._lock:
            if fs._forkserver_pid == shared_pid:  # gone: this process starts its own
                fs._forkserver_address = fs._forkserver_alive_fd = fs._forkserver_pid = None
        type(fs).ensure_running(fs)

    fs.ensure_running = ensure_running


def inherited() -> bool:
    """Whether this process uses helpers that it must not stop (executors.py)."""
    fs: Any = forkserver._forkserver
    return _inherited_pid is not None and fs._forkserver_pid == _inherited_pid


def stop_helpers() -> None:
    """In the supervisor, at its end: close its ends (the helpers end once every other holder
    is gone too) and reap them."""
    fs: Any = forkserver._forkserver
    tracker: Any = resource_tracker._resource_tracker
    for holder, attr in ((fs, "_forkserver_alive_fd"), (tracker, "_fd")):
        fd = getattr(holder, attr, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
            setattr(holder, attr, None)
    for pid in _forked:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    _forked.clear()


def _alive(pid: int) -> bool:
    """Running, not a zombie the supervisor has yet to reap."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _run_child(name: str, run: Any, keep: set[int]) -> None:
    """The forked helper's whole life: only its own descriptors (not the supervisor's port
    or guard sockets), then its main loop; never returns into the supervisor's frames."""
    code = 0
    try:
        worker_process.name_process(name)
        # A terminal's Ctrl-C or hangup reaches the whole foreground group: the helpers end
        # when the server's pipes to them close, and the forkserver gives its forks (the
        # workers, before their init ignores them too) the handlers it found here.
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        # Not the supervisor's handler, set before it forks them: a service manager's SIGTERM
        # to every process of the server ends them as before.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for fd in _open_fds():
            if fd > 2 and fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _open_fds() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))
