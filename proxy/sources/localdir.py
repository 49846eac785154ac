"""A directory of debug files served as if it were an upstream: for sites without internet, or
a site's own binaries.

Two layouts are indexed, in the same tree or apart: the /usr/lib/debug one
(.build-id/xx/rest.debug for the debug file, .build-id/xx/rest for the executable) and plain
directories of ELF files, known by their build-ID notes. The tree is walked again every
`rescan_s` seconds; only new or changed files are opened again.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import stat
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from elftools.common.exceptions import ELFError, ELFParseError
from elftools.elf.elffile import ELFFile

from proxy.errors import UpstreamUnavailable, out_of_descriptors
from proxy.headers import file_date, printable
from proxy.keys import ArtifactKey, Kind
from proxy.metrics import ProxyMetrics
from proxy.sources.base import ArtifactMeta, Hop
from symbolize.elf import build_id_of_stream
from symbolize.outcome import Outcome

log = logging.getLogger(__name__)
CHUNK = 256 * 1024
_BUILD_ID_NAME = re.compile(r"^([0-9a-f]{2})/([0-9a-f]{2,126})(\.debug)?$")
_ELF_MAGIC = b"\x7fELF"
_DWARF_INFO = (".debug_info", ".zdebug_info")
# Gone, or never a file: a dangling link, a loop of links, a directory on the way.
_MISSING = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG)
# No file name is longer (PATH_MAX): what X-DEBUGINFOD-FILE may carry of one.
_MAX_FILENAME = 4096


# What a file was found to be, (build ID, kinds), while its identity (device, inode, mtime,
# ctime, size) is the same: a rename over it, or a chmod, changes its inode or ctime even where
# its mtime and size were kept (`rsync -a`). Plain tuples of numbers and strings, as the whole
# index is: the collector stops looking at those (not at a NamedTuple's, nor at objects),
# where an object per file made each walk of a large tree set off collections of the whole
# heap that stopped the event loop for 0.2-0.4 s.
_Identity = tuple[int, int, int, int, int]
_Seen = tuple[_Identity, str | None, tuple[str, ...]]


def open_regular(path: str | Path) -> tuple[int, os.stat_result] | None:
    """A descriptor on `path` (links followed) and its stat when it is a regular file; None for
    anything else, which is never read: a FIFO's open would wait for a writer forever, a device
    gives no file. Opened without blocking, and judged by what was opened, so that a file
    swapped for one of those after a stat is caught too. OSError when it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as e:
        # What a socket's open gives, and a device's without a driver: no file either, not
        # a disk's trouble to try again for (a 502 for a file the directory does not have).
        if e.errno in (errno.ENXIO, errno.ENODEV):
            return None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if stat.S_ISREG(st.st_mode):
        return fd, st
    os.close(fd)
    return None


def classify(path: str | Path) -> tuple[str | None, tuple[Kind, ...]]:
    """(build ID, what it can serve as) of a plain ELF file; (None, ()) for anything else."""
    try:
        return _classify(path)
    except OSError:
        return None, ()


def _classify(path: str | Path) -> tuple[str | None, tuple[Kind, ...]]:
    """classify; OSError when the file could not be read (to be tried again)."""
    opened = open_regular(path)
    if opened is None:
        return None, ()
    with os.fdopen(opened[0], "rb") as f:
        if f.read(4) != _ELF_MAGIC:
            return None, ()
        try:
            f.seek(0)
            elf = ELFFile(f)
            text = elf.get_section_by_name(".text")
            has_code = text is not None and text["sh_type"] != "SHT_NOBITS"
            # .zdebug_info: compressed by `objcopy --compress-debug-sections=zlib-gnu`, as
            # older Debian and Ubuntu debug packages are (elfutils' debuginfod takes both).
            has_dwarf = any(s.name in _DWARF_INFO and s["sh_type"] != "SHT_NOBITS"
                            for s in elf.iter_sections())
            f.seek(0)
            build_id = build_id_of_stream(f)
        except (ELFError, ELFParseError, ValueError, KeyError, EOFError):
            return None, ()
    if build_id is None:
        return None, ()
    kinds: list[Kind] = []
    if has_code:
        kinds.append(Kind.EXECUTABLE)
    if has_dwarf:  # a debug file, or an unstripped binary that is its own debug file
        kinds.append(Kind.DEBUGINFO)
    return build_id, tuple(kinds)


def _walk(root: str) -> Iterator[str]:
    """The path of every entry under `root` that is not a directory (links to directories are
    not followed, nor listed as directories): with a stack of its own, since os.walk recursed
    once per level and failed on a tree deeper than Python's recursion limit. A directory that
    cannot be read (gone, no permission, a path too long) is passed over, as os.walk does."""
    stack = [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        continue
                    if is_dir:
                        stack.append(entry.path)
                    else:
                        yield entry.path
        except OSError:
            continue


class LocalDirectory:
    remembers_misses = False

    def __init__(self, root: Path, rescan_s: float, metrics: ProxyMetrics) -> None:
        self.root = root
        self.name = self.label = f"dir:{root}"  # a global source's (upstream_label)
        self.scope = ""
        metrics.add_upstream(self.name, self.label)
        self._rescan_s = rescan_s
        self._metrics = metrics
        self._seen: dict[str, _Seen] = {}
        # Kind -> build ID -> path: strings only, nothing for the collector to look at.
        self._index: dict[Kind, dict[str, str]] = {}
        self._task: asyncio.Task[None] | None = None
        # Why the root could not be read at the last walk; None: it could.
        self._unreadable: str | None = None

    def catalogue(self) -> list[tuple[str, Kind, str]]:
        """Every (build ID, kind, file's path) the last walk found: what /metadata lists of it.
        Paths as strings, as they are held: a Path made of each of 100,000 entries took every
        /metadata query 0.2-0.4 s of the event loop."""
        return [(build_id, kind, path) for kind, paths in self._index.items()
                for build_id, path in paths.items()]

    def with_build_id(self, build_id: str) -> list[tuple[str, Kind, str]]:
        """The catalogue's entries of one build ID: looked up, not walked."""
        return [(build_id, kind, paths[build_id]) for kind, paths in self._index.items()
                if build_id in paths]

    async def start(self) -> None:
        await self.rescan()
        if self._rescan_s:
            self._task = asyncio.create_task(self._rescan_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _rescan_forever(self) -> None:
        while True:
            await asyncio.sleep(self._rescan_s)
            try:
                await self.rescan()
            except Exception:  # a transient disk problem must not end the rescans
                log.exception("rescanning %s failed", self.root)

    async def rescan(self) -> None:
        abandoned = threading.Event()
        try:
            self._index = await asyncio.to_thread(self._scan, abandoned)
        except asyncio.CancelledError:
            # The server stops: the walk is told to end, or it went on through the tree (a
            # minute for 30,000 files) and the process's exit waited for its thread.
            abandoned.set()
            raise

    def _check_root(self) -> None:
        """Say when the root cannot be read (a typo, a relative path read from another working
        directory, a mount not there yet), and when it can again, once each: a walk of it
        finds nothing, and every file asked of it was a 404 that no line explained."""
        try:
            with os.scandir(self.root):
                why = None
        except FileNotFoundError:
            why = "no such directory"
        except NotADirectoryError:
            why = "not a directory"
        except OSError as e:
            why = e.strerror or str(e)
        if why == self._unreadable:
            return
        if why is not None:
            log.warning("local directory %s cannot be read (%s): nothing is served from it "
                        "until it can", self.root, why)
        else:
            log.info("local directory %s can be read again", self.root)
        self._unreadable = why

    def _scan(self, abandoned: threading.Event) -> dict[Kind, dict[str, str]]:
        self._check_root()
        index: dict[Kind, dict[str, str]] = {Kind.DEBUGINFO: {}, Kind.EXECUTABLE: {}}
        seen: dict[str, _Seen] = {}
        root = str(self.root)
        prefix = len(os.path.join(root, ""))
        for path in _walk(root):
            if abandoned.is_set():
                return index  # nobody waits for it
            rel = path[prefix:]
            build_id_layout = "/.build-id/" in f"/{rel}"
            try:
                st = os.stat(path)
            except OSError:
                continue  # dangling, a loop of links, gone since it was listed
            if not stat.S_ISREG(st.st_mode):
                continue  # a FIFO, socket, device or directory: nothing to open, or serve
            if build_id_layout:
                # After the last .build-id directory: the first ".build-id/" of the path may
                # end another name ("app.build-id/.build-id/ab/..."), whose files then matched
                # nothing and were indexed under no build ID at all.
                m = _BUILD_ID_NAME.match(f"/{rel}".rsplit("/.build-id/", 1)[1])
                if m:  # the layout names the build ID; the fetch verifies the bytes
                    kind = Kind.DEBUGINFO if m.group(3) else Kind.EXECUTABLE
                    index[kind][m.group(1) + m.group(2)] = path
                continue
            identity = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
            prev = self._seen.get(path)
            if prev is None or prev[0] != identity:
                try:
                    found, kinds = _classify(path)
                except OSError:
                    continue  # unreadable now (EACCES, EIO): not remembered, tried again
                prev = (identity, found, tuple(str(k) for k in kinds))
            seen[path] = prev
            _, build_id, kind_names = prev
            if build_id is not None:
                for name in kind_names:
                    # The .build-id layout, where present, wins over a plain file.
                    index[Kind(name)].setdefault(build_id, path)
        self._seen = seen
        return index

    def has(self, key: ArtifactKey) -> bool:
        # Sections are never asked of a source: the artifact service cuts them from the
        # debuginfo or executable (proxy.artifacts.service), so they are not indexed here.
        return key.build_id in self._index.get(key.kind, {})

    async def open(self, key: ArtifactKey, hop: Hop) -> FileBody | None:
        path = self._index.get(key.kind, {}).get(key.build_id)
        body = None
        if path is not None:
            try:  # in a thread: a slow disk (NFS) must not hold the loop
                opened = await asyncio.to_thread(open_regular, path)
            except OSError as e:
                if (full := out_of_descriptors(e)) is not None:
                    # This server's passing trouble (a 503, retry later), as an HTTP
                    # upstream's connect without a descriptor is: not the directory's failure.
                    raise full from e
                if e.errno not in _MISSING:
                    self._metrics.upstream_requests.labels(self.label, Outcome.UPSTREAM_ERROR).inc()
                    raise UpstreamUnavailable(f"{self.name}: cannot open "
                                              f"{os.path.basename(path)!r}: {e.strerror}") from e
                opened = None  # gone since the walk: not had
            if opened is not None:
                body = FileBody(self.name, path, *opened)
        result = Outcome.OK if body is not None else Outcome.NOT_FOUND
        self._metrics.upstream_requests.labels(self.label, result).inc()
        return body


class FileBody:
    """A file of the directory, open: what is sent is the file that was opened, whatever the
    tree's names point at meanwhile."""

    def __init__(self, source: str, path: str, fd: int, st: os.stat_result) -> None:
        self._fd: int | None = fd
        self._path = path
        name = os.path.basename(path)
        # A header carries text without control characters: a name that is not such text (a
        # newline, bytes that are not UTF-8) is not sent, nor stored; the default name is.
        self.meta = ArtifactMeta(upstream=source, size=st.st_size,
                                 filename=printable(name, _MAX_FILENAME), archive=None,
                                 last_modified=file_date(st.st_mtime))

    async def chunks(self) -> AsyncIterator[bytes]:
        fd, offset = self._fd, 0
        if fd is None:
            return
        try:
            while chunk := await asyncio.to_thread(os.pread, fd, CHUNK, offset):
                offset += len(chunk)
                yield chunk
        except OSError as e:
            raise UpstreamUnavailable(f"{self.meta.upstream}: cannot read "
                                      f"{os.path.basename(self._path)!r}: {e.strerror}") from e

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
