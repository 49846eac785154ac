"""`symgate symbolize -o FILE`: the profile is written whole, or FILE is left as it was.

Path.write_bytes truncated FILE before its first byte: a write that failed on the way (a full
disk, the file-size limit) or a killed command left a cut profile under the name of a good one,
and any profile FILE held before was gone. The bytes go to a hidden file beside FILE first,
are fsynced, and take FILE's name by rename(2), which replaces it in one step.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def write_whole(path: Path, data: bytes) -> None:
    """Write `data` to `path` as a plain open would (the umask's mode for a new file, the old
    file's mode for one replaced), all or nothing where its directory takes a new file.
    Raises OSError, with no temp file left."""
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
        path.write_bytes(data)
        return
    try:
        with os.fdopen(fd, "wb") as out:
            if st is not None:
                os.fchmod(out.fileno(), stat.S_IMODE(st.st_mode) & 0o777)
            out.write(data)
            out.flush()
            os.fsync(out.fileno())  # the bytes on disk before the name points at them
        os.replace(temp, target)
    except BaseException:  # a KeyboardInterrupt too: no temp file left behind
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _sync_directory(target.parent)


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
