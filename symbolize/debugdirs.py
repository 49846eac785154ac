"""Debug files on local disk, in the layout of /usr/lib/debug: .build-id/xx/rest.debug for
the debug file, .build-id/xx/rest for the executable (usually a symlink to it)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def _candidates(dirs: Iterable[Path], build_id: str, suffix: str) -> Iterable[Path]:
    for d in dirs:
        base = d / ".build-id" / build_id[:2] / (build_id[2:] + suffix)
        yield base
        if d.name == ".build-id":  # the .build-id folder itself was configured
            yield d / build_id[:2] / (build_id[2:] + suffix)


def find_debug_file(dirs: Iterable[Path], build_id: str) -> Path | None:
    return next((p for p in _candidates(dirs, build_id, ".debug") if p.is_file()), None)


def find_executable(dirs: Iterable[Path], build_id: str) -> Path | None:
    return next((p.resolve() for p in _candidates(dirs, build_id, "") if p.is_file()), None)


def has_executable(dirs: Iterable[Path], build_id: str) -> bool:
    """Whether find_executable finds one, without resolving its links."""
    return any(p.is_file() for p in _candidates(dirs, build_id, ""))
