"""Debug files an upstream (or a tenant's upload) crafted against the build of their symbol
table, their build-ID note intact: each profile that names one gets that mapping's precise
outcome, the build is not made again for every profile, and the server's workers, and the
other profiles, go on."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from proxy.symbols import isolated_build
from proxy.web.state import STATE
from symbolize.chains import FunctionIds
from symbolize.elf_headers import read_headers
from symbolize.symtab import MalformedObject, build_symbol_table
from tests.elfs import Elf, ElfSet, build_id_tree, replace_section_compressed, zlib_of_zeros
from tests.harness import Debuginfod, SymgateFactory
from tests.profiles import code_addresses, make_profile, place
from tests.rewriting import open_table
from tests.symbolize_helpers import BASES, post, symbolize_config

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


@pytest.fixture(autouse=True)
def _builder_ended() -> Iterator[None]:
    """The builder child isolated_build forks in this process (a worker's, in a server)
    ended after each test: left, it held the test process's copy of the forkserver's
    liveness pipe, and the forkserver could not stop at the suite's end."""
    yield
    if isolated_build._child is not None:
        isolated_build._child.end()
        isolated_build._child = None


def _profile(elfs: ElfSet, name: str) -> bytes:
    elf = elfs.named(name)
    placed = place(elf, BASES.get(name, 0x55D0C0E00000))
    return make_profile([(placed, code_addresses(elf)[:5])]).SerializeToString()


async def test_a_build_that_runs_out_of_memory_is_malformed_and_kills_no_worker(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    """A debug file whose .debug_str inflates to 768 MiB (from under a MiB): symbolic
    allocates it whole. Past the memory a build may take, the build crashed its worker, which
    broke the pool under every profile in work (503s), was never remembered, and was made
    again, and crashed again, at the next profile that named it."""
    bomb = tmp_path / "prog.debug"
    shutil.copyfile(elfs.prog.debug, bomb)
    replace_section_compressed(bomb, ".debug_str", zlib_of_zeros(768 << 20), 768 << 20)
    tree = build_id_tree(tmp_path / "debug", elfs.prog.build_id, bomb, elfs.prog.executable)
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(
        debug_dirs=(tree,), build_memory_bytes=512 << 20))
    pool = sg.runner.app[STATE].symbols.workers.pool
    await pool.start()
    workers = pool.pids()
    for _ in range(2):
        status, headers, body = await post(sg, _profile(elfs, "prog"))
        assert status == 200, body
        assert headers["X-Symgate-Mappings-Unsymbolized"] == "malformed=1", headers
    assert await sg.metric("symgate_symtab_builds_total", result="malformed") == 1
    status, headers, _ = await post(sg, _profile(elfs, "other"))
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    assert pool.pids() == workers


async def test_a_memory_bound_below_what_a_builder_maps_blames_no_file(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    """symbolize.build_memory_bytes = "100MiB", say, is less than a build process maps before
    it builds anything: every build failed its first allocation, each file was remembered as
    malformed for a day (past the operator's fix of the setting), and each profile answered
    200 with its mappings bare. Now the profile is refused (503) with what to change."""
    tree = build_id_tree(tmp_path / "debug", elfs.prog.build_id, elfs.prog.debug,
                         elfs.prog.executable)
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(
        debug_dirs=(tree,), build_memory_bytes=16 << 20))
    for _ in range(2):
        status, _, body = await post(sg, _profile(elfs, "prog"))
        assert status == 503, body
        assert b"symbolize.build_memory_bytes (16777216 bytes) is less than" in body, body
    assert await sg.metric("symgate_symtab_builds_total", result="malformed") == 0


@pytest.mark.skipif(shutil.which("prlimit") is None or (
    os.geteuid() == 0 and shutil.which("setpriv") is None), reason="needs prlimit (and setpriv)")
def test_a_memory_bound_past_the_servers_hard_limit_builds_within_it(
    elfs: ElfSet, tmp_path: Path
) -> None:
    """build_memory_bytes above the hard RLIMIT_AS the server was started under (systemd's
    LimitAS=): the builder's setrlimit raised, it ended before it took any build, and every
    profile that needed one was refused for good ("its build process would not start; try
    again", 503). (Root may raise a hard limit: it is made to lose that right.)"""
    out = tmp_path / "tables" / f"{elfs.prog.build_id}.symc"
    script = ("import sys; from pathlib import Path; from proxy.symbols import isolated_build; "
              f"isolated_build.build(0, 16 << 30, Path({str(elfs.prog.debug)!r}), "
              f"Path({str(out)!r}), {elfs.prog.build_id!r}); print('built')")
    unprivileged = ["setpriv", "--bounding-set=-sys_resource"] if os.geteuid() == 0 else []
    done = subprocess.run([*unprivileged, "prlimit", f"--as={8 << 30}", sys.executable, "-c",
                           script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout == "built\n", done.stderr
    assert out.exists()


def test_a_build_past_its_time_is_killed_malformed_and_leaves_nothing(
    elfs: ElfSet, tmp_path: Path
) -> None:
    """A build that did not end (a loop over a crafted file's DWARF) held its worker for good:
    now its child is killed at build_timeout_s, and what it half wrote is removed. The build
    here inflates 768 MiB, some seconds, against a timeout of a twentieth of one."""
    bomb = tmp_path / "prog.debug"
    shutil.copyfile(elfs.prog.debug, bomb)
    replace_section_compressed(bomb, ".debug_str", zlib_of_zeros(768 << 20), 768 << 20)
    out = tmp_path / "tables" / f"{elfs.prog.build_id}.symc"
    with pytest.raises(MalformedObject, match=r"longer than 0\.05 s"):
        isolated_build.build(0.05, 0, bomb, out, elfs.prog.build_id, elfs.prog.executable)
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_one_builder_serves_build_after_build_and_one_that_ended_is_made_again(
    elfs: ElfSet, tmp_path: Path
) -> None:
    """A fork per build cost 5-6 ms of copied pages each (0.2 s more for a cold profile of 30
    small programs): a worker keeps its builder child for the builds that follow. One killed
    for its time, or from outside between two builds (the OOM killer), is made again for
    the next build, which it must not fail."""
    tables = tmp_path / "tables"

    def good(name: str) -> None:
        elf = elfs.named(name)
        isolated_build.build(30.0, 0, elf.debug, tables / f"{elf.build_id}.symc",
                             elf.build_id, elf.executable)

    good("prog")
    builder = isolated_build._child
    assert builder is not None
    good("other")
    assert isolated_build._child is builder  # the same child: no fork for this build
    os.kill(builder.pid, signal.SIGKILL)  # between two builds
    good("prog")
    assert isolated_build._child is not None and isolated_build._child.pid != builder.pid
    bomb = tmp_path / "prog.debug"
    shutil.copyfile(elfs.prog.debug, bomb)
    replace_section_compressed(bomb, ".debug_str", zlib_of_zeros(768 << 20), 768 << 20)
    with pytest.raises(MalformedObject, match="longer than"):
        isolated_build.build(0.05, 0, bomb, tables / "bomb.symc", elfs.prog.build_id,
                             elfs.prog.executable)
    good("other")  # in a child made again


def _executable_alone(root: Path, elf: Elf, executable: Path) -> Path:
    """A debug tree at `root` with `executable` as the program of `elf`, and no debug file."""
    at = root / ".build-id" / elf.build_id[:2]
    at.mkdir(parents=True)
    shutil.copyfile(executable, at / elf.build_id[2:])
    return root


@pytest.mark.parametrize(("stream", "claimed"), [
    (b"\x01\x00", None),  # not even a compression header: symbolic reads no name at all
    (b"not zlib at all", 4096),  # pyelftools' zlib.error escaped the build
], ids=["cut-header", "not-zlib"])
async def test_a_program_whose_symbol_names_cannot_be_read_is_answered(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
    stream: bytes, claimed: int | None
) -> None:
    """A program whose .strtab is compressed in a way nothing can inflate: once the mapping's
    outcome was `internal` at every profile (the build never remembered), or a table without
    a single range whose lookup raised IndexError in the worker: a 500."""
    exe = tmp_path / "prog"
    shutil.copyfile(elfs.prog.executable, exe)
    replace_section_compressed(exe, ".strtab", stream, claimed)
    tree = _executable_alone(tmp_path / "debug", elfs.prog, exe)
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tree,)))
    for _ in range(2):
        status, headers, body = await post(sg, _profile(elfs, "prog"))
        assert status == 200, body
        assert "internal" not in headers["X-Symgate-Mappings-Unsymbolized"], headers
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 1


def test_a_cold_symbol_that_runs_past_the_address_space_is_left_out(
    elfs: ElfSet, tmp_path: Path
) -> None:
    """A `.cold` function symbol whose size carries its end past 2^64 (a .symtab size that
    reads garbage as symbols, in libc's debug file): its range went into the table's record,
    and every process that opened the table failed on it (OverflowError, a 500 for each
    profile that named it)."""
    debug = tmp_path / "libfx.so.debug"
    shutil.copyfile(elfs.aliased.debug, debug)
    with debug.open("r+b") as f:
        headers = read_headers(f.fileno())
        assert headers is not None
        symtab = headers.section(".symtab")
        assert symtab is not None
        names = headers.data(headers.sections[symtab.link])
        table = headers.data(symtab)
        assert names is not None and table is not None
        for at in range(0, len(table), 24):
            name, _info, _other, _shndx, value, _size = struct.unpack_from("<IBBHQQ", table, at)
            if names[name:names.index(b"\0", name)] == b"checked.cold":
                os.pwrite(f.fileno(), struct.pack("<Q", (1 << 64) - value // 2),
                          symtab.offset + at + 16)
                break
        else:
            raise AssertionError("no checked.cold symbol")
    out = tmp_path / "t.symc"
    built = build_symbol_table(debug, out, elfs.aliased.build_id, elfs.aliased.executable)
    assert all(end < 1 << 64 for _start, end in built.cold_ranges)
    table_ = open_table(out, built, FunctionIds())
    table_.chains(np.array([start for start, _end in built.code_ranges], dtype=np.uint64))
    # As a table built before was recorded, with that range: it opens all the same.
    recorded = replace(built, cold_ranges=((built.code_ranges[0][0], 1 << 64),))
    open_table(out, recorded, FunctionIds()).chains(
        np.array([start for start, _end in built.code_ranges], dtype=np.uint64))


def test_a_code_segment_that_runs_past_the_address_space_is_cut_at_its_end(
    elfs: ElfSet, tmp_path: Path
) -> None:
    """A debug file whose code segment's p_memsz carries it past 2^64: its range, recorded
    with the table, was no uint64, and every lookup in the table failed (OverflowError out of
    the rewrite job, at each profile that named the build ID)."""
    debug = tmp_path / "prog.debug"
    shutil.copyfile(elfs.prog.debug, debug)
    data = bytearray(debug.read_bytes())
    phoff, = struct.unpack_from("<Q", data, 0x20)
    count, = struct.unpack_from("<H", data, 0x38)
    for at in range(phoff, phoff + count * 56, 56):
        kind, flags = struct.unpack_from("<II", data, at)
        if kind == 1 and flags & 1:  # PT_LOAD, PF_X
            struct.pack_into("<Q", data, at + 40, (1 << 64) - 100)  # p_memsz
    debug.write_bytes(data)
    out = tmp_path / "t.symc"
    built = build_symbol_table(debug, out, elfs.prog.build_id, elfs.prog.executable)
    assert all(end < 1 << 64 for _start, end in built.code_ranges)
    addresses = np.array([start + 8 for start, _end in built.code_ranges], dtype=np.uint64)
    open_table(out, built, FunctionIds()).chains(addresses)
    # As a table built before was recorded, with that range: it opens all the same.
    recorded = replace(built, code_ranges=((built.code_ranges[0][0], 1 << 65),))
    open_table(out, recorded, FunctionIds()).chains(addresses)
