"""Every path symgate writes: cached artifacts, downloads under way, and symbol tables.

objects/ holds complete, verified files; tmp/ holds downloads under way. A file only reaches
objects/ by rename(2) after it was fsynced, so a crash leaves at worst a stray file in tmp/
(removed at start-up), never a short file under a final name. Symbol tables live under
symtabs/. What a tenant's own sources gave lives under a `tenants/<hash>/` folder of each, so
a tenant's name (any string) never becomes part of a path.

Nothing else builds these paths: the artifact service, the symbol service and the admin
commands all ask the Store.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Iterator
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

    def commit(self, temp: Path, fd: int, scope: str, key: ArtifactKey) -> Path: ...

    def remove_artifact(self, scope: str, key: ArtifactKey) -> None: ...

    def clear_temp(self) -> int: ...

    def stored_names(self) -> Iterator[str]: ...

    def remove_name(self, name: str) -> None: ...

    def symtab_path(self, scope: str, build_id: str) -> Path: ...

    def remove_symtab(self, scope: str, build_id: str) -> None: ...

    def count_symtabs(self) -> int: ...


class DiskStore:
    def __init__(self, cache_dir: Path, symtab_dir: Path) -> None:
        self.objects = cache_dir / "objects"
        self.tmp = cache_dir / "tmp"
        self.symtabs = symtab_dir
        for d in (self.objects, self.tmp, self.symtabs):
            d.mkdir(parents=True, exist_ok=True)

    # -- artifacts -------------------------------------------------------------------------------
    def artifact_name(self, scope: str, key: ArtifactKey) -> str:
        return _scope_dir(scope) + key.storage_name

    def artifact_path(self, scope: str, key: ArtifactKey) -> Path:
        return self.objects / self.artifact_name(scope, key)

    def new_temp(self) -> tuple[Path, int]:
        """A fresh temp file opened read-write; the caller owns the descriptor."""
        path = self.tmp / f"{uuid.uuid4().hex}.part"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        return path, fd

    def commit(self, temp: Path, fd: int, scope: str, key: ArtifactKey) -> Path:
        """Blocking (fsync): run it in a worker thread."""
        os.fsync(fd)
        final = self.artifact_path(scope, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(temp, final)
        return final

    def remove_artifact(self, scope: str, key: ArtifactKey) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.artifact_path(scope, key).unlink()

    def clear_temp(self) -> int:
        """Remove downloads a previous process left unfinished."""
        removed = 0
        for leftover in self.tmp.iterdir():
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
                removed += 1
        return removed

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
