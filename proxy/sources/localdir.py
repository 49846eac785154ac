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
import logging
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path

from elftools.common.exceptions import ELFError, ELFParseError
from elftools.elf.elffile import ELFFile

from proxy.errors import UpstreamUnavailable
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


@dataclass(frozen=True, slots=True)
class _Seen:
    """What a file was found to be, at this mtime and size."""

    mtime_ns: int
    size: int
    build_id: str | None
    kinds: tuple[Kind, ...]


def classify(path: Path) -> tuple[str | None, tuple[Kind, ...]]:
    """(build ID, what it can serve as) of a plain ELF file; (None, ()) for anything else."""
    try:
        with path.open("rb") as f:
            if f.read(4) != _ELF_MAGIC:
                return None, ()
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
    except (OSError, ELFError, ELFParseError, ValueError, KeyError, EOFError):
        return None, ()
    if build_id is None:
        return None, ()
    kinds: list[Kind] = []
    if has_code:
        kinds.append(Kind.EXECUTABLE)
    if has_dwarf:  # a debug file, or an unstripped binary that is its own debug file
        kinds.append(Kind.DEBUGINFO)
    return build_id, tuple(kinds)


class LocalDirectory:
    remembers_misses = False

    def __init__(self, root: Path, rescan_s: float, metrics: ProxyMetrics) -> None:
        self.root = root
        self.name = f"dir:{root}"
        self.scope = ""
        metrics.add_upstream(self.name)
        self._rescan_s = rescan_s
        self._metrics = metrics
        self._seen: dict[Path, _Seen] = {}
        self._index: dict[tuple[str, Kind], Path] = {}
        self._task: asyncio.Task[None] | None = None

    def catalogue(self) -> list[tuple[str, Kind, Path]]:
        """Every (build ID, kind, file) the last walk found: what /metadata lists of it."""
        return [(build_id, kind, path) for (build_id, kind), path in self._index.items()]

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
        self._index = await asyncio.to_thread(self._scan)

    def _scan(self) -> dict[tuple[str, Kind], Path]:
        index: dict[tuple[str, Kind], Path] = {}
        seen: dict[Path, _Seen] = {}
        for dirpath, _dirs, files in os.walk(self.root):
            here = Path(dirpath)
            for name in files:
                path = here / name
                rel = path.relative_to(self.root).as_posix()
                if "/.build-id/" in f"/{rel}":
                    m = _BUILD_ID_NAME.match(rel.split(".build-id/", 1)[1])
                    if m:  # the layout names the build ID; the fetch verifies the bytes
                        kind = Kind.DEBUGINFO if m.group(3) else Kind.EXECUTABLE
                        index[(m.group(1) + m.group(2), kind)] = path
                    continue
                try:
                    st = path.stat()
                except OSError:
                    continue
                prev = self._seen.get(path)
                if prev is None or (prev.mtime_ns, prev.size) != (st.st_mtime_ns, st.st_size):
                    prev = _Seen(st.st_mtime_ns, st.st_size, *classify(path))
                seen[path] = prev
                if prev.build_id is not None:
                    for kind in prev.kinds:
                        # The .build-id layout, where present, wins over a plain file.
                        index.setdefault((prev.build_id, kind), path)
        self._seen = seen
        return index

    def has(self, key: ArtifactKey) -> bool:
        # Sections are never asked of a source: the artifact service cuts them from the
        # debuginfo or executable (proxy.artifacts.service), so they are not indexed here.
        return (key.build_id, key.kind) in self._index

    async def open(self, key: ArtifactKey, hop: Hop) -> FileBody | None:
        path = self._index.get((key.build_id, key.kind))
        body = FileBody(self.name, path) if path is not None and path.exists() else None
        result = Outcome.OK if body is not None else Outcome.NOT_FOUND
        self._metrics.upstream_requests.labels(self.name, result).inc()
        return body


class FileBody:
    def __init__(self, source: str, path: Path) -> None:
        self._path = path
        st = path.stat()
        self.meta = ArtifactMeta(upstream=source, size=st.st_size, filename=path.name,
                                 archive=None, last_modified=formatdate(st.st_mtime, usegmt=True))

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            with self._path.open("rb") as f:
                while chunk := await asyncio.to_thread(f.read, CHUNK):
                    yield chunk
        except OSError as e:
            raise UpstreamUnavailable(f"{self.meta.upstream}: cannot read {self._path.name}: "
                                      f"{e.strerror}") from e

    def close(self) -> None:
        pass
