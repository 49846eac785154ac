"""Profiles and tables a hostile or unlucky world hands /symbolize: a mapping with a table and
nothing sampled in it, and a table file damaged on disk. Each is answered 200 with the mapping
reported, never a 500 or a 503, and the workers stay up."""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from proxy.web.state import STATE
from symbolize.dwarf import LIBDW, opened, units
from symbolize.elf import layout_of_file
from symbolize.pprof.profile_pb2 import Profile
from symbolize.symtab import MalformedObject, build_symbol_table
from tests.elfs import Elf, ElfSet, replace_section_compressed, zlib_of_zeros
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, Symgate, SymgateFactory
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, parse, post, symbolize_config

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


async def test_a_mapping_with_a_table_and_no_location_comes_back_unchanged(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """Once an UnboundLocalError: a 500 "internal error", and the offline CLI's traceback."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    placed = place(elfs.prog, BASES["prog"])
    nothing_sampled = make_profile([(placed, code_addresses(elfs.prog)[:5])])
    del nothing_sampled.location[:]
    del nothing_sampled.sample[:]
    status, headers, body = await post(sg, nothing_sampled.SerializeToString())
    assert status == 200, body
    assert body == nothing_sampled.SerializeToString()
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "no_locations=1", headers
    # Locations that name a mapping the profile lacks leave its one mapping as empty.
    elsewhere = make_profile([(placed, code_addresses(elfs.prog)[:5])])
    for loc in elsewhere.location:
        loc.mapping_id = 77
    status, headers, body = await post(sg, elsewhere.SerializeToString())
    assert status == 200 and body == elsewhere.SerializeToString(), body
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "no_locations=1", headers


@pytest.mark.parametrize("many", [False, True])
async def test_a_mapping_no_location_lies_in_is_not_fetched(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, many: bool
) -> None:
    """A Go or perf profile lists every library its process had mapped, sampled or not: each
    cost a fetch and a table built for nothing, and 300 of them a 422 for too many build IDs.
    A mapping without locations is not asked for, and is reported no_locations. `many`: past
    the locations looked at one at a time."""
    sg = await start_symgate([faults.url_for("ok")], symbolize=symbolize_config())
    vaddrs = code_addresses(elfs.prog)
    vaddrs = (vaddrs * (1 + 2000 // len(vaddrs)))[:2000] if many else vaddrs[:20]
    profile = make_profile([(place(elfs.prog, BASES["prog"]), vaddrs),
                            (place(elfs.other, 0x7F0000000000), [])])
    status, headers, _ = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "no_locations=1", headers
    asked = " ".join(faults.paths)
    assert elfs.prog.build_id in asked and elfs.other.build_id not in asked


async def _symbolized_once(start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
                           ) -> tuple[Symgate, Profile, bytes, Path]:
    """A server that has symbolized a profile of elfs.prog: the server, the profile, its
    answer and the table file it built."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])])
    status, headers, first = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", headers
    bid = elfs.prog.build_id
    return sg, profile, first, sg.config.server.data_dir / "symtabs" / bid[:2] / f"{bid}.symc"


async def test_a_table_damaged_on_disk_is_malformed_once_then_built_again(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """symbolic's SymCacheError, raised in a worker, cannot be unpickled by the server: it
    broke the process pool, every profile of that table was a 503 and cost a worker. Then,
    reported `malformed`, the damaged table was believed for good, across restarts."""
    sg, profile, first, table = await _symbolized_once(start_symgate, debuginfod, elfs)
    with table.open("r+b") as f:
        f.truncate(100)
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200, body
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "malformed=1", headers
    assert body == profile.SerializeToString()
    assert (await sg.get("/healthz"))[0] == 200
    status, headers, again = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", headers
    assert again == first
    assert table.stat().st_size > 100


async def test_a_damaged_tables_late_report_does_not_condemn_the_table_built_since(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two profiles read a damaged table; the first one's report dropped it and a third
    profile built it again; then the second one's report came (its rewrite was slower), and
    found a table unreadable twice within the hour: the new, sound table was recorded
    malformed, and the mapping left bare in every profile's 200 for malformed_retry_s (a
    day). A report speaks for the table its profile was given, not for one built since."""
    sg, profile, first, table = await _symbolized_once(start_symgate, debuginfod, elfs)
    resolver = sg.runner.app[STATE].symbols
    report = resolver.unreadable
    reached, late = asyncio.Event(), asyncio.Event()

    async def first_report_late(*args: Any) -> None:
        if not reached.is_set():  # the slower profile's
            reached.set()
            await late.wait()
        await report(*args)

    monkeypatch.setattr(resolver, "unreadable", first_report_late)
    with table.open("r+b") as f:
        f.truncate(100)
    slower = asyncio.ensure_future(post(sg, profile.SerializeToString()))
    await reached.wait()
    status, headers, _ = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Mappings-Unsymbolized"] == "malformed=1"
    status, headers, again = await post(sg, profile.SerializeToString())
    assert status == 200 and again == first, headers  # built again
    late.set()
    status, headers, _ = await slower
    assert status == 200 and headers["X-Symgate-Mappings-Unsymbolized"] == "malformed=1"
    status, headers, again = await post(sg, profile.SerializeToString())
    assert status == 200 and again == first, headers


async def test_a_table_removed_while_the_server_runs_is_built_again(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """The open table was believed: every later profile had the mapping `malformed` until a
    restart, which found the file missing and built it again."""
    sg, profile, first, table = await _symbolized_once(start_symgate, debuginfod, elfs)
    table.unlink()
    status, headers, again = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", headers
    assert again == first
    assert table.exists()


async def test_an_inline_chain_hundreds_of_frames_deep_is_given_whole(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    """Once past 255 frames a chain was taken for a table whose links loop: the whole mapping
    came back `malformed`, its shallow addresses too. llvm-symbolizer gives all 301 frames."""
    depth = 300
    lines = ["volatile int sink;",
             "static inline __attribute__((always_inline)) void f0(int x) { sink += x * 3; }"]
    lines += [f"static inline __attribute__((always_inline)) void f{i}(int x) "
              f"{{ f{i - 1}(x + {i}); sink ^= x; }}" for i in range(1, depth)]
    lines += [f"int __attribute__((noinline)) deep(int x) {{ f{depth - 1}(x); return sink; }}",
              "int __attribute__((noinline)) shallow(int x) "
              "{ for (int i = 0; i < x; i++) sink += i * i; return sink; }",
              "int main(int c, char **v) { return deep(c) + shallow(c); }"]
    src, exe = tmp_path / "deep.c", tmp_path / "deep"
    src.write_text("\n".join(lines) + "\n")
    subprocess.run(["gcc", "-g", "-O2", "-Wl,--build-id", "-o", str(exe), str(src)], check=True)
    layout = layout_of_file(exe)
    assert layout is not None and layout.build_id
    bid = layout.build_id
    folder = tmp_path / "tree" / ".build-id" / bid[:2]
    folder.mkdir(parents=True)
    (folder / bid[2:]).symlink_to(exe)  # unstripped: its own debug file
    elf = Elf("deep", bid, exe, exe, (src,))
    symbols = {name: int(value, 16) for value, kind, name in (
        line.split() for line in subprocess.run(["nm", str(exe)], capture_output=True,
                                                text=True, check=True).stdout.splitlines()
        if len(line.split()) == 3) if kind == "T"}
    sg = await start_symgate([], symbolize=symbolize_config(debug_dirs=(tmp_path / "tree",)))
    profile = make_profile([(place(elf, BASES["prog"]), [symbols["deep"], symbols["shallow"]])])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Locations-Symbolized"] == "2", headers
    out = parse(body)
    names = {f.id: out.string_table[f.name] for f in out.function}
    chains = [[names[line.function_id] for line in loc.line] for loc in out.location]
    assert chains[0] == [f"f{i}" for i in range(depth)] + ["deep"]
    assert chains[1] == ["shallow"]


def test_a_zstd_section_claiming_a_gibibyte_is_not_given_one() -> None:
    """A compressed .debug_line's header says how big it inflates; libzstd is handed a buffer
    of that size, allocated before a byte is read: a few bytes claiming a GiB took a build
    worker's GiB."""
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))\n"
        "from symbolize import zstd\n"
        "print(zstd.inflate(b'\\x28\\xb5\\x2f\\xfd' + bytes(16), 1 << 30))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr


@pytest.mark.parametrize("claimed", [1 << 30, 1 << 48])
def test_a_zlib_section_claiming_more_than_its_stream_can_inflate_to_is_malformed(
        elfs: ElfSet, tmp_path: Path, claimed: int) -> None:
    """symbolic allocates what a compression header claims before it inflates a byte: a
    debug file whose .debug_str, 20 bytes of zlib, claimed a GiB took its build a GiB (each
    such section one more), and one claiming 2^48 bytes aborted the process that built it.
    Deflate inflates to at most some 1032 times its size: a header that claims more lies."""
    bad = tmp_path / "prog.debug"
    shutil.copyfile(elfs.prog.debug, bad)
    replace_section_compressed(bad, ".debug_str", zlib.compress(b"main\0"), claimed)
    script = (
        "import resource, sys\n"
        "from pathlib import Path\n"
        "resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))\n"
        "from symbolize.symtab import MalformedObject, build_symbol_table\n"
        "try:\n"
        f"    build_symbol_table(Path({str(bad)!r}), Path({str(tmp_path / 't.symc')!r}),\n"
        f"                       {elfs.prog.build_id!r})\n"
        "except MalformedObject as e:\n"
        "    print(e)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"claims to inflate to {claimed} bytes" in done.stdout, done.stdout


def test_a_lying_section_whose_name_is_not_utf8_is_named_in_text_sql_takes(
        elfs: ElfSet, tmp_path: Path) -> None:
    """Section names keep their bytes that are not UTF-8 as lone surrogates (so that no
    other name's text equals them): the build's failure that named such a section, stored
    with its table's row, was refused by SQL ("surrogates not allowed"), and the build was
    an internal error, made again at every profile, rather than malformed."""
    bad = tmp_path / "prog.debug"
    shutil.copyfile(elfs.prog.debug, bad)
    replace_section_compressed(bad, ".debug_str", zlib.compress(b"main\0"), 1 << 30)
    data = bad.read_bytes()
    assert data.count(b".debug_str\0") == 1
    bad.write_bytes(data.replace(b".debug_str\0", b".debug_st\xff\0"))
    with pytest.raises(MalformedObject) as failed:
        build_symbol_table(bad, tmp_path / "t.symc", elfs.prog.build_id)
    message = str(failed.value)
    assert "section .debug_st\\xff claims to inflate to" in message, message
    with sqlite3.connect(":memory:") as db:  # what symgate's SQLite row takes
        db.execute("create table t (error text)")
        db.execute("insert into t values (?)", (message,))


def test_a_debug_info_of_zeros_is_not_read_as_millions_of_units(
        elfs: ElfSet, tmp_path: Path) -> None:
    """libdw reads zeros as units of 4 bytes and version 0: a .debug_info of 128 MiB of zeros,
    128 KiB of zlib, was 32 million units to read one ctypes call at a time, minutes of a
    build worker (a dwz'd file's, read again for its supplement, longer still)."""
    bad = tmp_path / "prog.debug"
    shutil.copyfile(elfs.prog.debug, bad)
    replace_section_compressed(bad, ".debug_info", zlib_of_zeros(128 << 20), 128 << 20)
    assert LIBDW is not None
    with opened(elfs.prog.debug) as dbg:
        assert [version for _offset, version in units(LIBDW, dbg)] == [5, 5]
    with opened(bad) as dbg:
        assert list(units(LIBDW, dbg)) == []
    script = (
        "from pathlib import Path\n"
        "from symbolize.symtab import MalformedObject, build_symbol_table\n"
        "try:\n"
        f"    build_symbol_table(Path({str(bad)!r}), Path({str(tmp_path / 't.symc')!r}),\n"
        f"                       {elfs.prog.build_id!r})\n"
        "except MalformedObject as e:\n"
        "    print('malformed')\n")
    # Bounded, not timed: minutes before, a second or so now.
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=60)
    assert done.stdout.strip() == "malformed", done.stderr[-2000:]
