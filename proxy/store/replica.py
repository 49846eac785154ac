"""Which replica this process is: the id of the disk its cached files are on.

Several replicas (hosts with disks of their own) may share one database; a row of the
artifacts table names the replica whose disk holds its file, so that one replica's start-up,
eviction and hits only ever act on the files it has. Every process on one cache directory
(`serve --workers N`, a restart overlapping the old process) is one replica: the id is made
once, in the cache directory itself, and read by each of them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

FILE_NAME = "replica-id"
# Rows written before replicas were told apart (migration 0005): the first replica that loads
# them with their file on its disk takes them.
UNCLAIMED = "pre-0005"


def replica_id(cache_dir: Path) -> str:
    """This cache directory's id, made at the first call: 16 random hex digits.

    Made under a temporary name and linked into place, so that processes starting together
    all read the one that won, never a half-written file.
    """
    path = cache_dir / FILE_NAME
    with contextlib.suppress(FileNotFoundError):
        return _read(path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    temp = cache_dir / f".{FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}"
    temp.write_text(secrets.token_hex(8) + "\n")
    try:
        os.link(temp, path)
    except FileExistsError:
        pass  # another process made it first: its id is the one
    finally:
        temp.unlink()
    return _read(path)


def _read(path: Path) -> str:
    text = path.read_text().strip()
    if not text or text == UNCLAIMED or len(text) > 64:
        raise ValueError(f"{path}: not a replica id: {text[:80]!r}")
    return text
