"""A local directory of debug files as a source: both layouts, re-indexing, ordering."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import aiohttp
import pytest

from proxy.config import UpstreamConfig
from tests.elfs import ElfSet, build_id_tree
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, SymgateFactory, eventually
from tests.processes import debuginfod_find


def make_tree(root: Path, elfs: ElfSet) -> Path:
    """prog in the .build-id layout; other, and an unstripped binary, as plain files."""
    build_id_tree(root, elfs.prog.build_id, elfs.prog.debug, elfs.prog.executable)
    plain = root / "opt" / "app"
    plain.mkdir(parents=True)
    shutil.copy(elfs.other.executable, plain / "other")
    shutil.copy(elfs.other.debug, plain / "other.debug")
    (plain / "README").write_text("not an ELF file")
    src = root.parent / "unstripped.c"
    src.write_text("int main(void) { return 42; }\n")
    subprocess.run(["gcc", "-g", "-O1", "-Wl,--build-id", "-o", str(plain / "unstripped"),
                    str(src)], check=True)
    return root


def build_id(path: Path) -> str:
    from symbolize.elf import build_id_of_file

    found = build_id_of_file(path)
    assert found
    return found


async def test_both_layouts_are_served_like_an_upstream(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    tree = make_tree(tmp_path / "debug", elfs)
    sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0)])
    for elf in (elfs.prog, elfs.other):
        for kind, expected in (("debuginfo", elf.debug), ("executable", elf.executable)):
            got = await asyncio.to_thread(debuginfod_find, sg.url, tmp_path / f"c-{elf.name}",
                                          kind, elf.build_id)
            assert got.returncode == 0, got.stderr
            assert Path(got.stdout.strip()).read_bytes() == expected.read_bytes()
    unstripped = tree / "opt" / "app" / "unstripped"
    for kind in ("debuginfo", "executable"):  # an unstripped binary is its own debug file
        status, _, body = await sg.get(f"/buildid/{build_id(unstripped)}/{kind}")
        assert status == 200 and body == unstripped.read_bytes()
    section = f"/buildid/{elfs.prog.build_id}/section/.debug_line"
    async with aiohttp.ClientSession() as s, s.get(debuginfod.url + section) as r:
        expected_section = await r.read()
    status, _, body = await sg.get(section)
    assert status == 200 and body == expected_section  # the same bytes elfutils extracts
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/source{elfs.prog.sources[1]}"))[0] == 404


async def test_misses_are_not_remembered_and_new_files_are_found(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    tree = make_tree(tmp_path / "debug", elfs)
    sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0.2)])
    path = f"/buildid/{elfs.nopie.build_id}/debuginfo"
    for _ in range(2):
        assert (await sg.get(path))[0] == 404
    # Looked up each time (a dict lookup), never answered as a remembered miss.
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="not_found") == 2
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="negative_hit") == 0
    shutil.copy(elfs.nopie.debug, tree / "opt" / "app" / "nopie.debug")

    async def served() -> bool:
        return (await sg.get(path))[0] == 200

    await eventually(served, timeout=10)  # picked up by the next walk, no restart


async def test_a_local_directory_before_a_remote_upstream(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    tree = make_tree(tmp_path / "debug", elfs)
    sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0), faults.url_for("ok")])
    status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and faults.count("ok") == 0  # the local copy came first
    status, _, body = await sg.get(f"/buildid/{elfs.big.build_id}/executable")
    assert status == 200 and body == elfs.big.executable.read_bytes()
    assert faults.count("ok") == 1  # not local: the next upstream was asked
    # A remembered remote miss does not hide a file that the local directory has.
    assert (await sg.get("/buildid/abcdef01/debuginfo"))[0] == 404
    assert (await sg.get("/buildid/abcdef01/debuginfo"))[0] == 404
    assert faults.count("ok") == 2  # the second miss was remembered for the remote upstream


async def test_a_debug_file_compressed_as_zdebug_sections_is_served_as_debuginfo(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """A plain file's debug sections compressed the GNU way (`objcopy
    --compress-debug-sections=zlib-gnu`, older Debian and Ubuntu debug packages) are named
    .zdebug_*: symgate took such a file for neither a debug file nor a program (a 404, and
    `symgate upload` skipped it), where elfutils' debuginfod serves it as the debuginfo."""
    plain = tmp_path / "debug" / "opt"
    plain.mkdir(parents=True)
    debug = plain / "prog.debug"
    subprocess.run(["objcopy", "--compress-debug-sections=zlib-gnu", str(elfs.prog.debug),
                    str(debug)], check=True)
    sections = subprocess.run(["readelf", "-SW", str(debug)], check=True, capture_output=True,
                              text=True).stdout
    assert ".zdebug_info" in sections and " .debug_info" not in sections
    sg = await start_symgate([UpstreamConfig(path=tmp_path / "debug", rescan_s=0)])
    status, headers, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert (status, headers["X-DEBUGINFOD-FILE"]) == (200, "prog.debug")
    assert body == debug.read_bytes()


async def test_a_directory_that_cannot_be_read_is_said_once_not_served_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`path = "/srv/debug"` with a typo, a relative path read from another working
    directory, a mount not there yet: the source served nothing, each walk found nothing,
    and no line anywhere said why every file was a 404."""
    import logging

    from prometheus_client import CollectorRegistry

    from proxy.metrics import ProxyMetrics
    from proxy.sources.localdir import LocalDirectory

    root = tmp_path / "debug"
    local = LocalDirectory(root, 0, ProxyMetrics(CollectorRegistry()))
    with caplog.at_level(logging.INFO, logger="proxy.sources.localdir"):
        await local.rescan()
        await local.rescan()
        said = [r for r in caplog.records if str(root) in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING, caplog.text
        assert "cannot be read" in said[0].getMessage()
        root.mkdir()  # mounted at last: said too, once
        await local.rescan()
        await local.rescan()
        said = [r for r in caplog.records if str(root) in r.getMessage()]
        assert len(said) == 2 and "can be read again" in said[1].getMessage(), caplog.text
        root.rmdir()
        root.write_bytes(b"a file, not a directory")
        await local.rescan()
        said = [r for r in caplog.records if str(root) in r.getMessage()]
        assert len(said) == 3 and "not a directory" in said[2].getMessage(), caplog.text


async def test_a_debug_dir_that_is_not_there_is_said_at_start(
    start_symgate: SymgateFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """symbolize.debug_dirs with a typo (or relative, read from another working directory):
    nothing was ever found in it, and nothing said so."""
    import logging

    from tests.symbolize_helpers import symbolize_config

    there, missing = tmp_path / "debug", tmp_path / "debgu"
    there.mkdir()
    with caplog.at_level(logging.WARNING):
        await start_symgate([], symbolize=symbolize_config(debug_dirs=(there, missing)))
    said = [r.getMessage() for r in caplog.records if "debug_dirs" in r.getMessage()]
    assert len(said) == 1 and str(missing) in said[0] and str(there) not in said[0], said
