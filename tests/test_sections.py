"""/buildid/ID/section/NAME is cut from the debuginfo (else the executable) that symgate
fetched and verified by its build ID, never taken from an upstream's unverifiable /section
answer, and is the same bytes with the same headers as elfutils' debuginfod serves
(issue 11, item 5)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import struct
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from proxy.config import CacheConfig
from proxy.keys import ArtifactKey
from symbolize.elf import section_extent
from tests.elfs import ElfSet, set_section_extent
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, SymgateFactory, eventually, fast_upstream, free_port

# What an upstream does is the same whichever database symgate keeps: SQLite alone saves
# CI time (the PostgreSQL paths are exercised by the tests of the cache itself).
sqlite_only = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

# In the debuginfo; NOBITS there, so from the executable (.text); only in the executable
# (.gnu_debuglink); NOBITS in both (.bss); in neither.
SECTIONS = (".debug_info", ".debug_line", ".debug_str", ".symtab", ".comment",
            ".note.gnu.build-id", ".text", ".rodata", ".gnu_debuglink", ".bss", ".nonesuch")
HEADERS = ("X-DEBUGINFOD-SIZE", "X-DEBUGINFOD-FILE", "Content-Type")


async def _direct(url: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, dict(r.headers), await r.read()


async def _same_as_elfutils(sg_url: str, elfutils_url: str, build_id: str,
                            headers: tuple[str, ...] = HEADERS,
                            sections: tuple[str, ...] = SECTIONS) -> list[str]:
    """Section names whose answer differs from elfutils' (status, bytes, headers)."""
    differ = []
    async with aiohttp.ClientSession() as s:
        for name in sections:
            path = f"/buildid/{build_id}/section/{name}"
            async with s.get(elfutils_url + path) as r:
                want = (r.status, await r.read(), {h: r.headers.get(h) for h in headers})
            async with s.get(sg_url + path) as r:
                got = (r.status, await r.read(), {h: r.headers.get(h) for h in headers})
            if want[0] != got[0] or (want[0] == 200 and want != got):
                differ.append(f"{name}: elfutils {want[0]} {want[2]}, symgate {got[0]} {got[2]}")
    return differ


async def test_sections_are_cut_from_the_verified_files_as_elfutils_cuts_them(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream,
    elfs: ElfSet,
) -> None:
    # The fault upstream serves debuginfo and executables, but its /section answers are lies:
    # symgate must not ask for them at all. (It sends no Last-Modified, so the files'
    # dates are symgate's own; with the real debuginfod upstream they are compared below.)
    sg = await start_symgate([faults.url_for("ok")])
    for elf in (elfs.prog, elfs.other):
        assert await _same_as_elfutils(sg.url, debuginfod.url, elf.build_id) == []
    assert not [p for p in faults.paths if "/section/" in p]
    # Each parent was fetched once, and each section cut once: hits from then on.
    asked = faults.count("ok")
    assert await _same_as_elfutils(sg.url, debuginfod.url, elfs.prog.build_id) == []
    assert faults.count("ok") == asked == 4


@sqlite_only
async def test_a_lying_section_answer_is_never_served(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet,
    faults: FaultUpstream,
) -> None:
    # The fault upstream answers /section with the whole executable, whatever the name.
    path = f"/buildid/{elfs.prog.build_id}/section/.debug_info"
    sg = await start_symgate([faults.url_for("ok")])
    status, _, body = await sg.get(path)
    assert status == 200 and body == (await _direct(debuginfod.url + path))[2]
    # An upstream whose files are not this build ID's gives nothing to cut from.
    sg = await start_symgate([fast_upstream(faults.url_for("wrong-bytes"), retries=0)],
                             data_dir=sg.config.server.data_dir.with_name("wrong"))
    assert (await sg.get(path))[0] == 502


@sqlite_only
async def test_only_if_cached_sections_come_from_cached_files_alone(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/section/.debug_line"
    only = {"Cache-Control": "only-if-cached"}
    assert (await sg.get(path, headers=only))[0] == 504
    assert faults.count("ok") == 0
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    status, _, body = await sg.get(path, headers=only)
    assert status == 200 and body and faults.count("ok") == 1


@sqlite_only
async def test_an_only_if_cached_section_is_not_held_by_a_cut_that_fetches(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Cuts of one section were shared whatever the requests might do: one that may fetch
    and one that may not (only-if-cached, or past the hop limit) got each other's answer,
    the latter waiting on a fetch it had said not to make, the former (the other way round)
    a 504 that elfutils' client keeps for ten minutes."""
    sg = await start_symgate([faults.url_for("hold")])
    path = f"/buildid/{elfs.prog.build_id}/section/.debug_line"
    fetching = asyncio.ensure_future(sg.get(path))
    await eventually(lambda: faults.count("hold") == 1)  # its cut waits on the held fetch
    status, _, _ = await asyncio.wait_for(
        sg.get(path, headers={"Cache-Control": "only-if-cached"}), 10)
    assert status == 504 and not fetching.done()
    faults.release.set()
    status, _, body = await fetching
    assert status == 200 and body


@sqlite_only
async def test_concurrent_requests_for_a_section_cut_it_once(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.other.build_id}/section/.debug_info"
    answers = await asyncio.gather(*(sg.get(path) for _ in range(20)))
    assert {(status, body) for status, _, body in answers} == {(200, answers[0][2])}
    assert faults.count("ok") == 1  # one debuginfo fetch for all twenty


@pytest.fixture
def compressed(tmp_path: Path) -> Iterator[tuple[str, Path, str]]:
    """A program whose debug sections are zlib-compressed (SHF_COMPRESSED), and a real
    debuginfod indexing it: (build ID, executable, debuginfod URL)."""
    src = tmp_path / "z.c"
    src.write_text("int twice(int x) { return 2 * x; }\nint main(void) { return twice(1); }\n")
    out = tmp_path / "bin"
    out.mkdir()
    exe = out / "z"
    subprocess.run(["gcc", "-g", "-O1", "-gz=zlib", "-Wl,--build-id", "-o", exe, src],
                   check=True)
    notes = subprocess.run(["readelf", "-n", exe], check=True, capture_output=True, text=True)
    build_id = notes.stdout.split("Build ID: ")[1].split()[0]
    with _debuginfod_of(tmp_path, out, build_id) as url:
        yield build_id, exe, url


@contextlib.contextmanager
def _debuginfod_of(tmp_path: Path, out: Path, build_id: str) -> Iterator[str]:
    """A real debuginfod indexing the files in `out`, once it serves `build_id`'s executable:
    its URL; stopped after."""
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("debuginfod") or "debuginfod", "-p", str(port), "-d",
         str(tmp_path / "db.sqlite"), "-F", str(out), "-t", "0", "-g", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{url}/buildid/{build_id}/executable", timeout=2):
                break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"debuginfod did not index {out}")
            time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@sqlite_only
async def test_compressed_sections_are_served_compressed_as_elfutils_does(
    start_symgate: SymgateFactory, compressed: tuple[str, Path, str]
) -> None:
    build_id, exe, url = compressed
    flags = subprocess.run(["readelf", "-SW", exe], check=True, capture_output=True,
                           text=True).stdout
    assert any(".debug_info" in line and " C " in line for line in flags.splitlines())
    sg = await start_symgate([url])
    assert await _same_as_elfutils(sg.url, url, build_id, (*HEADERS, "Last-Modified")) == []


@sqlite_only
async def test_an_empty_section_is_no_section_as_for_elfutils(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """elfutils finds a section by its bytes (elf_rawdata): an empty one is as good as none,
    a 404 or, in the debuginfo, the executable's. symgate served it as a 200 of no bytes,
    and a debuginfo's empty section hid the executable's full one."""
    out = tmp_path / "bin"
    out.mkdir()
    exe, debug = out / "prog", out / "prog.debug"
    marker = tmp_path / "marker"
    marker.write_bytes(b"in the executable only")
    for original, copy, full in ((elfs.prog.executable, exe, True),
                                 (elfs.prog.debug, debug, False)):
        subprocess.run(["objcopy", "--add-section", f".both={marker if full else '/dev/null'}",
                        "--add-section", ".empty=/dev/null", original, copy], check=True)
    with _debuginfod_of(tmp_path, out, elfs.prog.build_id) as url:
        sg = await start_symgate([url])
        assert await _same_as_elfutils(sg.url, url, elfs.prog.build_id, (*HEADERS,),
                                       (".empty", ".both", ".debug_info")) == []
        status, headers, body = await _direct(
            f"{sg.url}/buildid/{elfs.prog.build_id}/section/.both")
        assert (status, body, headers["X-DEBUGINFOD-FILE"]) == (200, marker.read_bytes(),
                                                                "prog")



@sqlite_only
async def test_a_section_whose_header_runs_past_its_file_is_no_section_as_for_elfutils(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """elfutils' libelf refuses a section header whose bytes are not all in the file
    (elf_rawdata: "invalid section header"), and debuginfod looks in the executable, or answers
    404. symgate held the room such a header claims in the budget before copying, evicting
    cached files for bytes that were never there, then answered 502; an offset past what a seek
    takes was a 500."""
    out = tmp_path / "bin"
    out.mkdir()
    debug = out / "prog.debug"
    shutil.copy(elfs.prog.debug, debug)
    shutil.copy(elfs.prog.executable, out / "prog")
    shutil.copy(elfs.other.debug, out / "other.debug")
    budget = 1 << 20
    # Room for it beside the files being read (the one cut from, and a cached file whose
    # symbol table may be being built), once the other files are evicted.
    claim = budget - debug.stat().st_size - elfs.other.debug.stat().st_size
    set_section_extent(debug, ".debug_line", 0, claim)
    set_section_extent(debug, ".debug_str", (1 << 64) - 16, 64)
    set_section_extent(debug, ".symtab", debug.stat().st_size - 8, 16)  # the executable's
    with _debuginfod_of(tmp_path, out, elfs.prog.build_id) as url:
        sg = await start_symgate([url], cache=CacheConfig(max_bytes=budget))
        assert (await sg.get(f"/buildid/{elfs.other.build_id}/section/.debug_info"))[0] == 200
        assert await _same_as_elfutils(sg.url, url, elfs.prog.build_id, HEADERS,
                                       (".debug_line", ".debug_str", ".symtab")) == []
        status, headers, _ = await _direct(f"{sg.url}/buildid/{elfs.prog.build_id}"
                                           "/section/.symtab")
        assert (status, headers["X-DEBUGINFOD-FILE"]) == (200, "prog")
        assert await sg.metric("symgate_cache_evictions_total") == 0

# Names an ELF file may give its sections, which elfutils serves as the file has them: the
# characters of `__ksymtab+sym`, C++ -ffunction-sections names longer than 255 bytes.
ODD_SECTIONS = (".a+b", ".a:b", ".a~b", ".a b", ".a%b", ".a#b", ".a?b", ".caf\u00e9",
                ".text." + "_ZN" * 120)


@sqlite_only
async def test_sections_of_any_name_the_file_has_are_served_as_elfutils_serves_them(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """symgate refused (400, which elfutils' client keeps as a miss for ten minutes) every
    name outside [A-Za-z0-9._$@-] or longer than 255 characters, though ELF section names
    are any bytes but NUL and elfutils' debuginfod serves them."""
    out = tmp_path / "bin"
    out.mkdir()
    marker = tmp_path / "marker"
    marker.write_bytes(b"an oddly named section")
    adds = [arg for name in ODD_SECTIONS for arg in ("--add-section", f"{name}={marker}")]
    subprocess.run(["objcopy", *adds, elfs.prog.debug, out / "prog.debug"], check=True)
    shutil.copy(elfs.prog.executable, out / "prog")
    with _debuginfod_of(tmp_path, out, elfs.prog.build_id) as url:
        sg = await start_symgate([url])
        quoted = tuple(urllib.parse.quote(name, safe="") for name in ODD_SECTIONS)
        assert await _same_as_elfutils(sg.url, url, elfs.prog.build_id, HEADERS, quoted) == []
        for name in quoted:
            status, _, body = await _direct(
                f"{sg.url}/buildid/{elfs.prog.build_id}/section/{name}")
            assert (status, body) == (200, marker.read_bytes()), name


@sqlite_only
async def test_a_section_of_a_debuginfo_larger_than_the_budget_is_cut_and_kept(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream,
    elfs: ElfSet,
) -> None:
    # The debuginfo is served but not kept (twice the budget): the section is cut from the
    # download's open file, and kept on its own, so the debuginfo is not fetched again.
    budget = elfs.prog.debug.stat().st_size // 2
    sg = await start_symgate([faults.url_for("ok")], cache=CacheConfig(max_bytes=budget))
    path = f"/buildid/{elfs.prog.build_id}/section/.debug_info"
    want = await _direct(debuginfod.url + path)
    assert want[0] == 200 and 0 < len(want[2]) < budget
    for _ in range(2):
        status, headers, body = await sg.get(path)
        assert (status, body) == (200, want[2])
        assert headers["X-DEBUGINFOD-FILE"] == want[1]["X-DEBUGINFOD-FILE"]
    assert faults.count("ok") == 1


@sqlite_only
async def test_a_section_falls_back_to_the_executable_when_the_debuginfo_is_too_large(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream,
    elfs: ElfSet,
) -> None:
    limit = 1024 * 1024
    assert elfs.big.executable.stat().st_size <= limit < elfs.big.debug.stat().st_size
    sg = await start_symgate([faults.url_for("ok")],
                             cache=CacheConfig(max_artifact_bytes=limit))
    path = f"/buildid/{elfs.big.build_id}/section/.text"  # NOBITS in the debuginfo
    want = await _direct(debuginfod.url + path)
    assert want[0] == 200
    status, _, body = await sg.get(path)
    assert (status, body) == (200, want[2])


@sqlite_only
async def test_a_section_whose_file_had_to_be_fetched_is_counted_a_miss(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
) -> None:
    """The first request of a section costs the download of its debuginfo: a miss in the
    metrics (and so in the status page's hit ratio), not a hit; the next one is a hit."""
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/section/.debug_info"
    status, _, _ = await sg.get(path)
    assert status == 200 and faults.count("ok") == 1
    labels = {"endpoint": "buildid", "kind": "section"}
    assert await sg.metric("symgate_requests_total", outcome="miss", **labels) == 1
    assert await sg.metric("symgate_requests_total", outcome="hit", **labels) == 0
    status, _, _ = await sg.get(path)
    assert status == 200 and faults.count("ok") == 1
    assert await sg.metric("symgate_requests_total", outcome="hit", **labels) == 1


@sqlite_only
@pytest.mark.parametrize("liar", ["wrong-bytes", "html"])
async def test_a_section_whose_first_upstream_sends_another_file_is_cut_from_the_next(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream,
    elfs: ElfSet, liar: str,
) -> None:
    """A GET of the debuginfo (or executable) whose first upstream sends another file, or no
    ELF file, is asked again at once, the others first (README): a section, cut only once its
    file is whole, had none of the bad answer sent either, yet was answered 502."""
    sg = await start_symgate([faults.url_for(liar), faults.url_for("ok")])
    for name in (".text", ".debug_info"):  # the executable's, the debuginfo's
        path = f"/buildid/{elfs.prog.build_id}/section/{name}"
        want = await _direct(debuginfod.url + path)
        status, headers, body = await sg.get(path)
        assert (status, body) == (200, want[2]), (name, body[:200])
        assert headers["X-DEBUGINFOD-FILE"] == want[1]["X-DEBUGINFOD-FILE"]


@sqlite_only
async def test_a_section_of_the_executable_is_cut_though_the_debuginfo_is_another_file(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
) -> None:
    """A stale debug tree whose .debug link is another build's file, its executable right: a
    debuginfo that cannot be had, as when its upstream fails, and the section is the
    executable's, as elfutils serves it. The wrong file was the answer: a 502."""
    from proxy.config import UpstreamConfig
    from tests.elfs import build_id_tree

    prog = elfs.prog
    tree = build_id_tree(tmp_path / "debug", prog.build_id, elfs.other.debug, prog.executable)
    sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0)])
    assert (await sg.get(f"/buildid/{prog.build_id}/debuginfo"))[0] == 502
    path = f"/buildid/{prog.build_id}/section/.text"  # NOBITS in the debuginfo
    want = await _direct(debuginfod.url + path)
    status, _, body = await sg.get(path)
    assert (status, body) == (200, want[2])
    status, _, _ = await sg.get(f"/buildid/{prog.build_id}/section/.debug_info")
    assert status == 502  # the debuginfo's alone: its failure is the answer


def _grow_section_names(path: Path, extra: int) -> None:
    """Make the section-name table of the ELF64 little-endian file at `path` `extra` bytes
    longer (NULs appended to the file): past what symbolize.elf_headers reads, so the file's
    sections are read by pyelftools."""
    data = bytearray(path.read_bytes())
    shoff, = struct.unpack_from("<Q", data, 0x28)
    names_at, = struct.unpack_from("<H", data, 0x3E)
    row = shoff + names_at * 64
    at, = struct.unpack_from("<Q", data, row + 24)
    data += bytes(extra)
    struct.pack_into("<Q", data, row + 32, len(data) - at)
    path.write_bytes(data)


@sqlite_only
@pytest.mark.parametrize("names_table", ["small", "past elf_headers"])
async def test_a_section_name_that_is_not_utf8_is_not_taken_for_another(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path, names_table: str
) -> None:
    """Section names are bytes: elfutils finds `.x<U+FFFD>` by its UTF-8 bytes alone. symgate
    read names as UTF-8 with each byte that is not replaced by U+FFFD, and served the first
    section so decoded, the one named by the byte FF, for a request of another section's
    name (and for one the file does not have)."""
    out = tmp_path / "bin"
    out.mkdir()
    adds: list[bytes] = []
    # objcopy puts the sections it adds in the opposite order: .x\xff comes first.
    for i, name in enumerate((b".y\xfe", ".x\ufffd".encode(), b".x\xff")):
        marker = tmp_path / f"marker{i}"
        marker.write_bytes(b"section %d" % i)
        adds += [b"--add-section", name + b"=" + bytes(marker)]
    subprocess.run([b"objcopy", *adds, bytes(elfs.prog.debug), bytes(out / "prog.debug")],
                   check=True)
    if names_table != "small":
        _grow_section_names(out / "prog.debug", 2 << 20)
    shutil.copy(elfs.prog.executable, out / "prog")
    with _debuginfod_of(tmp_path, out, elfs.prog.build_id) as url:
        sg = await start_symgate([url])
        asked = (".x%EF%BF%BD", ".y%EF%BF%BD")
        assert await _same_as_elfutils(sg.url, url, elfs.prog.build_id, HEADERS, asked) == []
        status, _, body = await _direct(f"{sg.url}/buildid/{elfs.prog.build_id}/section/"
                                        ".x%EF%BF%BD")
        assert (status, body) == (200, b"section 1")


@sqlite_only
async def test_a_section_of_a_cached_file_cut_short_on_disk_is_cut_from_it_fetched_again(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
) -> None:
    """A GET of a cached file that is not the size its row says (cut short on disk) fetches it
    anew; a section was cut from it as it was: its section headers, at its end, gone, every
    section of it was a 404 (and one whose bytes were left, the damaged file's)."""
    sg = await start_symgate([faults.url_for("ok")])
    bid = elfs.prog.build_id
    assert (await sg.get(f"/buildid/{bid}/debuginfo"))[0] == 200
    await sg.settled()
    stored = sg.config.cache_dir / "objects" / ArtifactKey.parse(bid, "debuginfo").storage_name
    stored.write_bytes(elfs.prog.debug.read_bytes()[:stored.stat().st_size // 2])
    extent = section_extent(elfs.prog.debug, ".debug_info")
    assert extent is not None
    want = elfs.prog.debug.read_bytes()[extent[0]:extent[0] + extent[1]]
    status, headers, body = await sg.get(f"/buildid/{bid}/section/.debug_info")
    assert (status, body, headers["X-DEBUGINFOD-FILE"]) == (200, want, "prog.debug")
    assert faults.asked[("ok", bid, "debuginfo")] == 2
    assert (await sg.get(f"/buildid/{bid}/debuginfo"))[::2] == (200, elfs.prog.debug.read_bytes())


def _find_section(server: str, cache: Path, build_id: str, name: bytes) -> bytes | None:
    """The section as elfutils' client gets it from `server` (it asks for the name's bytes,
    curl percent-encoding those past ASCII): its bytes, or None where it failed."""
    env = {**os.environ, "DEBUGINFOD_URLS": server, "DEBUGINFOD_CACHE_PATH": str(cache)}
    done = subprocess.run([b"debuginfod-find", b"section", build_id.encode(), name], env=env,
                          capture_output=True, timeout=60)
    return Path(os.fsdecode(done.stdout.strip())).read_bytes() if done.returncode == 0 \
        else None


def _prog_with_sections(tmp_path: Path, elfs: ElfSet, sections: dict[bytes, bytes]) -> Path:
    """A folder for a debuginfod: prog, and its debug file with these sections (name: bytes)
    added."""
    out = tmp_path / "bin"
    out.mkdir()
    adds: list[bytes] = []
    for i, (name, data) in enumerate(sections.items()):
        (tmp_path / f"section{i}").write_bytes(data)
        adds += [b"--add-section", name + b"=" + bytes(tmp_path / f"section{i}")]
    subprocess.run([b"objcopy", *adds, bytes(elfs.prog.debug), bytes(out / "prog.debug")],
                   check=True)
    shutil.copy(elfs.prog.executable, out / "prog")
    return out


@sqlite_only
async def test_a_section_whose_name_is_not_utf8_is_served_as_elfutils_serves_it(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """A section name is any bytes but NUL: elfutils' debuginfod serves `.caf\\xe9` (a Latin-1
    name) and its client gets it; symgate answered every name that is not UTF-8 with a 400,
    which the client keeps as a miss, though the file it had cached held the section."""
    names = (b".caf\xe9", b".caf%E9", ".caf\ufffd".encode())
    out = _prog_with_sections(tmp_path, elfs, {name: b"section %d" % i
                                               for i, name in enumerate(names)})
    bid = elfs.prog.build_id
    with _debuginfod_of(tmp_path, out, bid) as url:
        sg = await start_symgate([url])
        asked = (".caf%E9", ".caf%e9", ".caf%25E9", ".caf%EF%BF%BD", ".caf%E8", ".%FF%FE")
        for attempt in ("cold", "warm"):
            assert await _same_as_elfutils(sg.url, url, bid, HEADERS, asked) == [], attempt
        status, _, body = await _direct(f"{sg.url}/buildid/{bid}/section/.caf%E9")
        assert (status, body) == (200, b"section 0")
        status, _, body = await _direct(f"{sg.url}/buildid/{bid}/section/.caf%E8")
        assert status == 404 and body.startswith(b"not found"), body
        for server, cache in ((url, tmp_path / "direct"), (sg.url, tmp_path / "via")):
            got = await asyncio.to_thread(_find_section, server, cache, bid, b".caf\xe9")
            assert got == b"section 0", server


@sqlite_only
async def test_a_section_whose_name_has_a_slash_or_is_dots_is_served_as_elfutils_serves_it(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """elfutils' client sends a section name as it is, `/section/a/b` for `a/b`, and its
    debuginfod takes all that follows `/section/` as the name; symgate answered it with a
    400 (kept by the client as a miss), whether asked so or as `a%2Fb`; and `..`, which the
    client sends as it is too."""
    marker, dots = b"a slashed section", b"a section named .."
    out = _prog_with_sections(tmp_path, elfs, {b"a/b": marker, b".x/../y": marker, b"..": dots})
    bid = elfs.prog.build_id
    with _debuginfod_of(tmp_path, out, bid) as url:
        sg = await start_symgate([url])
        # (aiohttp resolves "/../" in a URL before it is sent, "%2E%2E" too: only the encoded
        # slash reaches; elfutils' client sends ".." as it is, below.)
        asked = ("a/b", "a%2Fb", "a/b/", "a/c", ".x%2F..%2Fy")
        for attempt in ("cold", "warm"):
            assert await _same_as_elfutils(sg.url, url, bid, HEADERS, asked) == [], attempt
        status, _, body = await _direct(f"{sg.url}/buildid/{bid}/section/a/b")
        assert (status, body) == (200, marker)
        for server, cache in ((url, tmp_path / "direct"), (sg.url, tmp_path / "via")):
            got = await asyncio.to_thread(_find_section, server, cache, bid, b"a/b")
            assert got == marker, server
            # Sent as it is (/section/..), not resolved away.
            got = await asyncio.to_thread(_find_section, server, cache, bid, b"..")
            assert got == dots, server


@sqlite_only
async def test_a_section_whose_name_has_a_tab_or_a_line_break_is_served_as_elfutils_serves_it(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """A section name is any bytes but NUL, as a source path is: `debuginfod-find section ID
    $'a\\tb'` sends /section/a%09b and gets the section from elfutils' debuginfod, but symgate
    answered 400 (a miss the client keeps for ten minutes), though a source path with a tab
    was served and the README said a section name is taken as a source path is."""
    tab, line = b"a section with a tab", b"a section with a line break"
    out = _prog_with_sections(tmp_path, elfs, {b"a\tb": tab, b".x\ny": line})
    bid = elfs.prog.build_id
    with _debuginfod_of(tmp_path, out, bid) as url:
        sg = await start_symgate([url])
        asked = ("a%09b", ".x%0Ay", "a%09c")
        for attempt in ("cold", "warm"):
            assert await _same_as_elfutils(sg.url, url, bid, HEADERS, asked) == [], attempt
        status, _, body = await _direct(f"{sg.url}/buildid/{bid}/section/.x%0Ay")
        assert (status, body) == (200, line)
        status, _, body = await _direct(f"{sg.url}/buildid/{bid}/section/a%09c")
        assert status == 404 and body.startswith(b"not found (no section a%09c "), body
        for server, cache in ((url, tmp_path / "direct"), (sg.url, tmp_path / "via")):
            got = await asyncio.to_thread(_find_section, server, cache, bid, b"a\tb")
            assert got == tab, server
