"""The cache directory: objects/ holds complete, verified files; tmp/ holds downloads under way.

A file only reaches objects/ by rename(2) after it was fsynced, so a crash leaves at worst a
stray file in tmp/ (removed at start-up), never a short file under a final name.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from proxy.keys import ArtifactKey


class DiskStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.objects = root / "objects"
        self.tmp = root / "tmp"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def path_of(self, key: ArtifactKey) -> Path:
        return self.objects / key.storage_name

    def new_temp(self) -> tuple[Path, int]:
        """A fresh temp file opened read-write; the caller owns the descriptor."""
        path = self.tmp / f"{uuid.uuid4().hex}.part"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        return path, fd

    def commit(self, temp: Path, fd: int, key: ArtifactKey) -> Path:
        """Blocking (fsync): run it in a worker thread."""
        os.fsync(fd)
        final = self.path_of(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(temp, final)
        return final

    def remove(self, key: ArtifactKey) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path_of(key).unlink()

    def clear_temp(self) -> int:
        """Remove downloads a previous process left unfinished."""
        removed = 0
        for leftover in self.tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
                removed += 1
        return removed

    def stored_names(self) -> Iterator[str]:
        """Every file under objects/, as a storage name relative to it."""
        for dirpath, _dirs, names in os.walk(self.objects):
            rel = os.path.relpath(dirpath, self.objects)
            for name in names:
                yield name if rel == "." else f"{rel}/{name}"

    def remove_name(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.objects / name).unlink()
