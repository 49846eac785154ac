"""ELF fixtures built with gcc: stripped executables with detached debug files."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from symbolize.elf import build_id_of_file

MAIN_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include "util.h"

static int __attribute__((noinline)) spin(int n) {
    int acc = 0;
    for (int i = 0; i < n; i++) acc += mix(i, n);
    return acc;
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 1000;
    printf("%d\n", spin(n) + SEED);
    return 0;
}
"""

UTIL_H = r"""
#define SEED %d
static inline int square(int x) { return x * x; }
int mix(int a, int b);
"""

UTIL_C = r"""
#include "util.h"
static inline int twist(int a) { return square(a) ^ (a >> 3); }
int mix(int a, int b) { return twist(a) + square(b); }
"""


@dataclass(frozen=True)
class Elf:
    name: str
    build_id: str
    executable: Path
    debug: Path
    sources: tuple[Path, ...]


@dataclass(frozen=True)
class ElfSet:
    upstream_dir: Path
    prog: Elf
    other: Elf
    big: Elf


def _run(*cmd: str | Path) -> None:
    subprocess.run([str(c) for c in cmd], check=True, capture_output=True)


def build_program(src_dir: Path, out_dir: Path, name: str, seed: int,
                  pad_bytes: int = 0, extra_flags: tuple[str, ...] = ()) -> Elf:
    """Compile a two-file -O2 program, split its debug info off and strip it.

    `seed` makes each program's code, and so its build ID, different; `pad_bytes` adds a
    section of that size to the debug file, for artifacts large enough to stream.
    """
    src = src_dir / name
    src.mkdir(parents=True, exist_ok=True)
    (src / "main.c").write_text(MAIN_C)
    (src / "util.h").write_text(UTIL_H % seed)
    (src / "util.c").write_text(UTIL_C)
    exe = out_dir / name
    debug = out_dir / f"{name}.debug"
    _run("gcc", "-g", "-O2", "-Wl,--build-id", *extra_flags, "-o", exe,
         src / "main.c", src / "util.c")
    _run("objcopy", "--only-keep-debug", exe, debug)
    if pad_bytes:
        pad = src / "pad.bin"
        with pad.open("wb") as f:
            chunk = bytes(range(256)) * 4096
            for _ in range(pad_bytes // len(chunk)):
                f.write(chunk)
        _run("objcopy", "--add-section", f".symgate_pad={pad}", debug)
    _run("objcopy", "--strip-debug", f"--add-gnu-debuglink={debug}", exe)
    build_id = build_id_of_file(exe)
    assert build_id and build_id == build_id_of_file(debug)
    return Elf(name, build_id, exe, debug, (src / "main.c", src / "util.c", src / "util.h"))


def build_elf_set(root: Path) -> ElfSet:
    upstream_dir = root / "upstream"
    upstream_dir.mkdir()
    src = root / "src"
    return ElfSet(
        upstream_dir=upstream_dir,
        prog=build_program(src, upstream_dir, "prog", 1),
        other=build_program(src, upstream_dir, "other", 2),
        big=build_program(src, upstream_dir, "big", 3, pad_bytes=24 * 1024 * 1024),
    )
