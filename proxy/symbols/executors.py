"""Process pools made and retired, and multiprocessing's helper processes with them: the
forkserver (whose forks the workers are) and the resource tracker run only while some pool of
this process has workers, so that an idle server is one process.

Both helpers are process-wide singletons of multiprocessing, shared by every pool of the
process (tests run several servers in one): they are stopped once the last pool is retired
and its workers have exited, and started again by the next pool. Starting and stopping are
blocking (a start waits for the forkserver's imports; a stop waits for the helpers to exit),
so they run in threads, one at a time.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import forkserver, process, resource_tracker, util
from pathlib import Path
from typing import Any

from proxy import process_marks
from proxy.symbols import forked_helpers, worker_process

log = logging.getLogger(__name__)
# Loaded once by the forkserver, whose forks the workers are: see that module.
_PRELOAD = "proxy.symbols.forkserver_preload"
# Held while a pool is made or the helpers are stopped: a stop never overlaps a start.
_lock = threading.Lock()
_pools = 0  # pools made and not yet retired, in this process
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux's, named in fcntl since 3.10
# multiprocessing's temporary folder, named after the process that made it (see own_temp_folder).
TEMP_PREFIX = "symgate-mp-"


def own_temp_folder() -> None:
    """Have multiprocessing keep its temporary files (the forkserver's socket) in a folder
    named `symgate-mp-<pid>-*`, instead of its own `pymp-*`. It removes that folder when the
    process exits, but a server killed with SIGKILL runs no cleanup: each such start left one
    in the temporary directory for good (a restart loop under a service manager, thousands).
    Named after its process, one whose process is gone is removed by the next start, as the
    metrics folders are (proxy.web.supervisor.sweep_dead_folders). Call it before anything
    starts a forkserver; the processes forked from this one share the folder."""
    config: dict[str, Any] = process.current_process()._config  # type: ignore[attr-defined]
    if config.get("tempdir") is not None:
        return
    folder = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{process_marks.mark()}-")
    config["tempdir"] = folder
    # What multiprocessing.util.get_temp_dir registers for its own folder: run at exit, in
    # this process only (a fork's exit leaves it alone).
    util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True},
                  exitpriority=-100)


def start(processes: int, initializer: Callable[..., None], initargs: tuple[Any, ...]
          ) -> ProcessPoolExecutor:
    """A pool of up to `processes` workers, with one of them started; blocking (on the first
    pool, until the forkserver has imported the workers' modules, some 0.2 s)."""
    global _pools
    with _lock:
        # forkserver: never fork a process that runs an event loop and threads.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([_PRELOAD])
        executor = ProcessPoolExecutor(max_workers=processes, mp_context=context,
                                       initializer=initializer, initargs=initargs)
        _pools += 1
    _widen_pipes(executor)
    try:
        # A worker up and idle: the caller's first job neither waits for the forkserver on the
        # event loop (submit blocks until the fork) nor starts a second worker beside it.
        with _deaf_to_the_terminal():
            executor.submit(worker_process.ready).result()
    except BaseException:
        retire(executor, cancel=True)
        raise
    return executor


@contextlib.contextmanager
def helpers_kept() -> Iterator[None]:
    """The forkserver and the resource tracker kept up while held, once a pool has started
    them, though no pool is left: for a process that starts and stops servers one after
    another (the test suite's, where each server's first build started them anew, a new
    interpreter importing what the workers run, 0.4 s of CPU each time and a sixth of the
    suite's). Held as a pool is, so that no retire stops them meanwhile."""
    global _pools
    with _lock:
        _pools += 1
    try:
        yield
    finally:
        _let_go()


@contextlib.contextmanager
def _deaf_to_the_terminal() -> Iterator[None]:
    """A terminal's Ctrl-C and hangup held back from this thread while it starts helpers: a
    process inherits its blocked signals and keeps them through exec, so the forkserver and
    the resource tracker it may spawn now, and their forks (the workers), start with them
    blocked. They reach every process of the foreground group, and one that came as the
    forkserver imported what the workers run (0.2 s and more) killed it, and with it the pool
    a profile under way waited for: a 503 where the drain was to let the profile finish.
    The server's own thread (the loop's) still takes them."""
    held = {signal.SIGINT, signal.SIGHUP}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _widen_pipes(executor: ProcessPoolExecutor) -> None:
    """The pipes that carry jobs to the workers and results back, 1 MB rather than 64 KB
    (at most the system's pipe-max-size): a profile's bytes go through them where workers
    cannot open the serving process's memfds (shared_bodies.py), three times for a
    /symbolize (to scan, to finish, and back), some 2.5 MB each for 100,000 locations, and
    at 64 KB a time each side woke some forty times: 2.5 MB to a worker and back took 12 ms
    (median of 30), 6 ms with 1 MB pipes. Private to concurrent.futures (stable since 3.8);
    without them, the pipes stay as they are."""
    for name in ("_call_queue", "_result_queue"):
        reader: Any = getattr(getattr(executor, name, None), "_reader", None)
        with contextlib.suppress(OSError, AttributeError, ValueError):
            fcntl.fcntl(reader.fileno(), _F_SETPIPE_SZ, _pipe_size())


def _pipe_size() -> int:
    try:
        return min(1 << 20, int(Path("/proc/sys/fs/pipe-max-size").read_text()))
    except (OSError, ValueError):
        return 1 << 20  # refused above the system's maximum: the pipe stays as it is


def retire(executor: ProcessPoolExecutor, *, cancel: bool = False) -> Future[None]:
    """Shut the pool down (its workers finish their jobs, or drop the queued ones if `cancel`),
    and once they have exited, stop the helpers if no other pool is left. Returns at once;
    the future is done once all that is.

    A process must not end before that future: multiprocessing's exit in a spawned process
    (`serve --workers N`) stops the pool's queue feeder and then waits for the workers, which
    a shutdown begun too late can then no longer reach.
    """
    done: Future[None] = Future()
    held = [executor]  # dropped by the thread once shut down, freeing the pool's semaphores
    threading.Thread(target=_retire, args=(held, cancel, done), name="symgate-retire-workers",
                     daemon=True).start()
    return done


def _retire(held: list[ProcessPoolExecutor], cancel: bool, done: Future[None]) -> None:
    try:
        held.pop().shutdown(wait=True, cancel_futures=cancel)
        # The pools' queues hold named semaphores that unregister from the resource tracker
        # when they are freed, as they were with their pool (by reference counting, without
        # a collection that would hold the event loop some 50 ms): dropped before the stop.
        _let_go()
    finally:
        done.set_result(None)


def _let_go() -> None:
    """A pool (or a hold) no longer counts: the helpers stop with the last."""
    global _pools
    with _lock:
        _pools -= 1
        if not _pools:
            _stop_helpers()


def _stop_helpers() -> None:
    # Private to multiprocessing, and stable since 3.8: what its own tests call. Without them
    # (a later Python), the helpers stay up, idle, as they did before pools were retired.
    tracker = resource_tracker._resource_tracker
    # A serving process started by `serve --workers N` (multiprocessing's spawn) uses the
    # supervisor's resource tracker, shared by all: not its own to stop (it has no pid of it).
    own_tracker = getattr(tracker, "_pid", None) is not None
    if forked_helpers.inherited():
        return  # the supervisor's, shared by every serving process (forked_helpers.py)
    for helper in (forkserver._forkserver, *([tracker] if own_tracker else [])):
        stop = getattr(helper, "_stop", None)
        if stop is None:
            continue
        try:
            stop()
        except Exception:  # the helper stays up, idle: no reason to fail anything else
            log.exception("stopping multiprocessing's %s", type(helper).__name__)
