"""`symgate symbolize -o FILE`: the profile is written whole, or FILE is left as it was.

Path.write_bytes truncated FILE before its first byte: a write that failed on the way (a full
disk, the file-size limit) left a cut profile under the name of a good one. Replacing FILE by
rename(2) from a temp file beside it cured that, but made FILE another file: a hard link to it
kept the old profile, and its owner and group became the writer's (root's, writing into a
user's file). A Unix tool's `-o FILE`, like the shell's `>`, writes into the file that is
there, so that is done, with the room for the whole profile taken before a byte of it is
written: a full disk or the file-size limit leaves FILE as it was. Only a kill midway can cut
it. A new FILE, which nothing else names yet, is made beside and renamed, and `atomic` asks
for that always (readers see the old profile or the new one, never a part of it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path


def write_whole(path: Path, data: bytes, *, atomic: bool = False) -> None:
    """Write `data` to `path` as a plain open would (the umask's mode for a new file; an
    existing one stays the file it is, with its links, owner, group and mode), all or nothing
    short of a kill; with `atomic`, an existing file is replaced in one step instead, with
    its mode, and its owner and group where this process may give them.
    Raises OSError, with no temp file left and an existing file as it was."""
    try:
        st: os.stat_result | None = path.stat()
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        # /dev/stdout, a pipe, /dev/null: a stream to write into, not a file to replace (and
        # a temp file beside /dev/stdout, renamed over it, would have replaced the link in
        # /dev). A directory fails in open, as it did.
        path.write_bytes(data)
        return
    if st is not None and not atomic:
        _write_into(path, data)
        return
    if st is not None:
        # A file open(2) would refuse (read-only, immutable) stays refused: rename(2) asks
        # only the directory, and would have replaced it.
        os.close(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
    # Through a symbolic link to the file it names, as open writes: the link stays a link.
    target = Path(os.path.realpath(path))
    try:
        fd, temp = _create_beside(target)
    except PermissionError:
        if st is None:
            raise
        # A directory that takes no new file (not the user's to write, or immutable) holding
        # a file that is: written into, as a plain open does, or not at all.
        _write_into(path, data)
        return
    try:
        with os.fdopen(fd, "wb") as out:
            if st is not None:
                mode = stat.S_IMODE(st.st_mode)
                try:
                    os.fchown(out.fileno(), st.st_uid, st.st_gid)
                except PermissionError:
                    # Not ours to give, so the file stays ours: without the set-ID bits,
                    # which would otherwise run as the writer, not as the old file's owner.
                    mode &= 0o1777
                os.fchmod(out.fileno(), mode)
            out.write(data)
            out.flush()
            os.fsync(out.fileno())  # the bytes on disk before the name points at them
        os.replace(temp, target)
    except BaseException:  # a KeyboardInterrupt too: no temp file left behind
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _sync_directory(target.parent)


def _write_into(path: Path, data: bytes) -> None:
    """`data` written over the file at `path`, which keeps its inode; the blocks for all of it
    are allocated first, so that ENOSPC or EFBIG come before any byte has changed."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        try:
            os.posix_fallocate(fd, 0, len(data))
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)  # what a failed reservation may have added
                raise
            # A file system that allocates nothing ahead: written as a plain open would.
        view = memoryview(data)
        offset = 0
        while offset < len(data):
            offset += os.pwrite(fd, view[offset:], offset)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_beside(target: Path) -> tuple[int, Path]:
    """A new hidden file in `target`'s directory, created with mode 0o666 so that the kernel
    applies the umask (and a default ACL) as for a plain open; mkstemp's 0o600 would not."""
    # The suffix added must keep it within NAME_MAX (255), which counts bytes: 200
    # characters of a name in Cyrillic or CJK are 400 or 600 of them.
    stem = target.name
    while len(os.fsencode(stem)) > 200:
        stem = stem[:-1]
    while True:
        temp = target.with_name(f".{stem}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                           0o666), temp
        except FileExistsError:
            continue


def _sync_directory(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    # The rename survives a crash of the machine. Its failure is not the write's: the new
    # file is in place and whole, and some file systems cannot fsync a directory.
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)
