"""The machine's own libc and its detached debug file (Debian's libc6-dbg), and where a live
process has libc mapped."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from symbolize.elf import layout_of_file

LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")


def _build_id() -> str:
    """Read from the file rather than written down, so that a libc upgrade cannot turn the
    tests that need its debug file into silent skips."""
    if not LIBC.exists():
        return ""  # not x86-64 Debian: LIBC_DEBUG does not exist, and those tests skip
    layout = layout_of_file(LIBC)
    if layout is None or not layout.build_id:
        raise RuntimeError(f"symbolize.elf finds no build ID in {LIBC}")
    return layout.build_id


LIBC_ID = _build_id()
LIBC_DEBUG = Path(f"/usr/lib/debug/.build-id/{LIBC_ID[:2]}/{LIBC_ID[2:]}.debug")


def libc_tree(root: Path) -> Path:
    """`root`, made a debug tree (symbolize.debug_dirs) of libc's debug file and libc itself,
    by build ID."""
    folder = root / ".build-id" / LIBC_ID[:2]
    folder.mkdir(parents=True)
    (folder / (LIBC_ID[2:] + ".debug")).symlink_to(LIBC_DEBUG)
    (folder / LIBC_ID[2:]).symlink_to(LIBC)
    return root


def libc_placement(pid: int) -> tuple[int, int, int]:
    """(start, end, file offset) of libc's executable mapping in process `pid`."""
    for _ in range(200):  # the dynamic loader maps libc a moment after exec
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "r-xp" in line and line.rstrip().endswith("libc.so.6"):
                addresses, _perms, offset = line.split()[:3]
                start, end = (int(a, 16) for a in addresses.split("-"))
                return start, end, int(offset, 16)
        time.sleep(0.01)
    raise AssertionError("libc is not mapped")


def libc_functions(limit: int) -> list[int]:
    """Up to `limit` addresses, 4 bytes into functions spread evenly over libc's .symtab."""
    out = subprocess.run(["nm", "--defined-only", str(LIBC_DEBUG)], capture_output=True,
                         text=True, check=True).stdout
    found = sorted({int(a, 16) for a, t, _n in (ln.split()[:3] for ln in out.splitlines()
                                                 if len(ln.split()) == 3) if t in "Tt"})
    step = max(1, len(found) // limit)
    return [a + 4 for a in found[::step]][:limit]
