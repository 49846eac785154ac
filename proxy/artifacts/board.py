"""Fetches under way as every process on one data dir sees them: single flight across processes.

The process that fetches a key holds flights/<key hash>.lock flock(2)ed from before it asks
upstream until the file is committed or given up, and keeps flights/<key hash>.json saying
where it is once upstream has answered: streaming (the temp file's path and the upstream's
headers), verified (every byte is in and right), failed (the error), settled (committed, or
not kept). Another
process that wants the key meanwhile finds the lock taken, opens the temp file the JSON names
and follows it as it grows: one upstream request for the whole server, and each process's
clients get the bytes as they come, from the page cache.

A writer that dies (SIGKILL) loses its lock with it: its followers see the lock free under a
state that never ended and fail their clients' responses, never wait forever. Both files are
left for the next writer of the key to overwrite, or for the start-up cleanup.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy import errors
from proxy.artifacts.flight import Flight
from proxy.errors import SymgateError, UpstreamUnavailable
from proxy.sources.base import ArtifactMeta
from proxy.store.disk import held, same_file

log = logging.getLogger(__name__)
# A follower looks at the writer's progress this often at first, backing off to the longest
# while nothing changes: what a cross-process join costs in latency, at most.
POLL_FIRST_S = 0.0005
POLL_LONGEST_S = 0.01
# and checks this often whether the writer is still alive.
ALIVE_CHECK_S = 0.1
# A fetch's files stay this long after it ends, for its followers to read how it ended, and
# so that a claim made meanwhile knows to look in SQL again (Claim.after_another): a process
# that looked in SQL before the fetch ended and claims the key after its end must find what it
# left there. So it is not a follower's reaction time but the longest stall of a process
# between its look and its claim that is covered: a loaded machine stalled one for over
# 0.25 s (a second upstream request in a test run), and lingering files cost nothing.
LINGER_S = 5.0

STREAMING = "streaming"
VERIFIED = "verified"
FAILED = "failed"
SETTLED = "settled"

# The failures a writer can end in, rebuilt by name in its followers.
_ERRORS: dict[str, type[SymgateError]] = {
    cls.__name__: cls for cls in (
        errors.NotFound, errors.RememberedNotFound, errors.UpstreamUnavailable,
        errors.UpstreamTimeout, errors.VerificationFailed, errors.TooLarge,
        errors.InsufficientStorage, errors.OutOfResources)
}


class Lied(Exception):
    """The followed fetch failed on `upstream`'s answer, which was not the file, where other
    upstreams are left (Flight.lied): a request that got no byte of it asks again, that
    upstream after the others, rather than take the failure."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.upstream = upstream


@dataclass(frozen=True, slots=True)
class Followed:
    """Another process's fetch, joined: the temp file open, the headers it had."""

    ident: str
    fd: int
    meta: ArtifactMeta
    # The fetch had its verdict (its clients their last byte) when this request came, and has
    # been committed since: the request waited for the commit, as one in the fetching process
    # does, and the cache is its answer. The file (-1: renamed before it could be opened)
    # serves it only if it was not kept.
    late: bool = False


class Claim:
    """This process's right to fetch one key; say each step, release at the end.

    Publishing a state costs a file written and renamed (0.3-1.5 ms each): the first
    (streaming), which a cold fetch's first byte would wait for, and the verdict, which its last
    byte would wait for, are written by the board's writer thread. The end (settled or failed),
    and the release, happen here once that thread has written what it was given, so
    that no earlier state lands after a later one, and the lock is free the moment the fetch is
    over (a request right after it must not find it held). Nothing is said while it asks
    upstream: a follower waits alike for a holder that has said nothing yet, and the file and
    the thread's turn would be paid for on the way to the upstream request.
    """

    def __init__(self, board: FlightBoard, kh: str, fd: int) -> None:
        self._board = board
        self._kh = kh
        self._fd = fd
        self.ident = uuid.uuid4().hex
        self._state: dict[str, Any] = {"id": self.ident, "pid": os.getpid()}
        # Another fetch of the key ran lately (its files linger): what it found may be in SQL
        # now, after the claimant looked there.
        self.after_another = board.read_state(kh) is not None
        # The lock file names its holder: followers trust only the state of that fetch, never
        # what an earlier one of the key left. Written here, not by the writer thread: a
        # follower reading an earlier holder's name would take that fetch's end for this one's.
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, self.ident.encode(), 0)
        except OSError:  # a full disk: followers then wait for the end, and look in SQL
            pass

    def say(self, state: str, **fields: Any) -> None:
        self._state.update(fields, state=state)
        snapshot = dict(self._state)

        def publish() -> None:
            try:
                self._board.write_state(self._kh, snapshot)
            except OSError as e:  # followers then see no progress and fail; it goes on
                log.warning("cannot publish the state of a fetch: %s", e)

        if state in (STREAMING, VERIFIED):
            self._board.post(publish)
        else:
            self._board.drain()
            publish()

    def streaming(self, part: Path, meta: ArtifactMeta) -> None:
        self.say(STREAMING, part=str(part), meta=[meta.upstream, meta.size, meta.filename,
                                                   meta.archive, meta.last_modified])

    def failed(self, error: SymgateError, lied: str | None = None) -> None:
        """`lied`: the upstream whose answer was not the file, where others are left
        (Flight.lied), which the followers' requests then ask after them."""
        self.say(FAILED, error=type(error).__name__, reason=error.reason,
                 **({"lied": lied} if lied else {}))

    def release(self) -> None:
        if self._fd >= 0:
            self._board.drain()
            os.close(self._fd)  # the lock goes with it
            self._fd = -1


class FlightBoard:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        # One thread: what claims say is written in the order they say it. Started now, not
        # by the first cold fetch, whose first byte would wait for the thread to be made.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="symgate-board")
        self._last: Future[None] = self._writer.submit(lambda: None)

    def post(self, job: Callable[[], None]) -> None:
        self._last = self._writer.submit(job)

    def drain(self) -> None:
        """Until what was posted is written: blocks only while the writer is behind, which a
        fetch's end (its first states are long written by then) almost never finds."""
        self._last.result()

    def close(self) -> None:
        """Write what is left: a stopping server's last posted states."""
        self._writer.shutdown(wait=True)

    def claim(self, kh: str) -> Claim | None:
        """The right to fetch `kh`, or None while another process holds it."""
        lock = self._lock(kh)
        while True:
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                # The folder removed under the server (an operator clearing the cache by
                # hand): made again, or every fetch failed until a restart.
                self.folder.mkdir(parents=True, exist_ok=True)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            if same_file(fd, lock):  # not removed by a start-up cleanup meanwhile
                return Claim(self, kh, fd)
            os.close(fd)

    async def follow(self, kh: str) -> Followed | None:
        """Join the fetch another process has under way, once it streams; raises the error
        it failed with. None when there is none to join (ended, or its writer died): the
        caller looks in the cache again, or fetches itself. One verified already (or
        settled, its lock not yet let go) is waited for to its end: Followed.late. One that
        failed on an answer that was not the file, where other upstreams are left, raises
        Lied: no answer for the request, which asks again, as the writer's own clients do
        (Flight.lied).

        Called right after a claim of `kh` failed, with no await in between."""
        delay = POLL_FIRST_S
        waited = 0.0
        first_look = True
        late: str | None = None  # the fetch's id, when it had its verdict as this request came
        fd = -1
        while True:
            state = self.read_state(kh) or {}
            if late is None:
                holder = self._holder(kh)
                # Another fetch's state (an earlier one, or none yet from this holder): wait.
                name = state.get("state") if holder and state.get("id") == holder else None
                if first_look and name in (VERIFIED, SETTLED):
                    late = holder
            if late is not None:
                first_look = False
                name = state.get("state") if state.get("id") == late else None
                if name == VERIFIED and fd < 0:
                    fd = _open(state["part"])
                if name == SETTLED and "meta" in state:
                    return Followed(late, fd, ArtifactMeta(*state["meta"]), late=True)
                if name == VERIFIED and waited >= ALIVE_CHECK_S and not self.held(kh):
                    # Ended between the look at its state and at its lock, or its writer died.
                    state = self.read_state(kh) or {}
                    if state.get("id") == late and state.get("state") == SETTLED \
                            and "meta" in state:
                        return Followed(late, fd, ArtifactMeta(*state["meta"]), late=True)
                    name = None
                if name != VERIFIED:
                    # Its commit failed, or its writer died: nothing to wait for.
                    if fd >= 0:
                        os.close(fd)
                    return None
                await asyncio.sleep(delay)
                waited += delay
                delay = min(delay * 2, POLL_LONGEST_S)
                continue
            if name == FAILED:
                _raise_if_lied(state)
                if first_look:
                    # Failed before the caller's claim was refused: the caller came after
                    # that fetch, whose lock is held now only for a moment (its writer about
                    # to let go) or by the copy a process forked meanwhile keeps until it
                    # execs (the forkserver's start). Not the caller's failure to report: as
                    # after a fetch that settled, it looks in SQL again, or claims.
                    return None
                raise _error(state)
            first_look = False
            if name in (STREAMING, VERIFIED):
                if (fd := _open(state["part"])) >= 0:
                    return Followed(state["id"], fd, ArtifactMeta(*state["meta"]))
                if name == STREAMING:
                    return None  # dropped meanwhile: its writer died or failed
                # Renamed into the cache: its row comes next, then SETTLED.
            if name == SETTLED:
                return None
            if waited >= ALIVE_CHECK_S and not self.held(kh):
                # Its writer let go of the lock: it died, or it ended between this look at its
                # state and this one at its lock, its failure (said before it let go) to be
                # had. Taken for gone, this request missed a failure it had waited for: no
                # join counted, and the miss the writer remembered was its answer.
                state = self.read_state(kh) or {}
                if holder and state.get("id") == holder and state.get("state") == FAILED:
                    _raise_if_lied(state)
                    raise _error(state)
                return None
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, POLL_LONGEST_S)

    async def track(self, kh: str, followed: Followed, flight: Flight) -> None:
        """Drive `flight` (this process's mirror of another's fetch) from the file's growth
        and the writer's state, until it settles."""
        delay = POLL_FIRST_S
        since_alive_check = 0.0
        try:
            while True:
                state = self.read_state(kh)
                size = os.fstat(followed.fd).st_size
                if size > flight.written:
                    flight.wrote(size - flight.written)
                    delay = POLL_FIRST_S
                name = state.get("state") if state else None
                if state is None or state.get("id") != followed.ident:
                    flight.fail(UpstreamUnavailable("the fetch this joined in another server "
                                                    "process was abandoned"))
                    return
                if name == FAILED:
                    if isinstance(liar := state.get("lied"), str):
                        flight.lied = liar  # its clients that got no byte ask again
                    flight.fail(_error(state))
                    return
                # The writer says so once every byte is written: they are all in the file.
                if (name in (VERIFIED, SETTLED) and not flight.succeeded
                        and flight.written >= state.get("size", flight.written + 1)):
                    flight.body_ended()
                    flight.succeed()
                if name == SETTLED:
                    return
                if since_alive_check >= ALIVE_CHECK_S:
                    since_alive_check = 0.0
                    if not self.held(kh) and (self.read_state(kh) or {}).get("state") not in (
                            SETTLED, FAILED):
                        flight.fail(UpstreamUnavailable(
                            "the server process fetching it died"))
                        return
                await asyncio.sleep(delay)
                since_alive_check += delay
                delay = min(delay * 2, POLL_LONGEST_S)
        finally:
            if not flight.finished:  # cancelled: this server is stopping
                flight.fail(UpstreamUnavailable("server shutting down"))
            flight.close_fd()
            flight.settle()

    async def tidy(self, kh: str, ident: str) -> None:
        """Remove a fetch's files once its followers have had time to read how it ended;
        not if another fetch of the key has begun since."""
        await asyncio.sleep(LINGER_S)
        # On the loop's thread, between two of its steps: the lock it takes for a moment is
        # then never seen held by this process's own claims, which would take it for a fetch
        # under way and replay that fetch's end. After what the writer has yet to write.
        self.drain()
        lock = self._lock(kh)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if same_file(fd, lock) and (self.read_state(kh) or {}).get("id") == ident:
                # Unlinked while held: a process that opened it before then finds its lock
                # taken, or, with the path gone, that nobody is fetching.
                (self.folder / f"{kh}.json").unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
        except BlockingIOError:
            pass  # another fetch of the key is under way: its files now
        finally:
            os.close(fd)

    def _holder(self, kh: str) -> str | None:
        """The id the holder of the key's lock (or its last holder) wrote in it."""
        try:
            return self._lock(kh).read_text()[:64] or None
        except (OSError, ValueError):
            return None

    def held(self, kh: str) -> bool:
        """Whether a live process holds the key's lock."""
        return held(self._lock(kh))

    def write_state(self, kh: str, state: dict[str, Any]) -> None:
        temp = self.folder / f"{kh}.json.{os.getpid()}"
        temp.write_text(json.dumps(state))
        os.replace(temp, self.folder / f"{kh}.json")

    def read_state(self, kh: str) -> dict[str, Any] | None:
        try:
            state = json.loads((self.folder / f"{kh}.json").read_bytes())
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def clear_stale(self) -> int:
        """Remove what writers that are gone left (their lock free); what a live one holds
        stays. At start-up."""
        removed = 0
        for lock in self.folder.glob("*.lock"):
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # removed meanwhile: by another process's cleanup, or its fetch's end
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            else:
                for leftover in self.folder.glob(f"{lock.stem}.json*"):
                    leftover.unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
                removed += 1
            finally:
                os.close(fd)
        return removed

    def _lock(self, kh: str) -> Path:
        return self.folder / f"{kh}.lock"


def _open(part: str) -> int:
    """A descriptor of the temp file `part`; -1 if it is gone (renamed into the cache)."""
    try:
        return os.open(part, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1


def _raise_if_lied(state: dict[str, Any]) -> None:
    """Lied, if the failed fetch of `state` failed on an answer that was not the file."""
    if isinstance(liar := state.get("lied"), str):
        raise Lied(liar)


def _error(state: dict[str, Any]) -> SymgateError:
    return _ERRORS.get(state.get("error", ""), SymgateError)(
        str(state.get("reason", "failed in another server process")))
