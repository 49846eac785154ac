"""Debug files on local disk, in the layout of /usr/lib/debug: .build-id/xx/rest.debug for
the debug file, .build-id/xx/rest for the executable (usually a symlink to it).

A file found there is taken only when it carries the build ID its name says: a stale tree's
link to another build's file is passed over (the next directory, the cache and upstreams are
asked), never built into a table, nor taken as the reason the build ID has none."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .elf import build_id_of_file
from .supplementary import SupplementLink, supplement_link


def _candidates(dirs: Iterable[Path], build_id: str, suffix: str) -> Iterable[Path]:
    for d in dirs:
        base = d / ".build-id" / build_id[:2] / (build_id[2:] + suffix)
        yield base
        if d.name == ".build-id":  # the .build-id folder itself was configured
            yield d / build_id[:2] / (build_id[2:] + suffix)


def _carries(path: Path, build_id: str) -> bool:
    """Whether `path` is a regular file (links followed: never a FIFO's open, which would
    wait for a writer) with the GNU build ID `build_id`."""
    try:
        return path.is_file() and build_id_of_file(path) == build_id
    except OSError:
        return False


def find_debug_file(dirs: Iterable[Path], build_id: str) -> Path | None:
    return next((p for p in _candidates(dirs, build_id, ".debug") if _carries(p, build_id)),
                None)


def find_executable(dirs: Iterable[Path], build_id: str) -> Path | None:
    return next((p.resolve() for p in _candidates(dirs, build_id, "") if _carries(p, build_id)),
                None)


@dataclass(frozen=True, slots=True)
class LocalFiles:
    """What the local debug directories hold of one build ID."""

    debug: Path | None = None
    executable: Path | None = None
    link: SupplementLink | None = None  # the debug file's dwz supplement link, if any


def find_local(dirs: Iterable[Path], build_id: str) -> LocalFiles:
    """find_debug_file, find_executable and the debug file's supplement link: one call, for a
    caller that looks in a thread."""
    debug = find_debug_file(dirs, build_id)
    return LocalFiles(debug, find_executable(dirs, build_id),
                      supplement_link(debug) if debug is not None else None)
