"""Programs built as sites build them beyond plain `gcc -g`: split DWARF (`-gsplit-dwarf`,
whose .dwo files a debug tree does not ship), static programs split by eu-strip, scored against
llvm-symbolizer on the same files, offline and through a server; Go programs' own build IDs."""

from __future__ import annotations

import asyncio
import lzma
import posixpath
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from symbolize.elf import build_id_of_file, function_symbols
from symbolize.offline import symbolize_bytes
from symbolize.pipeline import Limits
from symbolize.pprof.profile_pb2 import Profile
from tests.elfs import Elf, compress_debug_sections_zstd, go_build
from tests.harness import SymgateFactory
from tests.profiles import (
    Expected,
    Placed,
    code_addresses,
    frames_of,
    llvm_symbolize,
    make_profile,
    place,
    symbol_aliases,
)
from tests.rewriting import table_frames
from tests.symbolize_helpers import parse, post, same_frames, symbolize_config

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

# `process` has unlikely paths (abort, a cold function) that gcc -O2 moves into `process.cold`.
SPLIT_C = r"""
#include <stdio.h>
#include <stdlib.h>
static inline int sq(int x) { return x * x; }
static inline int sum_sq(const int *v, int n) {
    int s = 0;
    for (int i = 0; i < n; i++)
        s += sq(v[i]);
    return s;
}
__attribute__((cold, noinline)) void fail(const char *why) {
    fprintf(stderr, "fail: %s\n", why);
    exit(2);
}
int process(int *v, int n) {
    if (n > 1000) {
        fprintf(stderr, "too many %d\n", n);
        abort();
    }
    if (!v) fail("null");
    return sum_sq(v, n);
}
int main(int argc, char **argv) {
    int v[64];
    for (int i = 0; i < 64; i++) v[i] = argc * i + (int)argv[0][0];
    printf("%d\n", process(v, argc > 3 ? 2000 : 64));
    return 0;
}
"""


def _split_dwarf_program(tmp_path: Path, dwarf: str) -> tuple[Elf, Path]:
    """A gcc -O2 -gsplit-dwarf program, stripped, its debug file in a build-ID tree, and its
    .dwo file deleted, as a site's debug tree has it (the .dwo stays in the build directory)."""
    build = tmp_path / f"build-{dwarf}"
    build.mkdir()
    (build / "main.c").write_text(SPLIT_C)
    exe = build / "prog"
    subprocess.run(["gcc", "-O2", "-g", f"-g{dwarf}", "-gsplit-dwarf", "main.c", "-o", "prog"],
                   cwd=build, check=True, capture_output=True)
    dwos = list(build.glob("*.dwo"))
    assert dwos, "gcc wrote no .dwo file"
    for dwo in dwos:
        dwo.unlink()
    debug, stripped = build / "prog.debug", build / "prog.stripped"
    subprocess.run(["objcopy", "--only-keep-debug", str(exe), str(debug)], check=True)
    subprocess.run(["objcopy", "--strip-all", f"--add-gnu-debuglink={debug}", str(exe),
                    str(stripped)], check=True)
    build_id = build_id_of_file(exe)
    assert build_id
    tree = tmp_path / f"debug-{dwarf}"
    at = tree / ".build-id" / build_id[:2]
    at.mkdir(parents=True)
    shutil.copy(debug, at / (build_id[2:] + ".debug"))
    shutil.copy(stripped, at / build_id[2:])
    return Elf("prog", build_id, exe, debug, ()), tree


async def _offline_and_served(start_symgate: SymgateFactory, tree: Path, sent: bytes
                              ) -> tuple[list[tuple[str, Profile]], dict[str, str]]:
    """The profile `sent` symbolized offline and by a server, both over the debug tree `tree`:
    [("offline", answer), ("server", answer)], and the server's headers."""
    offline, _report = await asyncio.to_thread(symbolize_bytes, sent, [tree],
                                               Limits(1 << 30, max_build_ids=10))
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tree,)))
    status, headers, body = await post(sg, sent)
    assert status == 200, body
    return [("offline", parse(offline)), ("server", parse(body))], headers


def _assert_frames(answers: list[tuple[str, Profile]], placed: Placed,
                   expected: dict[int, list[Expected]]) -> None:
    """Every answer has the expected frames at each address (ELF-relative, placed)."""
    for mode, out in answers:
        by_address = {loc.address: loc for loc in out.location}
        wrong = [(hex(v), frames_of(out, by_address[placed.runtime(v)]), frames)
                 for v, frames in expected.items()
                 if not same_frames(frames_of(out, by_address[placed.runtime(v)]), frames)]
        assert not wrong, (mode, len(wrong), wrong[:3])


@pytest.mark.parametrize("dwarf", ["dwarf-5", "dwarf-4"])
async def test_split_dwarf_cold_parts_are_named_as_without_split_dwarf(
        start_symgate: SymgateFactory, tmp_path: Path, dwarf: str) -> None:
    """Without its .dwo files a split-DWARF program has line tables but no subprograms: its
    code is named by .symtab and lined by the line table. An address in a `.cold` part was
    named after its function (`process`), where llvm-symbolizer and eu-addr2line say
    `process.cold`, as symgate itself names it in a program built without -gsplit-dwarf."""
    elf, tree = _split_dwarf_program(tmp_path, dwarf)
    cold = [s for s in function_symbols(elf.executable) if s.name == "process.cold"]
    assert cold, "gcc made no process.cold"
    vaddrs = code_addresses(elf)
    expected = llvm_symbolize(elf.executable, vaddrs)
    in_cold = [v for v in vaddrs if cold[0].value <= v < cold[0].value + cold[0].size]
    assert in_cold and all(expected[v][-1].function == "process.cold" and expected[v][-1].line
                           for v in in_cold)
    placed = place(elf, 0x55D0C0DE0000)
    sent = make_profile([(placed, vaddrs)]).SerializeToString()
    answers, headers = await _offline_and_served(start_symgate, tree, sent)
    assert headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    _assert_frames(answers, placed, expected)


STATIC_C = r"""
#include <stdio.h>
#include <string.h>
__attribute__((noinline)) int count(const char *s) { return (int)strlen(s) * 3; }
int main(int argc, char **argv) {
    printf("%d\n", count(argv[0]) + argc);
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("eu-strip") is None, reason="needs elfutils")
async def test_a_static_program_split_by_eu_strip_is_named_by_its_symbol_table(
        start_symgate: SymgateFactory, tmp_path: Path) -> None:
    """eu-strip -f (Fedora's and RHEL's find-debuginfo) keeps .symtab in a static program,
    whose relocations (.rela.plt's IRELATIVE) name it, and leaves the debug file's empty
    (SHT_NOBITS). With both at hand, symgate read the debug file's alone: libc's code, all
    of the program but main, got no name, where llvm-symbolizer, eu-addr2line and addr2line
    name it by the program's .symtab."""
    build = tmp_path / "build"
    build.mkdir()
    (build / "main.c").write_text(STATIC_C)
    exe, debug, stripped = build / "prog", build / "prog.debug", build / "prog.stripped"
    subprocess.run(["gcc", "-O2", "-g", "-static", "main.c", "-o", "prog"], cwd=build,
                   check=True, capture_output=True)
    subprocess.run(["eu-strip", "--remove-comment", "-f", str(debug), "-o", str(stripped),
                    str(exe)], check=True, capture_output=True)
    assert function_symbols(stripped) and not function_symbols(debug)  # as eu-strip does
    build_id = build_id_of_file(exe)
    assert build_id
    tree = tmp_path / "debug"
    at = tree / ".build-id" / build_id[:2]
    at.mkdir(parents=True)
    shutil.copy(debug, at / (build_id[2:] + ".debug"))
    shutil.copy(stripped, at / build_id[2:])
    elf = Elf("prog", build_id, stripped, debug, ())
    vaddrs = code_addresses(elf)[::7]
    expected = llvm_symbolize(exe, vaddrs)
    assert len(expected) > 1000
    aliases = symbol_aliases(exe)
    placed = place(elf, 0)
    sent = make_profile([(placed, vaddrs)]).SerializeToString()
    answers, _headers = await _offline_and_served(start_symgate, tree, sent)
    for mode, out in answers:
        by_address = {loc.address: loc for loc in out.location}
        unnamed, wrong = [], []
        for v, frames in expected.items():
            got = frames_of(out, by_address[placed.runtime(v)])
            if not got:
                unnamed.append(hex(v))
            elif frames[-1].line:  # main and count: by DWARF
                if not same_frames(got, frames):
                    wrong.append((hex(v), got, frames))
            elif got[-1].system_name not in aliases.get(frames[-1].system_name,
                                                        {frames[-1].system_name}):
                wrong.append((hex(v), got, frames))
        assert not unnamed, (mode, len(unnamed), unnamed[:5])
        assert not wrong, (mode, len(wrong), wrong[:3])


GO_MAIN = """package main

import "fmt"

//go:noinline
func work(n int) int { return n*n + 1 }

func main() { fmt.Println(work(7)) }
"""


@pytest.mark.skipif(shutil.which("go") is None, reason="needs Debian's golang-go")
async def test_a_go_build_id_is_explained_not_taken_for_a_missing_one(
        start_symgate: SymgateFactory, tmp_path: Path) -> None:
    """A Go program linked without -B carries only a Go build ID, which profilers that
    fall back on it send (hex-encoded) as the mapping's build ID. /symbolize counts it as
    invalid_build_id; `symgate inspect` said 'no build ID: the profiler did not record one.
    Link with -Wl,--build-id', which is neither true nor a fix for a Go program."""
    from proxy.tools.inspect_profile import inspect_profile
    from tests.harness import make_config

    exe, env = go_build(tmp_path, GO_MAIN, "example.com/gobid")
    assert build_id_of_file(exe) is None  # no GNU build ID
    go_id = subprocess.run(["go", "tool", "buildid", str(exe)], env=env, check=True,
                           capture_output=True, text=True).stdout.strip()
    p = Profile()
    p.string_table.extend(["", str(exe), go_id.encode().hex()])
    p.mapping.add(id=1, memory_start=0x401000, memory_limit=0x480000, filename=1, build_id=2)
    p.location.add(id=1, mapping_id=1, address=0x401010)
    body = p.SerializeToString()
    sg = await start_symgate([], symbolize=symbolize_config())
    status, headers, _body = await post(sg, body)
    assert status == 200
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "invalid_build_id=1", headers
    config = make_config(tmp_path / "data", f"sqlite+aiosqlite:///{tmp_path / 'i.sqlite'}", [])
    rows = await inspect_profile(body, config, server=None, timeout_s=1, max_decompressed=1 << 20)
    assert [r.would_symbolize for r in rows] == [False]
    assert "Go build ID" in rows[0].verdict and "-B" in rows[0].verdict, rows[0].verdict
    assert "did not record one" not in rows[0].verdict


def _gc_source() -> str:
    """A function of some 18 KB that nothing calls, before the two that run."""
    body = "\n".join(f"    acc = acc * {i + 3} + v[{i % 16}] * (acc >> {i % 13});"
                     for i in range(900))
    return ("#include <stdio.h>\n"
            f"__attribute__((noinline)) long unused_big(long *v) {{\n    long acc = 1;\n{body}\n"
            "    return acc;\n}\n"
            "__attribute__((noinline)) long used(long *v) { return v[0] * 3 + v[1]; }\n"
            "int main(int argc, char **argv) {\n    long v[16] = {argc};\n"
            '    printf("%ld\\n", used(v));\n    return 0;\n}\n')


@pytest.mark.parametrize("compiler", ["gcc", "clang", "gcc -gz", "gcc | zlib-gnu",
                                      "gcc | zstd", "gcc -Wl,-z,noseparate-code",
                                      "gcc -fuse-ld=gold"])
async def test_lines_of_a_function_gc_sections_dropped_are_not_given_to_live_code(
        start_symgate: SymgateFactory, tmp_path: Path, compiler: str) -> None:
    """GNU ld resolves the addresses of a section --gc-sections dropped to 0, so the line
    sequence of an uncalled 18 KB function claims [0, 18 KB) and overlaps a PIE's .text (from
    0x1000). symbolic gave `main` and `used` the dropped function's lines (`used` at line 236
    of 906 of unused_big's body) where llvm-symbolizer and eu-addr2line give their own
    (binutils' addr2line names the dropped function: wrong too). With -gz the line table is
    zlib-compressed: read inflated. `| zlib-gnu`: compressed after the link by `objcopy
    --compress-debug-sections=zlib-gnu` (older Debian and Ubuntu debug packages), as
    .zdebug_line, which was not read at all: `main` had line 201 of unused_big's body.
    `| zstd`: zstd-compressed (SHF_COMPRESSED), which symbolic reads and symgate did not fix
    up: line 201 again. llvm-symbolizer 14 reads no zstd, so the expected frames are its on
    the program before it was compressed; start lines included, which libdw 0.188 (reading
    no zstd either) left out until symgate gave it the sections inflated.
    GNU ld's -z noseparate-code (its default but on x86) and gold put the ELF header and the
    code in one segment from address 0, which was taken for code at 0, where a sequence may
    be real: nothing was moved, and `main` had a line of unused_big's again."""
    compiler, _, compress = (part.strip() for part in compiler.partition("|"))
    compiler, *flags = compiler.split()
    if shutil.which(compiler) is None:
        pytest.skip(f"needs {compiler}")
    build = tmp_path / "build"
    build.mkdir()
    (build / "gc.c").write_text(_gc_source())
    exe = build / "prog"
    subprocess.run([compiler, "-O2", "-g", *flags, "-ffunction-sections", "-Wl,--gc-sections",
                    "gc.c", "-o", "prog"], cwd=build, check=True, capture_output=True)
    assert not [s for s in function_symbols(exe) if s.name == "unused_big"]
    plain = build / "prog.plain"
    shutil.copy(exe, plain)
    if compress == "zstd":
        compress_debug_sections_zstd(exe)
    elif compress:
        subprocess.run(["objcopy", f"--compress-debug-sections={compress}", exe], check=True)
        sections = subprocess.run(["readelf", "-SW", exe], check=True, capture_output=True,
                                  text=True).stdout
        assert ".zdebug_line" in sections
    tree, elf = _served_alone(exe, tmp_path)
    vaddrs = code_addresses(elf)
    # llvm-symbolizer names padding after _start by the dropped function's DWARF, and gives
    # crt code (no DWARF, line 0) its start line (clang's build): neither is counted.
    expected = {v: [replace(x, start_line=0) if not x.line else x for x in f]
                for v, f in llvm_symbolize(plain, vaddrs).items()
                if f[-1].function != "unused_big"}
    live = {v for v, f in expected.items() if f[-1].function in ("main", "used")}
    assert len(live) > 10
    placed = place(elf, 0x55D0C0DE0000)
    sent = make_profile([(placed, vaddrs)]).SerializeToString()
    answers, _headers = await _offline_and_served(start_symgate, tree, sent)
    _assert_frames(answers, placed, expected)


def _gc_source_freestanding() -> str:
    """_gc_source without libc, for a 32-bit build where no 32-bit libc is installed."""
    body = "\n".join(f"    acc = acc * {i + 3} + v[{i % 16}] * (acc >> {i % 13});"
                     for i in range(900))
    return (f"__attribute__((noinline)) long unused_big(long *v) {{\n    long acc = 1;\n{body}\n"
            "    return acc;\n}\n"
            "__attribute__((noinline)) long used(long *v) { return v[0] * 3 + v[1]; }\n"
            "volatile long sink;\n"
            "void _start(void) {\n    long v[16] = {7};\n    sink = used(v);\n    for (;;) ;\n}\n")


@pytest.mark.parametrize("flags", ["", "-gdwarf-4", "-gz"])
async def test_lines_of_code_gc_sections_dropped_are_moved_in_a_32_bit_program_too(
        start_symgate: SymgateFactory, tmp_path: Path, flags: str) -> None:
    """The dropped function's line sequence was moved away only where addresses are 8 bytes:
    in an ELF32 PIE (i686, armhf) `used` and `_start` had lines 206-209 of unused_big's body,
    where llvm-symbolizer says 905 and 907-910."""
    build = tmp_path / "build"
    build.mkdir()
    (build / "gc.c").write_text(_gc_source_freestanding())
    exe = build / "prog"
    made = subprocess.run(["gcc", "-m32", "-O2", "-g", *flags.split(), "-ffreestanding",
                           "-nostdlib", "-fPIE", "-pie", "-ffunction-sections",
                           "-Wl,--gc-sections", "gc.c", "-o", "prog"],
                          cwd=build, capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"gcc -m32 cannot link here: {made.stderr[-200:]}")
    assert not [s for s in function_symbols(exe) if s.name == "unused_big"]
    tree, elf = _served_alone(exe, tmp_path)
    vaddrs = code_addresses(elf)
    expected = {v: f for v, f in llvm_symbolize(exe, vaddrs).items()
                if f[-1].function in ("used", "_start")}
    assert len(expected) > 10
    placed = place(elf, 0x56555000)
    sent = make_profile([(placed, vaddrs)]).SerializeToString()
    answers, _headers = await _offline_and_served(start_symgate, tree, sent)
    _assert_frames(answers, placed, expected)


MINI_C = r"""
static __attribute__((noinline)) int hidden_a(int x) {
    for (int i = 0; i < x; i++) x ^= i * 7;
    return x;
}
static __attribute__((noinline)) int hidden_b(int x) {
    for (int i = 0; i < x; i++) x += i * 3;
    return x * 5;
}
int exported_one(int x) { return hidden_a(x) + 1; }
int exported_two(int x) { return hidden_b(x) + 2; }
"""


def _names(args: list[str]) -> set[str]:
    out = subprocess.run(["nm", "--format=posix", "--defined-only", *args], check=True,
                         capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()[1:2] in (["T"], ["t"])}


def _fedora_stripped(build: Path) -> tuple[Path, Path]:
    """A shared library stripped to .dynsym with MiniDebugInfo, as Fedora's find-debuginfo
    makes it (`.gnu_debugdata`: the xz-compressed debug file reduced to the .symtab entries
    of the functions .dynsym lacks), and the library before it was stripped."""
    (build / "lib.c").write_text(MINI_C)
    full, debug, mini = build / "libmini.so.full", build / "libmini.so.debug", build / "mini"
    subprocess.run(["gcc", "-O2", "-g", "-fPIC", "-shared", "-o", str(full), "lib.c"],
                   cwd=build, check=True)
    subprocess.run(["objcopy", "--only-keep-debug", str(full), str(debug)], check=True)
    keep = build / "keep"
    keep.write_text("\n".join(sorted(_names([str(debug)]) - _names(["-D", str(full)]))) + "\n")
    subprocess.run(["objcopy", "-S", "--remove-section", ".gdb_index", "--remove-section",
                    ".comment", f"--keep-symbols={keep}", str(debug), str(mini)], check=True)
    packed = build / "mini.xz"
    packed.write_bytes(lzma.compress(mini.read_bytes()))
    exe = build / "libmini.so"
    subprocess.run(["objcopy", "--strip-all", f"--add-section=.gnu_debugdata={packed}",
                    str(full), str(exe)], check=True)
    return exe, full


async def test_a_fedora_program_without_its_debug_file_is_named_by_its_minidebuginfo(
        start_symgate: SymgateFactory, tmp_path: Path) -> None:
    """Where no debug file can be had, a program stripped to .dynsym was named by .dynsym
    alone: its static functions stayed bare addresses, though Fedora ships each program with
    their names in .gnu_debugdata (MiniDebugInfo), by which eu-addr2line, eu-stack, perf and
    gdb name them."""
    build = tmp_path / "build"
    build.mkdir()
    exe, full = _fedora_stripped(build)
    build_id = build_id_of_file(exe)
    assert build_id
    tree = tmp_path / "debug"
    at = tree / ".build-id" / build_id[:2]
    at.mkdir(parents=True)
    shutil.copy(exe, at / build_id[2:])  # the program alone: no debug file anywhere
    elf = Elf("libmini.so", build_id, exe, exe, ())
    vaddrs = code_addresses(Elf("libmini.so", build_id, full, full, ()))
    out = subprocess.run(["eu-addr2line", "-f", "-e", str(exe), *map(hex, vaddrs)],
                         check=True, capture_output=True, text=True).stdout.splitlines()[0::2]
    by_elfutils = {v: name for v, name in zip(vaddrs, out, strict=True) if name != "??"}
    assert {"hidden_a", "hidden_b", "exported_one"} <= set(by_elfutils.values())
    placed = place(elf, 0x7F3A12340000)
    sent = make_profile([(placed, vaddrs)]).SerializeToString()
    answers, _headers = await _offline_and_served(start_symgate, tree, sent)
    for mode, answer in answers:
        by_address = {loc.address: loc for loc in answer.location}
        ours = {v: frames_of(answer, by_address[placed.runtime(v)]) for v in vaddrs}
        wrong = {hex(v): (name, ours[v]) for v, name in by_elfutils.items()
                 if [f.function for f in ours[v]] != [name]}
        assert not wrong, (mode, wrong)
        # No name where elfutils has none either (the padding between functions).
        assert not [v for v in vaddrs if v not in by_elfutils and ours[v]], mode


def _served_alone(exe: Path, tmp_path: Path) -> tuple[Path, Elf]:
    """A debug tree holding `exe` alone (its own debug file), and `exe` as an Elf."""
    build_id = build_id_of_file(exe)
    assert build_id
    tree = tmp_path / "debug"
    at = tree / ".build-id" / build_id[:2]
    at.mkdir(parents=True)
    shutil.copy(exe, at / build_id[2:])
    return tree, Elf("prog", build_id, exe, exe, ())


# A C++ program whose LTO DWARF 4 symbolic read wrongly (kept as it is: the wrong reading
# depends on how the units' file tables come out, which a reformatted copy did not reproduce).
LTO_CPP = Path(__file__).parent / "sources" / "lto_dwarf4.cpp"


@pytest.mark.parametrize("dwarf", ["dwarf-4", "dwarf-4 -gz", "dwarf-5"])
def test_gcc_link_time_optimized_programs_are_named_as_llvm_names_them(
        tmp_path: Path, dwarf: str) -> None:
    """symbolic reads GCC's LTO DWARF 4 wrongly: half the code of this program came out in
    other functions and other files (main's entry as `__new_allocator<long>::allocate` in
    new_allocator.h, where llvm-symbolizer and eu-addr2line say main in main.cpp).
    Such a file is read by libdw; DWARF 5's, which symbolic reads right, as before."""
    shutil.copyfile(LTO_CPP, tmp_path / "main.cpp")
    exe = tmp_path / "lto"
    subprocess.run(["g++", "-O2", "-g", *f"-g{dwarf}".split(), "-flto", "-Wl,--build-id", "-o",
                    str(exe), "main.cpp"], cwd=tmp_path, check=True)
    debug = tmp_path / "lto.debug"
    subprocess.run(["objcopy", "--only-keep-debug", str(exe), str(debug)], check=True)
    build_id = build_id_of_file(exe)
    assert build_id
    elf = Elf("lto", build_id, exe, debug, ())
    lines, got = table_frames(debug, elf, tmp_path / "tables")
    assert lines
    wanted = llvm_symbolize(debug, code_addresses(elf))
    differ = {}
    for v, want in wanted.items():
        if any("crtstuff" in w.file for w in want):
            continue  # llvm-symbolizer names crt code's file, with no line; symgate neither
        ours = [(re.sub(r"[CD]\dE", "E", f.system_name.split(".")[0]), f.file, f.line)
                for f in got[v]]
        theirs = [(re.sub(r"[CD]\dE", "E", w.system_name.split(".")[0]), w.file, w.line)
                  for w in want]
        # The last row of a .cold part running into the next one's first bytes: no line
        # (as symbolic gives it), where llvm-symbolizer carries the row over.
        if ours != theirs and not (len(ours) == 1 and not ours[0][2]):
            differ[hex(v)] = (ours, theirs)
    assert len(wanted) > 1000
    assert differ == {}


# Two files, each with a static `helper` of its own, declared at another line: clang inlines
# both, and declares each in its unit's file 0.
HELPER_A_C = r"""
static int helper(int x) { int s = 0; for (int i = 0; i < x; i++) s += i * x ^ (s >> 2); return s; }
int in_a(int n) { return helper(n) + 1; }
"""
HELPER_B_C = r"""
#include <stdio.h>
int in_a(int n);


static int helper(int x) { int s = 1; for (int i = 0; i < x * 3; i++) s ^= i + s * 7; return s; }
int main(int argc, char **argv) { printf("%d\n", helper(argc) + in_a(argc)); return 0; }
"""


@pytest.mark.skipif(shutil.which("clang") is None, reason="needs clang")
async def test_clang_dwarf5_static_functions_of_one_name_have_their_start_lines(
        start_symgate: SymgateFactory, tmp_path: Path) -> None:
    """A name declared at several lines (`helper`, static in two files) gets its start line
    by the file of its frame. clang's DWARF 5 declares every function of a unit's own source
    file as file 0, which libdw's dwarf_decl_file (0.188) takes for none: the two helpers were
    declared nowhere, and their frames had start line 0 where llvm-symbolizer says 2 and 6."""
    build = tmp_path / "build"
    build.mkdir()
    (build / "a.c").write_text(HELPER_A_C)
    (build / "b.c").write_text(HELPER_B_C)
    exe = build / "prog"
    subprocess.run(["clang", "-O2", "-g", "-gdwarf-5", "-Wl,--build-id", "a.c", "b.c", "-o",
                    "prog"], cwd=build, check=True, capture_output=True)
    tree, elf = _served_alone(exe, tmp_path)
    vaddrs = code_addresses(elf)
    expected = llvm_symbolize(exe, vaddrs)
    helpers = {f.start_line for frames in expected.values() for f in frames
               if f.function == "helper"}
    assert helpers == {2, 6}, helpers  # both inlined, each known to llvm-symbolizer
    placed = place(elf, 0x55D0C0DE0000)
    sent = make_profile([(placed, vaddrs)]).SerializeToString()
    answers, _headers = await _offline_and_served(start_symgate, tree, sent)
    _assert_frames(answers, placed, expected)


GO_ASM_MAIN = """package main

import (
	"fmt"
	"sort"
)

//go:noinline
func work(n int) int { return n*n + 1 }

func main() {
	v := []int{5, 3, 1}
	sort.Ints(v)
	fmt.Println(v, work(7))
}
"""


@pytest.fixture(scope="module")
def go_program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GO_ASM_MAIN built once for this module's tests (a cold `go build` takes seconds)."""
    if shutil.which("go") is None:
        pytest.skip("needs Debian's golang-go")
    # A GNU build ID, as `-B gobuildid` (Go 1.20 on) derives from the Go one.
    exe, _env = go_build(tmp_path_factory.mktemp("go"), GO_ASM_MAIN, "example.com/goasm",
                         ldflags="-B 0x" + "5ca1ab1e" * 5)
    return exe


async def test_go_assembly_functions_are_named_by_their_dwarf_name(
        start_symgate: SymgateFactory, tmp_path: Path, go_program: Path) -> None:
    """Go names an assembly function `runtime.goexit` in DWARF, in its tracebacks and in its
    own profiles; its linker's symbol is `runtime.goexit.abi0`. The rule for a name a shared
    library hides and exports under another (`__getcwd` as `getcwd`) took the symbol for the
    exported name: all of the Go runtime's assembly was named `*.abi0`, its DWARF name left
    as the system name."""
    exe = go_program
    tree, elf = _served_alone(exe, tmp_path)
    abi0 = [(s.value, s.value + s.size) for s in function_symbols(exe)
            if s.name.endswith(".abi0") and s.size]
    vaddrs = sorted({*code_addresses(elf)[::20], *(start for start, _end in abi0)})
    expected = llvm_symbolize(exe, vaddrs, functions="short")  # by DWARF alone
    in_asm = [v for v in expected if any(a <= v < b for a, b in abi0)]
    assert len(in_asm) > 100 and not any(f.function.endswith(".abi0")
                                         for v in in_asm for f in expected[v])
    placed = place(elf, 0)
    sent = make_profile([(placed, vaddrs)]).SerializeToString()
    answers, _headers = await _offline_and_served(start_symgate, tree, sent)
    for mode, out in answers:
        by_address = {loc.address: loc for loc in out.location}
        wrong = {}
        for v, want in expected.items():
            got = frames_of(out, by_address[placed.runtime(v)])
            # Paths as symbolic cleans them (`<autogenerated>`, `./<autogenerated>` to llvm).
            if [(f.function, posixpath.normpath(f.file), f.line) for f in got] \
                    != [(w.function, posixpath.normpath(w.file), w.line) for w in want]:
                wrong[hex(v)] = (got, want)
        assert not wrong, (mode, len(wrong), list(wrong.items())[:3])
