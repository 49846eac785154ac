"""`symgate serve --workers N`: N serving processes on one port, and the small process that
keeps them.

Each worker is a whole server (proxy.web.app.serve) with its own listening socket bound with
SO_REUSEPORT, so the kernel spreads connections over them; they share the data dir and the
database, and coordinate through them (proxy.artifacts.board for fetches, the cache's budget
lock for eviction). Metrics go to prometheus-client's multiprocess files, so any worker's
/metrics shows the whole server.

Workers are forked from the supervisor once it has imported the server's modules (and frozen
them out of the garbage collector's reach): their pages stay shared, and each worker costs
its own heap only. The supervisor binds the port first (its socket, bound but never
listening, keeps the port and tells port 0's real number), runs the migrations in a
short-lived fork before any worker starts, says a start-up fault once, restarts a worker
that dies, and on SIGTERM, SIGINT or SIGHUP passes SIGTERM on and waits for the workers' drains.
Workers die with it if it is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import gc
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

from proxy import process_marks
from proxy.config import Config, parse_listen
from proxy.web.grace import STOP_SIGNALS
from proxy.web.startup import CannotStart, make_data_dirs, reason

log = logging.getLogger("symgate")
_PR_SET_PDEATHSIG = 1
# A worker that dies more often than this is not restarted again: something is wrong.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
# How often the supervisor looks for workers that have exited.
REAP_EVERY_S = 0.2
_READY = b"ready"


def supervise(config: Config, workers: int, *, access_log: bool, json_logs: bool) -> int:
    """Run `workers` serving processes until SIGTERM, SIGINT or SIGHUP; the exit status.
    Raises CannotStart for a fault found before or while the workers start."""
    keeper = _Keeper(config, access_log, json_logs)

    def stop(signum: int, _frame: object) -> None:
        keeper.stopping = True
        keeper.signal_all(signal.SIGTERM)

    # From the first moment: a stop while the server imports or migrates (a deploy's SIGTERM,
    # a Ctrl-C) is an orderly one, not the default's death by signal (status -15, the metrics
    # folder left behind) or a KeyboardInterrupt's traceback.
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        return _supervise(config, workers, keeper)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(config: Config, workers: int, keeper: _Keeper) -> int:
    host, port = parse_listen(config.server.listen, "server.listen")
    make_data_dirs(config)
    holder = _hold_port(config.server.listen, host, port)
    keeper.port = holder.getsockname()[1]
    guard = _one_server_per_port(config.server.listen, host, keeper.port)
    # A start that fails (the database out of reach, say) or is stopped leaves nothing behind
    # (the finally below): under a restarting service manager, a metrics folder each try
    # would fill /tmp.
    metrics_dir = Path(tempfile.mkdtemp(prefix=f"{_METRICS_PREFIX}{process_marks.mark()}-"))
    try:
        _multiprocess_metrics(metrics_dir)
        # What every worker runs, imported once here and shared by the forks.
        from proxy.symbols import forked_helpers
        from proxy.web import app as _server  # noqa: F401

        gc.freeze()
        # Before any serving process exists: they inherit them, and so fork no helpers of
        # their own.
        forked_helpers.fork_helpers()
        # Migrated, or only read (--no-migrate): a newer symgate's schema is refused either way.
        _migrate_in_a_fork(config, keeper, read_only=not config.database.migrate_on_start)
        try:
            for index in range(workers):
                if not keeper.stopping:
                    keeper.start(index)
            for index in range(workers):
                while (killed := keeper.wait_ready(index)) is not None:
                    # Killed from outside while it started (the OOM killer, an operator):
                    # not a fault of the configuration, so it is replaced as a serving one
                    # would be.
                    _fold(metrics_dir, killed[0])
                    if keeper.stopping:  # SIGTERM came meanwhile: a new worker would miss it
                        break
                    if not keeper.may_restart(index):
                        raise CannotStart(
                            f"worker {index} keeps dying while starting ({killed[1]})")
                    log.warning("worker %d %s while starting; starting another", index,
                                killed[1])
                    keeper.start(index)
            if not keeper.stopping:
                log.info("symgate serving with %d workers on port %d", workers, keeper.port)
            while not keeper.stopping:
                died = keeper.reap()
                if died is None:
                    time.sleep(REAP_EVERY_S)
                    continue
                index, pid, status = died
                # Its live gauges (fetches under way, breaker states) no longer count; its
                # counts do, from the archive.
                _fold(metrics_dir, pid)
                if keeper.stopping:
                    break
                if not keeper.may_restart(index):
                    log.error("worker %d keeps dying (%s); stopping", index, status)
                    keeper.signal_all(signal.SIGTERM)
                    keeper.wait_all()
                    return 1
                log.warning("worker %d %s; starting another", index, status)
                keeper.start(index)
            keeper.wait_all()
            return 0
        except BaseException:
            keeper.signal_all(signal.SIGTERM)
            keeper.wait_all()
            raise
    finally:
        _end(holder, guard, metrics_dir)


def _fold(metrics_dir: Path, pid: int) -> None:
    """proxy.metrics.fold_dead_process, which a full or broken /tmp must not turn into the
    whole server's end: its files are then left, and counted as they were."""
    from proxy.metrics import fold_dead_process

    try:
        fold_dead_process(metrics_dir, pid)
    except OSError as e:
        log.warning("could not fold the metrics of process %d into the archive: %s", pid, e)


def _end(holder: socket.socket, guard: socket.socket, metrics_dir: Path) -> None:
    """What the supervisor holds, given back: the port, the metrics folder, the helpers."""
    from proxy.symbols import forked_helpers

    holder.close()
    guard.close()
    shutil.rmtree(metrics_dir, ignore_errors=True)
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    forked_helpers.stop_helpers()


def _migrate_in_a_fork(config: Config, keeper: _Keeper, *, read_only: bool = False) -> None:
    """Migrate the database in a short-lived fork, before any worker starts: alembic and
    what it imports (~12 MiB) then never enter a long-lived process. CannotStart with the
    reason if it cannot. A stop signal meanwhile ends it (a migration cut midway is
    undone: its transaction never commits) and the start with it, without a fault.
    `read_only`: its revision only checked (migrate.check)."""
    from proxy.store import migrate
    from proxy.symbols import worker_process
    from proxy.web.app import startup_error

    # As in _Keeper.start: the supervisor's handler must not run in the fork.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    if keeper.stopping:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return
    theirs, ours = os.pipe()
    pid = os.fork()
    if pid == 0:  # never returns
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        os.close(theirs)
        worker_process.name_process("symgate-migrate")  # in ps, not taken for a worker
        code = 1
        try:
            (migrate.check if read_only else migrate.upgrade)(
                config.database_url, timeout_s=config.database.timeout_s)
            code = 0
        except Exception as e:
            error = startup_error(config, e)
            if isinstance(error, CannotStart):
                os.write(ours, str(error).encode())
            else:
                log.exception("migrating the database failed")
        finally:
            logging.shutdown()
            os._exit(code)
    os.close(ours)
    keeper.migration = pid
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    chunks = []
    while chunk := _read(theirs):
        chunks.append(chunk)
    os.close(theirs)
    _, status = os.waitpid(pid, 0)
    keeper.migration = None
    if status != 0 and not keeper.stopping:
        raise CannotStart(b"".join(chunks).decode(errors="replace")
                          or f"migrating the database failed: the migration {_how(status)}")


# A supervisor's metrics folder is named after its pid: one whose supervisor is gone (killed
# with SIGKILL, which no cleanup survives) is removed by the next server that starts.
_METRICS_PREFIX = "symgate-metrics-"


def sweep_dead_folders() -> None:
    """Remove the metrics folders of supervisors, and multiprocessing's folders of servers
    (proxy.symbols.executors.own_temp_folder), whose process no longer runs (on this host's
    temporary directory: a folder of another host's, on a shared one, names a pid of that
    host). Each is named after its process's mark (proxy.process_marks)."""
    from proxy.symbols.executors import TEMP_PREFIX

    for prefix in (_METRICS_PREFIX, TEMP_PREFIX):
        for folder in Path(tempfile.gettempdir()).glob(f"{prefix}*-*"):
            if process_marks.gone(folder.name[len(prefix):].partition("-")[0]):
                shutil.rmtree(folder, ignore_errors=True)


def _multiprocess_metrics(folder: Path) -> None:
    """Metrics made from now on (in the workers) keep their values in files under `folder`.
    prometheus-client reads the variable when it is first imported: if it has been already,
    its choice of value class is made again."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


class _Keeper:
    """The worker processes, by index, with the pipes they say "ready" (or why not) on."""

    def __init__(self, config: Config, access_log: bool, json_logs: bool) -> None:
        self._config = config
        self.port = 0  # the port the supervisor holds, known once it is bound
        self.migration: int | None = None  # the migrating fork's pid, while it runs
        self._access_log = access_log
        self._json_logs = json_logs
        self._pids: dict[int, int] = {}
        self._pipes: dict[int, int] = {}
        self._deaths: dict[int, list[float]] = {}
        self.stopping = False  # a stop signal came: a worker that ends is no fault

    def start(self, index: int) -> None:
        config = dataclasses.replace(  # migrated already, by _migrate_in_a_fork
            self._config, database=dataclasses.replace(self._config.database,
                                                       migrate_on_start=False))
        supervisor = os.getpid()
        # A SIGTERM between the fork and the worker's own handlers must not run the
        # supervisor's handler in the worker: held back until the default is in place.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        if self.stopping:
            # A stop signal came after the caller decided to start it (while it logged
            # why, say): the handler has signalled the workers there were, and a new one
            # would serve on while the supervisor waits for it.
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            return
        theirs, ours = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_DFL)  # until serve() installs its own
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.close(theirs)
            code = 1
            try:
                code = _worker(config, self.port, index, supervisor, ours, self._access_log,
                               self._json_logs)
            finally:
                # What exiting runs (multiprocessing's cleanup of its semaphores among it),
                # without unwinding into the supervisor's frames that the fork copied.
                atexit._run_exitfuncs()
                os._exit(code)
        os.close(ours)
        if index in self._pipes:  # a worker restarted while serving: nobody waits on it
            os.close(self._pipes[index])
        self._pids[index] = pid
        self._pipes[index] = theirs
        # Only now: a stop signal held back meanwhile reaches this worker too.
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def wait_ready(self, index: int) -> tuple[int, str] | None:
        """Until worker `index` serves: None then, or (pid, how it ended) if a signal killed
        it first. CannotStart with its reason if it could not start (unless the server is
        stopping, which may have stopped it before it served)."""
        if index not in self._pipes:
            return None  # never started: the server was stopping
        fd = self._pipes.pop(index)
        chunks = []
        while chunk := _read(fd):
            chunks.append(chunk)
            if chunks == [_READY]:
                break
        os.close(fd)
        message = b"".join(chunks)
        if message == _READY or self.stopping:
            return None
        if not message:
            pid = self._pids.pop(index)
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                return pid, _how(status)
        raise CannotStart(message.decode(errors="replace")
                          or f"worker {index} exited while starting (see the log above)")

    def reap(self) -> tuple[int, int, str] | None:
        """A worker that has exited, if any: (index, pid, how it ended)."""
        for index, pid in list(self._pids.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del self._pids[index]
                return index, pid, _how(status)
        return None

    def may_restart(self, index: int) -> bool:
        now = time.monotonic()
        recent = [t for t in self._deaths.get(index, []) if now - t < RESTART_WINDOW_S]
        recent.append(now)
        self._deaths[index] = recent
        return len(recent) <= MAX_RESTARTS

    def signal_all(self, sig: int) -> None:
        for pid in [*self._pids.values(), *filter(None, [self.migration])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def wait_all(self) -> None:
        for index, pid in list(self._pids.items()):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            del self._pids[index]


def _read(fd: int) -> bytes:
    while True:
        try:
            return os.read(fd, 4096)
        except InterruptedError:  # a signal's handler ran; read on
            continue


def _how(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _worker(config: Config, port: int, index: int, supervisor: int, ready: int,
            access_log: bool, json_logs: bool) -> int:
    """A worker process's life: serve until told to stop, or until the supervisor is gone;
    its exit status."""
    import asyncio

    from proxy.web import logs
    from proxy.web.app import serve

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != supervisor:  # gone before the line above could take effect
        return 1
    from proxy.symbols import forked_helpers

    forked_helpers.adopt()
    logs.configure(json_logs, serving=True)

    def serving() -> None:
        os.write(ready, _READY)
        os.close(ready)

    try:
        asyncio.run(serve(
            config, access_log=logging.getLogger("symgate.access") if access_log else None,
            access_log_class=logs.JsonAccessLogger if json_logs else logs.AccessLogger,
            port=port, reuse_port=True, serving=serving, worker=index))
    except CannotStart as e:
        with contextlib.suppress(OSError):
            os.write(ready, str(e).encode())
        return 1
    except KeyboardInterrupt:
        pass
    except BaseException:
        log.exception("worker %d failed", index)
        return 1
    finally:
        logging.shutdown()
    return 0


def _hold_port(listen: str, host: str, port: int) -> socket.socket:
    """A socket bound to the port with SO_REUSEPORT and never listening: it keeps the port for
    the workers, and tells port 0's number."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CannotStart(f"cannot listen on {listen}: {reason(e)}") from None
    return sock


def _one_server_per_port(listen: str, host: str, port: int) -> socket.socket:
    """SO_REUSEPORT would let a second symgate join this one's port unnoticed and take half of
    its connections: a name in the abstract socket namespace (gone with the process, whatever
    kills it) says the port is taken."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(f"\0symgate-listen-{host}-{port}")
    except OSError:
        sock.close()
        raise CannotStart(f"cannot listen on {listen}: address already in use "
                          "(by another symgate)") from None
    return sock
