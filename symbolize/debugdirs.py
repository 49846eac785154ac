"""Debug files on local disk, in the layout of /usr/lib/debug: .build-id/xx/rest.debug for
the debug file, .build-id/xx/rest for the executable (usually a symlink to it).

A file found there is taken only when it carries the build ID its name says: a stale tree's
link to another build's file is passed over (the next directory, the cache and upstreams are
asked), never built into a table, nor taken as the reason the build ID has none."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .elf import build_id_of_file


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


def find_both(dirs: Iterable[Path], build_id: str) -> tuple[Path | None, Path | None]:
    """(find_debug_file, find_executable): one call, for a caller that looks in a thread."""
    return find_debug_file(dirs, build_id), find_executable(dirs, build_id)


def has_executable(dirs: Iterable[Path], build_id: str) -> bool:
    """Whether find_executable finds one, without resolving its links."""
    return any(_carries(p, build_id) for p in _candidates(dirs, build_id, ""))
