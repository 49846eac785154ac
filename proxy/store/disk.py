"""Every path symgate writes: cached artifacts, downloads under way, and symbol tables.

objects/ holds complete, verified files; tmp/ holds downloads under way. A file only reaches
objects/ by rename(2) after it was fsynced, so a crash leaves at worst a stray file in tmp/
(removed at start-up), never a short file under a final name.

Several processes may share one data dir (replicas on one host, a restart overlapping the old
process). Each writes its downloads in its own tmp/<id>/ folder, announced by tmp/<id>.lock,
which it holds flock(2)ed for its whole life: start-up cleanup removes only the folders whose
lock it can take, those of dead processes, never a live process's download. Symbol tables live under
symtabs/. What a tenant's own sources gave lives under a `tenants/<hash>/` folder of each, so
a tenant's name (any string) never becomes part of a path.

Nothing else builds these paths: the artifact service, the symbol service and the admin
commands all ask the Store.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import uuid
import weakref
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

from proxy.keys import ArtifactKey

_SCOPED = "tenants"


def _scope_dir(scope: str) -> str:
    """"" for shared files (the layout every earlier version wrote), else a fixed-alphabet
    folder for the tenant."""
    if not scope:
        return ""
    return f"{_SCOPED}/{hashlib.sha256(scope.encode()).hexdigest()[:32]}/"


class Store(Protocol):
    def artifact_name(self, scope: str, key: ArtifactKey) -> str:
        """The artifact's path relative to the objects folder: what `stored_names` lists."""
        ...

    def artifact_path(self, scope: str, key: ArtifactKey) -> Path: ...

    def new_temp(self) -> tuple[Path, int]: ...

    def commit(self, temp: Path, fd: int, scope: str, key: ArtifactKey,
               mtime: float | None = None) -> Path: ...

    def remove_artifact(self, scope: str, key: ArtifactKey) -> None: ...

    def clear_temp(self) -> int: ...

    def others_alive(self) -> bool: ...

    def try_budget_lock(self) -> int | None: ...

    def upload_lock(self, *, wait: bool = True) -> int | None: ...

    def stored_names(self) -> Iterator[str]: ...

    def free_bytes(self) -> int: ...

    def free_inodes(self) -> int | None: ...

    def read_only(self) -> bool: ...

    def remove_name(self, name: str) -> None: ...

    def symtab_path(self, scope: str, build_id: str) -> Path: ...

    def remove_symtab(self, scope: str, build_id: str) -> None: ...

    def count_symtabs(self) -> int: ...

    def clear_symtab_temp(self) -> int: ...

    def clear_table_temp(self, scope: str, build_id: str) -> int: ...


class DiskStore:
    def __init__(self, cache_dir: Path, symtab_dir: Path) -> None:
        self.objects = cache_dir / "objects"
        self.tmp = cache_dir / "tmp"
        self.symtabs = symtab_dir
        # Fetches under way, for every process on this data dir (proxy.artifacts.board).
        self.flights = cache_dir / "flights"
        for d in (self.objects, self.tmp, self.symtabs):
            d.mkdir(parents=True, exist_ok=True)
        self._own_tmp: Path | None = None  # made at the first download: admin commands need none

    # -- artifacts -------------------------------------------------------------------------------
    def artifact_name(self, scope: str, key: ArtifactKey) -> str:
        return _scope_dir(scope) + key.storage_name

    def artifact_path(self, scope: str, key: ArtifactKey) -> Path:
        return self.objects / self.artifact_name(scope, key)

    def new_temp(self) -> tuple[Path, int]:
        """A fresh temp file opened read-write; the caller owns the descriptor."""
        path = self._process_tmp() / f"{uuid.uuid4().hex}.part"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        return path, fd

    def _process_tmp(self) -> Path:
        """This process's temp folder, its lock taken before the folder exists. Made again
        (and tmp/ with it) when it is gone: an operator who cleared the cache of a running
        server (`rm -rf cache/*`) left every later download failing until a restart."""
        if self._own_tmp is not None:
            if self._own_tmp.is_dir():
                return self._own_tmp
            self.close()  # its lock, if still there, goes with it: it announces no folder
        self.tmp.mkdir(parents=True, exist_ok=True)
        while True:
            name = uuid.uuid4().hex
            lock = self.tmp / f"{name}.lock"
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # Another process's cleanup may have taken the lock between open and flock and
            # removed the file: then ours locks nothing anyone will look at; start again.
            if same_file(fd, lock):
                break
            os.close(fd)
        folder = self.tmp / name
        folder.mkdir()
        # The lock lives as long as this store (the kernel drops it if the process dies); a
        # process that exits cleanly takes its folder with it.
        self._release = weakref.finalize(self, _release, folder, lock, fd)
        self._own_tmp = folder
        return folder

    def close(self) -> None:
        """Give up this store's temp folder and lock: what exiting does, for a server that
        stops and lives on in its process (tests, embedding)."""
        if self._own_tmp is not None:
            self._release()
            self._own_tmp = None

    def commit(self, temp: Path, fd: int, scope: str, key: ArtifactKey,
               mtime: float | None = None) -> Path:
        """Blocking (fsync): run it in a worker thread. `mtime`: the file's modification time
        (what the upstream said), set before the rename: from then on the file is other
        processes' to evict, and may be gone by the time this returns."""
        if mtime is not None:
            os.utime(fd, (mtime, mtime))
        os.fsync(fd)
        final = self.artifact_path(scope, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(temp, final)
        return final

    def remove_artifact(self, scope: str, key: ArtifactKey) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.artifact_path(scope, key).unlink()

    def clear_temp(self) -> int:
        """Remove downloads that dead processes left unfinished; a live process's stay."""
        removed = 0
        for lock in self.tmp.glob("*.lock"):
            removed += _remove_if_dead(lock, self.tmp / lock.stem)
        for leftover in self.tmp.iterdir():
            if leftover.suffix == ".lock" or leftover.with_suffix(".lock").exists():
                continue
            # A folder without its lock is a dead process's (the lock is made first); a file is
            # what versions before per-process folders left.
            with contextlib.suppress(FileNotFoundError):
                if leftover.is_dir():
                    removed += sum(1 for _ in leftover.iterdir())
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink()
                    removed += 1
        return removed

    def others_alive(self) -> bool:
        """Whether another live store (another process, mostly) holds a lock here: it may have
        renamed a file into objects/ whose row it has not written yet."""
        own = self._own_tmp.with_suffix(".lock") if self._own_tmp is not None else None
        return any(lock != own and held(lock) for lock in self.tmp.glob("*.lock"))

    def try_budget_lock(self) -> int | None:
        """The lock one process at a time holds to judge the whole cache against its budget
        and evict for it: a descriptor to close to release it, or None while another process
        holds it (then that one is doing the work)."""
        return flocked(self.objects.parent / "budget.lock", wait=False)

    def upload_lock(self, *, wait: bool = True) -> int | None:
        """The lock every process holds while it commits an upload or removes one, so that
        the upload budget and a key's file and row change together, and while it commits a
        download, which must not replace an upload. Blocking: take it in a thread; close the
        descriptor to release it. Without `wait`, None while another process holds it."""
        return flocked(self.objects.parent / "uploads.lock", wait=wait)

    def free_bytes(self) -> int:
        """Space left for the cache on its filesystem (for an unprivileged writer)."""
        st = os.statvfs(self.objects)
        return st.f_bavail * st.f_frsize

    def free_inodes(self) -> int | None:
        """Files that can still be made on the cache's filesystem; None where it does not
        count them (btrfs, some network filesystems)."""
        st = os.statvfs(self.objects)
        return st.f_favail if st.f_files else None

    def read_only(self) -> bool:
        """Whether the cache's filesystem is mounted (or was remounted, after an I/O error)
        read-only: nothing can be written there, whoever asks."""
        return bool(os.statvfs(self.objects).f_flag & os.ST_RDONLY)

    def stored_names(self) -> Iterator[str]:
        """Every file under objects/, as a name relative to it."""
        for dirpath, _dirs, names in os.walk(self.objects):
            rel = os.path.relpath(dirpath, self.objects)
            for name in names:
                yield name if rel == "." else f"{rel}/{name}"

    def remove_name(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.objects / name).unlink()

    # -- symbol tables ---------------------------------------------------------------------------
    def symtab_path(self, scope: str, build_id: str) -> Path:
        return self.symtabs / f"{_scope_dir(scope)}{build_id[:2]}" / f"{build_id}.symc"

    def remove_symtab(self, scope: str, build_id: str) -> None:
        self.symtab_path(scope, build_id).unlink(missing_ok=True)

    def count_symtabs(self) -> int:
        return sum(1 for _ in self.symtabs.rglob("*.symc"))

    def clear_symtab_temp(self) -> int:
        """Remove the tables that build workers left half-written when they died (they are
        SIGKILLed with their server): `<build ID>.<writer's pid>.tmp`, beside the table. One
        whose writer is alive stays: another server on this data dir may be building it."""
        return _remove_orphan_temps(self.symtabs.rglob("*.tmp"))

    def clear_table_temp(self, scope: str, build_id: str) -> int:
        """One table's files (`<build ID>.[<part>.]<pid>.tmp`): what its build left when its
        worker died. Called under the table's build lock as that build ends: no other build
        of the table is under way, so they are removed whether or not their writer is gone
        yet. A builder dies with its worker, but the server hears of the worker's death while
        the builder is still being torn down (a libc build has hundreds of MB to unmap):
        taken for a live writer's, its files stayed until the server's next start. A copy
        of the table from the shared bucket (`.bucket-<name>.<pid>.tmp`) is made outside that
        lock: it stays while its writer lives, or the copy under way failed its rename and
        the table was built again."""
        table = self.symtab_path(scope, build_id)
        return _remove_temps(t for t in table.parent.glob(f"{build_id}.*.tmp")
                             if ".bucket-" not in t.name or not _alive(_writer_pid(t.name)))


def _remove_orphan_temps(temps: Iterable[Path]) -> int:
    return _remove_temps(t for t in temps if not _alive(_writer_pid(t.name)))


def _remove_temps(temps: Iterable[Path]) -> int:
    removed = 0
    for temp in temps:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
            removed += 1
    return removed


def _writer_pid(name: str) -> int:
    """The pid in `<build ID>.<pid>.tmp` (symbolize.symtab writes that name); 0 if none."""
    pid = name.removesuffix(".tmp").rpartition(".")[2]
    return int(pid) if pid.isascii() and pid.isdigit() and len(pid) < 10 else 0


def _alive(pid: int) -> bool:
    """Running: neither gone nor a zombie. A builder that died with its worker or server is
    reparented (to PID 1 most likely), and a container's PID 1 may reap it late or never:
    its pid answers kill(pid, 0) all that time, and what it had written stayed."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[:1]
    except FileNotFoundError:  # gone since
        return False
    except OSError:  # no /proc to tell: alive, as kill(pid, 0) says
        return True
    return state not in ([b"Z"], [b"X"])


def flocked(path: Path, *, wait: bool) -> int | None:
    """A descriptor of the file at `path` (made if missing) holding an exclusive flock(2) on
    it, to close to release it; without `wait`, None while another process holds it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:  # its folder removed (the cache cleared by hand): made again
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _release(folder: Path, lock: Path, fd: int) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    lock.unlink(missing_ok=True)
    os.close(fd)


def held(lock: Path) -> bool:
    """Whether a live process holds an flock(2) on `lock`."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock, if this took it
    return False


def _remove_if_dead(lock: Path, folder: Path) -> int:
    """Remove `folder` and its lock when no live process holds the lock; files removed."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # its process is alive
        if not same_file(fd, lock):
            return 0  # another cleanup got there first
        removed = sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0
        shutil.rmtree(folder, ignore_errors=True)
        lock.unlink(missing_ok=True)
        return removed
    finally:
        os.close(fd)


def renamed_after(st: os.stat_result, fetched_at: datetime) -> bool:
    """Whether the file of `st` changed (was renamed into place) after `fetched_at`: a commit's
    time is taken after its file's rename, on the host that has the disk, so the file of a
    row never did, unless something changed its inode since (a chmod, a backup restored), and
    a file put there by a later commit (a fetch after a purge, an upload deleted and made
    again) does, past the kernel's timestamp granularity. To the microsecond, as rows keep
    times."""
    return st.st_ctime_ns // 1000 > (fetched_at - _EPOCH) // _MICROSECOND


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
