"""ELF fixtures built with gcc: stripped executables with detached debug files."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
import struct
import subprocess
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

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


CPP_SRC = r"""
#include <cstdio>
#include <vector>
namespace shapes {
template <typename T> struct Acc {
    std::vector<T> v;
    T __attribute__((noinline)) total(T k) const { T s = 0; for (T x : v) s += x * k; return s; }
};
}
int main(int argc, char **) {
    shapes::Acc<long> acc;
    for (int i = 0; i < argc * 1000; i++) acc.v.push_back(i);
    std::printf("%ld\n", acc.total(argc));
    return 0;
}
"""


@dataclass(frozen=True)
class ElfSet:
    upstream_dir: Path
    prog: Elf  # PIE
    other: Elf
    big: Elf
    nopie: Elf  # ET_EXEC
    shlib: Elf  # ET_DYN shared library
    cpp: Elf  # C++, for demangling
    aliased: Elf  # a stripped shared library exporting one function under several names

    @property
    def all(self) -> tuple[Elf, ...]:
        return (self.prog, self.other, self.big, self.nopie, self.shlib, self.cpp)

    def named(self, name: str) -> Elf:
        return next(e for e in self.all if e.name == name)


T = TypeVar("T")


def on_descriptor(path: Path, read: Callable[[int], T]) -> T:
    """`read` of a descriptor open on `path`, as the quick ELF readers are called."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read(fd)
    finally:
        os.close(fd)


def real_elf_files(elfs: ElfSet) -> list[Path]:
    """Every fixture's executable and debug file, and the machine's libc and shell."""
    from tests.libc import LIBC, LIBC_DEBUG

    files = [p for e in (*elfs.all, elfs.aliased) for p in (e.executable, e.debug)]
    return files + [p for p in (LIBC, LIBC_DEBUG, Path("/bin/sh").resolve()) if p.exists()]


def broken_copies(original: bytes, seed: int) -> list[bytes]:
    """Damaged copies of an ELF64 little-endian file's bytes, for the quick readers: cut
    short, bytes flipped (many in the headers), random bytes, tables moved past the end."""
    rng = random.Random(seed)
    cases = [original[:n] for n in (0, 3, 40, 63, 64, 200, len(original) // 2,
                                    len(original) - 1)]
    for _ in range(300):  # bytes flipped anywhere, many in the headers
        data = bytearray(original)
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(data)) if rng.random() < 0.5 else rng.randrange(
                min(len(data), 4096))
            data[at] = rng.randrange(256)
        cases.append(bytes(data))
    cases.append(bytes(rng.randrange(256) for _ in range(5000)))
    # Tables said to be far past the end, and extended counts (0 sections, PN_XNUM).
    cases.append(original[:0x20] + struct.pack("<Q", 1 << 62) + original[0x28:])
    cases.append(original[:0x28] + struct.pack("<Q", 1 << 40) + original[0x30:])
    cases.append(original[:0x38] + struct.pack("<H", 0xFFFF) + original[0x3A:])
    cases.append(original[:0x3C] + struct.pack("<H", 0) + original[0x3E:])
    return cases


def build_id_tree(root: Path, build_id: str, debug: Path, executable: Path) -> Path:
    """A /usr/lib/debug-style tree at `root` for one program, as Fedora's trees have it:
    .build-id/xx/rest.debug links to its debug file, .build-id/xx/rest to the program."""
    d = root / ".build-id" / build_id[:2]
    d.mkdir(parents=True, exist_ok=True)  # another program's build ID may start alike
    (d / (build_id[2:] + ".debug")).symlink_to(debug)
    (d / build_id[2:]).symlink_to(executable)
    return root


def _run(*cmd: str | Path) -> None:
    subprocess.run([str(c) for c in cmd], check=True, capture_output=True)


def build_program(src_dir: Path, out_dir: Path, name: str, seed: int,
                  pad_bytes: int = 0, extra_flags: tuple[str, ...] = (),
                  shape: str = "exe") -> Elf:
    """Compile an -O2 program (`shape` exe, or shlib for a shared library of util.c, or cpp),
    split its debug info off and strip it.

    `seed` makes each program's code, and so its build ID, different; `pad_bytes` adds a
    section of that size to the debug file, for artifacts large enough to stream.
    """
    src = src_dir / name
    src.mkdir(parents=True, exist_ok=True)
    (src / "main.c").write_text(MAIN_C)
    (src / "util.h").write_text(UTIL_H % seed)
    (src / "util.c").write_text(UTIL_C)
    (src / "main.cpp").write_text(CPP_SRC)
    exe = out_dir / name
    debug = out_dir / f"{name}.debug"
    sources: tuple[Path, ...] = (src / "main.c", src / "util.c", src / "util.h")
    if shape == "shlib":
        _run("gcc", "-g", "-O2", "-fPIC", "-shared", "-Wl,--build-id", *extra_flags,
             "-o", exe, src / "util.c")
    elif shape == "cpp":
        _run("g++", "-g", "-O2", "-Wl,--build-id", *extra_flags, "-o", exe, src / "main.cpp")
        sources = (src / "main.cpp",)
    else:
        _run("gcc", "-g", "-O2", "-Wl,--build-id", *extra_flags, "-o", exe,
             src / "main.c", src / "util.c")
    _run("objcopy", "--only-keep-debug", exe, debug)
    if pad_bytes:
        pad = src / "pad.bin"
        with pad.open("wb") as f:
            chunk = bytes(range(256)) * 4096
            for _ in range(pad_bytes // len(chunk)):
                f.write(chunk)
            f.write(chunk[: pad_bytes % len(chunk)])
        _run("objcopy", "--add-section", f".symgate_pad={pad}", debug)
    _run("objcopy", "--strip-debug", f"--add-gnu-debuglink={debug}", exe)
    build_id = build_id_of_file(exe)
    assert build_id and build_id == build_id_of_file(debug)
    return Elf(name, build_id, exe, debug, sources)


ALIASED_C = r"""
#include <stdio.h>
extern void __attribute__((cold)) report(const char *, int);
/* One function exported under several names; its DWARF name is its own, not exported. */
static int __attribute__((noinline)) mix_impl(int x) { return x * 3 + (x >> 2); }
int mix_a(int) __attribute__((alias("mix_impl")));
int mix_b(int) __attribute__((alias("mix_impl")));
int mix_c(int) __attribute__((alias("mix_impl")));
int mix_d(int) __attribute__((alias("mix_impl")));
/* GCC splits the path to a cold call off, into checked.cold. */
int checked(int *v, int n) {
    int s = 0;
    for (int i = 0; i < n; i++) {
        if (v[i] < 0) {
            report("negative", i);
            report("value", v[i]);
            s = -s;
        }
        s += mix_impl(v[i]);
    }
    return s;
}
void report(const char *what, int x) { fprintf(stderr, "%s %d\n", what, x); }
"""


ALIASES = ("mix_a", "mix_b", "mix_c", "mix_d")


# glibc's libc_hidden_proto and libc_hidden_def: the library calls a function by a hidden asm
# label, `__GI_name` (its DW_AT_linkage_name), and defines the C name as an alias of it:
# exported (`scaled`, `checked_sum`), or hidden too (`convert`, an internal function: both of
# its names local symbols). `scaled` is inlined into both callers, `checked_sum` split cold.
ASM_LABELLED_C = r"""
#include <stdio.h>
#define hidden_proto(name) \
    extern __typeof(name) name __asm__("__GI_" #name) __attribute__((visibility("hidden")));
#define hidden_def(name) \
    extern __typeof(name) __EI_##name __asm__(#name) __attribute__((alias("__GI_" #name)));
#define internal_def(name) extern __typeof(name) __EI_##name __asm__(#name) \
    __attribute__((alias("__GI_" #name), visibility("hidden")));
extern void __attribute__((cold, noinline)) complain(const char *, int);
int scaled(int x);
hidden_proto(scaled)
int convert(const char *s, int n);
hidden_proto(convert)
int checked_sum(const int *v, int n);
hidden_proto(checked_sum)
int scaled(int x) { return x * 7 + (x >> 3); }
hidden_def(scaled)
int __attribute__((noinline)) convert(const char *s, int n) {
    int r = 0;
    for (int i = 0; i < n && s[i]; i++)
        r = r * 10 + (s[i] - '0');
    return scaled(r);
}
internal_def(convert)
int checked_sum(const int *v, int n) {
    int s = 0;
    for (int i = 0; i < n; i++) {
        if (v[i] < 0) {
            complain("negative", i);
            complain("value", v[i]);
            s = -s;
        }
        s += scaled(v[i]) + convert("12", i);
    }
    return s;
}
hidden_def(checked_sum)
void complain(const char *what, int x) { fprintf(stderr, "%s %d\n", what, x); }
"""


def build_aliased_library(out_dir: Path, source: str = ALIASED_C, name: str = "libfx.so"
                          ) -> Elf:
    """`source` (ALIASED_C unless told) as a shared library, its debug file split off and the
    library stripped as distributions ship them: .dynsym alone, which llvm-symbolizer then
    names code by."""
    stem = name.removesuffix(".so").removeprefix("lib")
    src = out_dir.parent / "src" / f"{stem}.c" if out_dir.name == "upstream" \
        else out_dir / f"{stem}.c"
    src.parent.mkdir(parents=True, exist_ok=True)
    exe, debug = out_dir / name, out_dir / f"{name}.debug"
    src.write_text(source)
    _run("gcc", "-g", "-O2", "-fPIC", "-shared", "-Wl,--build-id", "-o", exe, src)
    _run("objcopy", "--only-keep-debug", exe, debug)
    _run("objcopy", "--strip-all", f"--add-gnu-debuglink={debug}", exe)
    build_id = build_id_of_file(exe)
    assert build_id and build_id == build_id_of_file(debug)
    return Elf(name, build_id, exe, debug, (src,))


def build_elf_set(root: Path) -> ElfSet:
    upstream_dir = root / "upstream"
    upstream_dir.mkdir()
    src = root / "src"
    return ElfSet(
        upstream_dir=upstream_dir,
        prog=build_program(src, upstream_dir, "prog", 1),
        other=build_program(src, upstream_dir, "other", 2),
        big=build_program(src, upstream_dir, "big", 3, pad_bytes=24 * 1024 * 1024),
        nopie=build_program(src, upstream_dir, "nopie", 4, extra_flags=("-no-pie", "-fno-pie")),
        shlib=build_program(src, upstream_dir, "libmix.so", 5, shape="shlib"),
        cpp=build_program(src, upstream_dir, "cpp", 6, shape="cpp"),
        aliased=build_aliased_library(upstream_dir),
    )


def compress_debug_sections_zstd(path: Path) -> None:
    """Compress every .debug_* section of the ELF64 little-endian file at `path` with zstd
    (SHF_COMPRESSED, ELFCOMPRESS_ZSTD), as `objcopy --compress-debug-sections=zstd` does where
    binutils was built with zstd (Debian 12's silently leaves the sections as they are)."""
    zstd = ctypes.CDLL(ctypes.util.find_library("zstd") or "libzstd.so.1")
    zstd.ZSTD_compressBound.restype = ctypes.c_size_t
    zstd.ZSTD_compressBound.argtypes = [ctypes.c_size_t]
    zstd.ZSTD_compress.restype = ctypes.c_size_t
    zstd.ZSTD_compress.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                                   ctypes.c_size_t, ctypes.c_int]
    data = bytearray(path.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    count, names_at = struct.unpack_from("<HH", data, 0x3C)
    row = "<IIQQQQIIQQ"  # name, type, flags, addr, offset, size, link, info, align, entsize
    names = struct.unpack_from(row, data, shoff + names_at * 64)[4]
    for i in range(count):
        name, kind, flags, addr, offset, size, link, info, align, entsize = struct.unpack_from(
            row, data, shoff + i * 64)
        own = data[names + name:data.index(b"\0", names + name)]
        if not own.startswith(b".debug_") or kind == 8 or flags & 0x800 or not size:
            continue
        raw = bytes(data[offset:offset + size])
        out = ctypes.create_string_buffer(zstd.ZSTD_compressBound(size))
        n = zstd.ZSTD_compress(out, len(out), raw, size, 19)
        data.extend(bytes(-len(data) % 8))
        at = len(data)
        data += struct.pack("<IIQQ", 2, 0, size, align or 1) + out.raw[:n]
        struct.pack_into(row, data, shoff + i * 64, name, kind, flags | 0x800, addr, at,
                         len(data) - at, link, info, 8, entsize)
    path.write_bytes(data)


def replace_section_compressed(path: Path, section: str, stream: bytes, claimed: int | None,
                               kind: int = 1) -> None:
    """Make the section `section` of the ELF64 little-endian file at `path` SHF_COMPRESSED,
    its contents `stream` (zlib's, `kind` 1, unless another ch_type is given) appended to the
    file under a compression header that says it inflates to `claimed` bytes (no header at
    all if None): what a hostile upstream serves, the build-ID note untouched."""
    data = bytearray(path.read_bytes())
    row = _section_row(data, section, path)
    data.extend(bytes(-len(data) % 8))
    at = len(data)
    data += (b"" if claimed is None else struct.pack("<IIQQ", kind, 0, claimed, 1)) + stream
    flags, = struct.unpack_from("<Q", data, row + 8)
    struct.pack_into("<Q", data, row + 8, flags | 0x800)
    struct.pack_into("<QQ", data, row + 24, at, len(data) - at)
    path.write_bytes(data)


def set_section_extent(path: Path, section: str, offset: int, size: int) -> None:
    """Make the header of section `section` of the ELF64 little-endian file at `path` say its
    bytes are `size` at `offset`, whatever the file holds: a hostile upstream's file."""
    data = bytearray(path.read_bytes())
    struct.pack_into("<QQ", data, _section_row(data, section, path) + 24, offset, size)
    path.write_bytes(data)


def _section_row(data: bytearray, section: str, path: Path) -> int:
    """Where the header of the section called `section` is in `data`, an ELF64 LE file's."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    count, names_at = struct.unpack_from("<HH", data, 0x3C)
    names = struct.unpack_from("<Q", data, shoff + names_at * 64 + 24)[0]
    for i in range(count):
        row = shoff + i * 64
        name, = struct.unpack_from("<I", data, row)
        if data[names + name:data.index(b"\0", names + name)] == section.encode():
            return row
    raise ValueError(f"{path.name} has no section {section}")


def zlib_of_zeros(size: int) -> bytes:
    """A zlib stream that inflates to `size` zero bytes (a thousandth of that deflated),
    made a MiB at a time."""
    packer = zlib.compressobj(9)
    chunk = bytes(1 << 20)
    out = [packer.compress(chunk) for _ in range(size >> 20)]
    return b"".join([*out, packer.compress(bytes(size & ((1 << 20) - 1))), packer.flush()])


def go_build(work: Path, source: str, module: str, *, ldflags: str = "",
             cgo: bool = False) -> tuple[Path, dict[str, str]]:
    """The Go program `source` (its main.go) as module `module`, built offline in `work`:
    the executable, and the environment its build had (for `go tool`, or to run it)."""
    src = work / "gosrc"
    src.mkdir()
    (src / "main.go").write_text(source)
    (src / "go.mod").write_text(f"module {module}\n\ngo 1.19\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "GOCACHE": str(work / "cache"),
           "GOPATH": str(work / "gopath"), "GOFLAGS": "-mod=mod", "GOPROXY": "off",
           "GOTOOLCHAIN": "local", **({"CGO_ENABLED": "1"} if cgo else {})}
    exe = work / "prog"
    subprocess.run(["go", "build", *([f"-ldflags={ldflags}"] if ldflags else []), "-o",
                    str(exe), "."], cwd=src, env=env, check=True, capture_output=True,
                   timeout=300)
    return exe, env
