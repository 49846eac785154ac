"""Debug files that `dwz -m` gave a supplementary file, as Fedora's, RHEL's and (for packages of
several programs) Debian's and Ubuntu's debug packages ship them: read with it, they give the
frames the debug files gave before dwz, offline, through a real debuginfod and symgate's cache,
and from the debug directories; without it (or with another file in its place), names alone,
never frames in the wrong files."""

from __future__ import annotations

import asyncio
import gzip
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.config import NegativeConfig, SymbolizeConfig, TenantConfig
from symbolize.elf import build_id_of_file
from symbolize.offline import symbolize_bytes
from symbolize.pipeline import Limits
from symbolize.pprof.profile_pb2 import Profile
from symbolize.supplementary import SupplementLink, parse_link, supplement_link
from symbolize.symtab import NoSymbols, build_symbol_table
from tests.elfs import Elf, build_program
from tests.harness import Debuginfod, SymgateFactory, eventually, running_debuginfod, serves
from tests.profiles import Expected, code_addresses, frames_of, make_profile, place
from tests.rewriting import table_frames

pytestmark = [pytest.mark.one_database,
              pytest.mark.skipif(shutil.which("dwz") is None, reason="needs dwz")]

LIMITS = Limits(SymbolizeConfig().max_decompressed_bytes, max_build_ids=sys.maxsize)


@dataclass(frozen=True)
class DwzSet:
    programs: list[Elf]  # their debug files dwz'd
    originals: dict[str, Path]  # build ID -> the debug file as gcc and objcopy made it
    common: Path  # the supplementary file
    common_id: str


def _dwz_set(root: Path, *flags: str) -> DwzSet:
    """Two C++ programs and two C programs, their debug files given one
    supplementary file by `dwz -m`."""
    shapes = [("cpp", 1), ("cpp", 2), ("exe", 3), ("exe", 4)]
    programs = [build_program(root / "src", root, f"p{seed}", seed, shape=shape)
                for shape, seed in shapes]
    (root / "orig").mkdir()
    originals = {}
    for p in programs:
        originals[p.build_id] = root / "orig" / p.debug.name
        shutil.copyfile(p.debug, originals[p.build_id])
    common = root / "common.debug"
    subprocess.run(["dwz", *flags, "-m", str(common), *(str(p.debug) for p in programs)],
                   check=True, capture_output=True)
    return DwzSet(programs, originals, common, build_id_of_file(common) or "")


@pytest.fixture(scope="module")
def dwz_set(tmp_path_factory: pytest.TempPathFactory) -> DwzSet:
    return _dwz_set(tmp_path_factory.mktemp("dwz"))


def _frames(debug: Path, elf: Elf, supplement: Path | None, work: Path
            ) -> tuple[bool, dict[int, list[Expected]]]:
    return table_frames(debug, elf, work / f"with-{supplement.name if supplement else 0}",
                        supplement)


def test_the_link_names_the_supplement_by_path_and_build_id(dwz_set: DwzSet) -> None:
    for p in dwz_set.programs:
        assert supplement_link(p.debug) == SupplementLink(str(dwz_set.common), dwz_set.common_id)
        assert supplement_link(dwz_set.originals[p.build_id]) is None


def test_damaged_links_name_nothing() -> None:
    assert parse_link(b"") is None
    assert parse_link(b"no terminator") is None
    assert parse_link(b"\0\x01\x02") is None  # no name
    assert parse_link(b"/a/b\0") == SupplementLink("/a/b", "")  # no build ID: never matches
    assert parse_link(b"/a/b\0\xab\xcd") == SupplementLink("/a/b", "abcd")


def test_with_its_supplement_a_dwz_debug_file_gives_the_frames_it_gave_before(
        dwz_set: DwzSet, tmp_path: Path) -> None:
    """Names, files, lines, start lines and inline chains at every instruction, as the debug
    file gave them before dwz moved its shared DWARF away (inline functions' names, their
    declared lines, the types that qualify C++ names)."""
    inlined = 0
    for p in dwz_set.programs:
        lines, want = _frames(dwz_set.originals[p.build_id], p, None, tmp_path)
        got_lines, got = _frames(p.debug, p, dwz_set.common, tmp_path)
        assert lines and got_lines
        assert got == want, p.name
        inlined += sum(len(frames) > 1 for frames in want.values())
    assert inlined > 50  # the chains dwz's moved DIEs name are there


def test_the_supplement_itself_gets_no_table(dwz_set: DwzSet, tmp_path: Path) -> None:
    """Cached as any debug file, the supplement had a table of its own built, of no code:
    0.5 s of a build worker for libc's, beside the builds of the profile that fetched it."""
    with pytest.raises(NoSymbols, match="describes no code"):
        build_symbol_table(dwz_set.common, tmp_path / "common.symc", dwz_set.common_id)


def test_without_its_supplement_or_with_another_file_names_alone(
        dwz_set: DwzSet, tmp_path: Path) -> None:
    """A supplement that is not the linked one (another build ID: another package's, or an
    older build of the same) would give the code another program's names and lines."""
    other = dwz_set.programs[1].debug  # a real ELF debug file, of another build ID
    p = dwz_set.programs[0]
    bare_lines, bare = _frames(p.debug, p, None, tmp_path)
    wrong_lines, wrong = _frames(p.debug, p, other, tmp_path)
    assert not bare_lines and not wrong_lines
    assert wrong == bare
    assert all(f.function and not f.file and not f.line for frames in bare.values()
               for f in frames)


def test_a_dwarf5_debug_sup_link_is_named_by_symbols(tmp_path: Path) -> None:
    """`dwz -5` links with DWARF 5's .debug_sup, whose references libdw 0.188 reads as nameless
    (eu-addr2line cuts the inline chains): not followed, even with the supplement at hand."""
    made = _dwz_set(tmp_path, "-5")
    p = made.programs[0]
    raw = subprocess.run(["readelf", "-S", str(p.debug)], capture_output=True, text=True).stdout
    assert ".debug_sup" in raw and ".gnu_debugaltlink" not in raw
    assert supplement_link(p.debug) is None
    lines, frames = _frames(p.debug, p, made.common, tmp_path)
    assert not lines
    assert all(f.function and not f.line for fs in frames.values() for f in fs)


def _tree(root: Path, dwz_set: DwzSet, *, originals: bool, common: bool) -> Path:
    for p in dwz_set.programs:
        d = root / ".build-id" / p.build_id[:2]
        d.mkdir(parents=True, exist_ok=True)
        debug = dwz_set.originals[p.build_id] if originals else p.debug
        (d / (p.build_id[2:] + ".debug")).symlink_to(debug)
        (d / p.build_id[2:]).symlink_to(p.executable)
    if common:
        d = root / ".build-id" / dwz_set.common_id[:2]
        d.mkdir(parents=True, exist_ok=True)
        (d / (dwz_set.common_id[2:] + ".debug")).symlink_to(dwz_set.common)
    return root


def _profile(dwz_set: DwzSet) -> bytes:
    placed = [(place(p, 0x7F00_0000_0000 + (n << 32)), code_addresses(p)[::2])
              for n, p in enumerate(dwz_set.programs)]
    return gzip.compress(make_profile(placed).SerializeToString(), mtime=0)


def test_offline_finds_the_supplement_by_build_id_and_where_the_link_names_it(
        dwz_set: DwzSet, tmp_path: Path) -> None:
    body = _profile(dwz_set)
    want, report = symbolize_bytes(
        body, [_tree(tmp_path / "orig", dwz_set, originals=True, common=False)], LIMITS)
    assert report.mappings_symbolized == len(dwz_set.programs)
    by_id, _r = symbolize_bytes(
        body, [_tree(tmp_path / "by-id", dwz_set, originals=False, common=True)], LIMITS)
    # Not under .build-id: where .gnu_debugaltlink says (dwz wrote the absolute path).
    by_link, _r = symbolize_bytes(
        body, [_tree(tmp_path / "by-link", dwz_set, originals=False, common=False)], LIMITS)
    assert by_id == want and by_link == want


async def test_the_server_finds_a_local_debug_files_supplement_where_its_link_says(
        start_symgate: SymgateFactory, dwz_set: DwzSet, tmp_path: Path) -> None:
    """A debug directory laid out as a distribution installs one: the supplement under
    `.dwz/`, where the debug file's link names it, not under `.build-id/`. The offline CLI
    found it there, as gdb does; the server looked by build ID alone, and had no lines."""
    body = _profile(dwz_set)
    want, _r = await asyncio.to_thread(
        symbolize_bytes, body, [_tree(tmp_path / "orig", dwz_set, originals=True, common=False)],
        LIMITS)
    tree = _tree(tmp_path / "by-link", dwz_set, originals=False, common=False)
    sg = await start_symgate([], symbolize=SymbolizeConfig(build_workers=1, debug_dirs=(tree,)))
    status, _h, answer = await sg.request("POST", "/symbolize", data=body,
                                          headers={"Content-Type": "application/octet-stream"})
    assert status == 200 and answer == want


@pytest.fixture
def dwz_upstream(dwz_set: DwzSet, tmp_path: Path) -> Iterator[tuple[Debuginfod, Path]]:
    """A real elfutils debuginfod over the executables and dwz'd debug files, rescanning its
    directory every second; the supplementary file is not there yet (the test puts it)."""
    served = tmp_path / "served"
    served.mkdir()
    for p in dwz_set.programs:
        shutil.copyfile(p.executable, served / p.executable.name)
        shutil.copyfile(p.debug, served / p.debug.name)
    with running_debuginfod(served, tmp_path, "-t", "1", "-g", "0") as upstream:
        yield upstream, served


async def test_the_server_fetches_the_supplement_and_builds_again_once_it_is_published(
        start_symgate: SymgateFactory, dwz_upstream: tuple[Debuginfod, Path], dwz_set: DwzSet,
        tmp_path: Path) -> None:
    """Through symgate's cache: the supplementary file is fetched by its build ID beside the
    debug file. While the upstream lacks it, the mappings are named by their symbols; once it
    is published, the next profile after the miss's TTL is answered as the debug files
    answered before dwz, byte for byte as offline from those files."""
    upstream, served = dwz_upstream
    for p in dwz_set.programs:
        await eventually(lambda p=p: serves(f"{upstream.url}/buildid/{p.build_id}/debuginfo"))
    body = _profile(dwz_set)
    want, _r = await asyncio.to_thread(
        symbolize_bytes, body, [_tree(tmp_path / "orig", dwz_set, originals=True, common=False)],
        LIMITS)
    sg = await start_symgate([upstream.url], symbolize=SymbolizeConfig(build_workers=1),
                             negative=NegativeConfig(not_found_initial_ttl_s=1,
                                                     not_found_ttl_s=1))
    headers = {"Content-Type": "application/octet-stream"}
    status, got_headers, bare = await sg.request("POST", "/symbolize", data=body,
                                                 headers=headers)
    assert status == 200
    assert got_headers["X-Symgate-Mappings-Symbolized"] == str(len(dwz_set.programs))
    out = Profile.FromString(gzip.decompress(bare))
    frames = [f for loc in out.location for f in frames_of(out, loc)]
    assert frames and all(f.function and not f.line for f in frames)

    shutil.copyfile(dwz_set.common, served / dwz_set.common.name)
    await eventually(lambda: serves(f"{upstream.url}/buildid/{dwz_set.common_id}/debuginfo"))

    async def lines_now() -> bool:
        status, _h, answer = await sg.request("POST", "/symbolize", data=body, headers=headers)
        return status == 200 and answer == want

    await eventually(lines_now)
    status, _h, cached = await sg.get(f"/buildid/{dwz_set.common_id}/debuginfo")
    assert status == 200 and cached == dwz_set.common.read_bytes()


def test_dies_nested_past_any_real_code_do_not_fail_the_build(tmp_path: Path) -> None:
    """1,200 nested blocks (a hostile or damaged file's) took the reader past Python's
    recursion limit: the build failed, and every profile asked for it again."""
    depth = 1200
    body = "".join(f"{{ volatile int v{i} = {i}; " for i in range(depth))
    body += f"v0 = v{depth - 1};" + "}" * depth
    elves = []
    for k in (1, 2):
        src, exe = tmp_path / f"deep{k}.c", tmp_path / f"deep{k}"
        src.write_text(f"int deep{k}(void) {{ {body} return 0; }}\n"
                       f"int main(void) {{ return deep{k}(); }}\n")
        subprocess.run(["gcc", "-g", "-O0", "-Wl,--build-id", "-o", str(exe), str(src)],
                       check=True)
        subprocess.run(["objcopy", "--only-keep-debug", str(exe), f"{exe}.debug"], check=True)
        build_id = build_id_of_file(exe)
        assert build_id
        elves.append(Elf(f"deep{k}", build_id, exe, Path(f"{exe}.debug"), (src,)))
    common = tmp_path / "common.debug"
    subprocess.run(["dwz", "-m", str(common), *(str(e.debug) for e in elves)], check=True,
                   capture_output=True)
    lines, frames = _frames(elves[0].debug, elves[0], common, tmp_path)
    assert lines
    assert {f.function for fs in frames.values() for f in fs} >= {"deep1", "main"}


def test_line_rows_read_in_bulk_are_the_rows_read_one_by_one(
        dwz_set: DwzSet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows are taken from libdw's row array at once, its layout checked against libdw's
    accessors; where a check fails they are read one by one. Both give the same table."""
    import symbolize.supplementary as supplementary

    p = dwz_set.programs[0]
    bulk = _frames(p.debug, p, dwz_set.common, tmp_path / "bulk")
    monkeypatch.setattr(supplementary._Walker, "_rows_in_bulk", lambda *_a: None)
    assert _frames(p.debug, p, dwz_set.common, tmp_path / "one") == bulk


async def test_a_fetched_dwz_debug_file_brings_its_supplement_for_a_site_cut_off_later(
        start_symgate: SymgateFactory, dwz_upstream: tuple[Debuginfod, Path], dwz_set: DwzSet,
        tmp_path: Path) -> None:
    """A debugger's or `symgate prefetch`'s fetch of a dwz'd debug file brings its
    supplementary file into the cache too, as the table built ahead needs it: once the
    upstream is gone, profiles still get the lines."""
    upstream, served = dwz_upstream
    shutil.copyfile(dwz_set.common, served / dwz_set.common.name)
    for p in dwz_set.programs:
        await eventually(lambda p=p: serves(f"{upstream.url}/buildid/{p.build_id}/debuginfo"))
    await eventually(lambda: serves(f"{upstream.url}/buildid/{dwz_set.common_id}/debuginfo"))
    body = _profile(dwz_set)
    want, _r = await asyncio.to_thread(
        symbolize_bytes, body, [_tree(tmp_path / "orig", dwz_set, originals=True, common=False)],
        LIMITS)
    sg = await start_symgate([upstream.url], symbolize=SymbolizeConfig(build_workers=1))
    for p in dwz_set.programs:
        for kind in ("debuginfo", "executable"):
            status, _h, _b = await sg.get(f"/buildid/{p.build_id}/{kind}")
            assert status == 200

    async def tables_built() -> bool:
        built = await sg.metric("symgate_symtab_builds_total", result="ok")
        return built is not None and built >= len(dwz_set.programs)

    await eventually(tables_built)
    upstream.process.terminate()
    upstream.process.wait(10)
    status, _h, answer = await sg.request("POST", "/symbolize", data=body,
                                          headers={"Content-Type": "application/octet-stream"})
    assert status == 200 and answer == want


def test_a_symbol_name_with_a_line_break_does_not_cost_the_lines(
        dwz_set: DwzSet, tmp_path: Path) -> None:
    """The DWARF is read into Breakpad text, whose records end at a line's end: a hostile
    symbol table's name with a line break in it made the text unreadable to symbolic."""
    p = dwz_set.programs[2]
    damaged = tmp_path / "damaged.debug"
    raw = p.debug.read_bytes()
    assert raw.count(b"\0deregister_tm_clones\0") == 1
    damaged.write_bytes(raw.replace(b"\0deregister_tm_clones\0", b"\0deregister\ntm_clones\0"))
    _lines, want = _frames(dwz_set.originals[p.build_id], p, None, tmp_path / "orig")
    lines, got = _frames(damaged, p, dwz_set.common, tmp_path / "damaged")
    assert lines
    # .strtab keeps `register_tm_clones` as the tail of `deregister_tm_clones`: both changed.
    for v, frames in want.items():
        assert [f.function for f in got[v]] == [
            f.function.replace("register_tm_clones", "register tm_clones") for f in frames]
        assert [(f.file, f.line) for f in got[v]] == [(f.file, f.line) for f in frames]


@pytest.mark.parametrize("compressed", ["debug file", "supplement", "both"])
def test_zstd_compressed_sections_are_read_by_libdw_too(
        dwz_set: DwzSet, tmp_path: Path, compressed: str) -> None:
    """`objcopy --compress-debug-sections=zstd` (or `gcc -gz=zstd`): libdw 0.188, which alone
    reads a dwz'd file, reads no zstd section, and such a file had no lines at all."""
    p = dwz_set.programs[0]
    debug, common = p.debug, dwz_set.common
    if compressed in ("debug file", "both"):
        debug = tmp_path / "zstd.debug"
        subprocess.run(["objcopy", "--compress-debug-sections=zstd", str(p.debug), str(debug)],
                       check=True)
    if compressed in ("supplement", "both"):
        common = tmp_path / "common-zstd.debug"
        subprocess.run(["objcopy", "--compress-debug-sections=zstd", str(dwz_set.common),
                        str(common)], check=True)
    _lines, want = _frames(dwz_set.originals[p.build_id], p, None, tmp_path / "orig")
    lines, got = _frames(debug, p, common, tmp_path / "zstd")
    assert lines
    assert got == want
    assert not list((tmp_path / "zstd").glob("*.tmp"))


def _dwz_programs(root: Path, sources: dict[str, str], compiler: str, *flags: str
                  ) -> tuple[list[Elf], dict[str, Path], Path]:
    """Programs built from `sources` (name -> text) with `compiler` and `flags`, their debug
    files dwz'd with one supplementary file: the programs, their debug files as built, the
    supplement."""
    elves, originals = [], {}
    (root / "orig").mkdir(parents=True)
    for name, text in sources.items():
        src, exe = root / f"{name}.{'cpp' if compiler == 'g++' else 'c'}", root / name
        src.write_text(text)
        subprocess.run([compiler, "-g", *flags, "-Wl,--build-id", "-o", str(exe), str(src)],
                       check=True)
        debug = root / f"{name}.debug"
        subprocess.run(["objcopy", "--only-keep-debug", str(exe), str(debug)], check=True)
        build_id = build_id_of_file(exe)
        assert build_id
        elves.append(Elf(name, build_id, exe, debug, (src,)))
        originals[name] = root / "orig" / debug.name
        shutil.copyfile(debug, originals[name])
    common = root / "common.debug"
    subprocess.run(["dwz", "-m", str(common), *(str(e.debug) for e in elves)], check=True,
                   capture_output=True)
    assert all(supplement_link(e.debug) for e in elves)
    return elves, originals, common


STRINGS_ONLY_C = r"""
static inline __attribute__((always_inline)) int helper_number_K(int x) {
    volatile int v = x * K;
    return v + 7;
}
int work_K(int x) { return helper_number_K(x) + helper_number_K(x + 1); }
int main(void) { return work_K(3); }
"""


def test_a_supplement_of_strings_alone_is_read(tmp_path: Path) -> None:
    """Debug files that share no DWARF unit get a supplement of their shared strings alone
    (.debug_str, no .debug_info): libdw opens no such file, and the names the debug files
    took from it (DW_FORM_GNU_strp_alt) were lost: inline functions dropped, their lines in
    their callers', `main` without its name."""
    elves, originals, common = _dwz_programs(
        tmp_path, {f"strings{k}": STRINGS_ONLY_C.replace("K", str(k)) for k in (1, 2)},
        "gcc", "-O0")
    raw = subprocess.run(["readelf", "-SW", str(common)], capture_output=True, text=True).stdout
    assert ".debug_str" in raw and ".debug_info" not in raw
    for e in elves:
        _lines, want = _frames(originals[e.name], e, None, tmp_path / "orig")
        lines, got = _frames(e.debug, e, common, tmp_path)
        assert lines
        assert sum(len(frames) > 1 for frames in want.values()) > 5
        assert got == want, e.name
        assert not list(tmp_path.glob("*.tmp"))


def _relinked(debug: Path, out: Path, old: bytes, new: bytes) -> Path:
    """`debug` with its .gnu_debugaltlink's `old` (the path's or the build ID's bytes) made
    `new`, of the same length."""
    raw = debug.read_bytes()
    assert len(old) == len(new) and raw.count(old) == 1
    out.write_bytes(raw.replace(old, new))
    return out


def test_a_supplement_without_dwarf_is_none_not_a_search_by_the_link(
        dwz_set: DwzSet, tmp_path: Path) -> None:
    """A supplementary file of the linked build ID whose DWARF is gone (stripped, damaged, a
    hostile upstream's) gave libdw no supplement: it looked for one itself at the path the
    link names, any path on the machine (a FIFO there hung the build for good), and
    without one read the file's inline functions nameless, their lines in their callers'."""
    p = dwz_set.programs[0]
    no_dwarf = tmp_path / "no-dwarf.debug"
    subprocess.run(["objcopy", *(f"--remove-section={s}" for s in (
        ".debug_info", ".debug_abbrev", ".debug_str", ".debug_line")),
        str(dwz_set.common), str(no_dwarf)], check=True)
    assert build_id_of_file(no_dwarf) == dwz_set.common_id
    name = str(dwz_set.common).encode()
    nowhere = _relinked(p.debug, tmp_path / "p.debug", name, name[:-1] + b"X")
    _lines, bare = _frames(p.debug, p, None, tmp_path / "bare")
    lines, got = _frames(nowhere, p, no_dwarf, tmp_path / "no-dwarf")
    assert not lines
    assert got == bare


def test_a_link_to_the_files_own_build_id_names_no_supplement(
        dwz_set: DwzSet, tmp_path: Path) -> None:
    """Found by its build ID, the supplement of such a link is the debug file itself, whose
    references into the supplement then land on its own DIEs: other names, other files."""
    p = dwz_set.programs[0]
    own = _relinked(p.debug, tmp_path / "own.debug", bytes.fromhex(dwz_set.common_id),
                    bytes.fromhex(p.build_id))
    _lines, bare = _frames(p.debug, p, None, tmp_path / "bare")
    lines, got = _frames(own, p, own, tmp_path / "own")
    assert not lines
    assert got == bare



LAMBDAS_CPP = r"""
#include <cstdio>
#include <functional>
#include <string>
int main(int argc, char **argv) {
    std::string tag = argv[0];
    auto sized = [&](int k) { return (long)tag.size() * k + SEED; };
    std::function<long(long)> twice = [](long x) { return x * 2; };
    struct Local { long v; long get() const { return v + 1; } };
    Local l{argc};
    std::printf("%ld %ld %ld\n", sized(argc), twice(argc), l.get());
    return 0;
}
"""


def _same_frames_as_before_dwz(elves: list[Elf], originals: dict[str, Path], common: Path,
                               work: Path) -> Iterator[dict[int, list[Expected]]]:
    """Each program's frames (as its debug file gave them before dwz), once checked equal to
    those of its dwz'd debug file read with `common`."""
    for e in elves:
        _lines, want = _frames(originals[e.name], e, None, work / "orig")
        lines, got = _frames(e.debug, e, common, work)
        assert lines
        assert got == want, e.name
        yield want


def test_lambdas_and_local_classes_keep_their_lines(tmp_path: Path) -> None:
    """A lambda's operator() that is not inlined (at -O0; or called through std::function),
    and a local class's method, are defined in their class within the function: the reader
    did not look into a function's classes, so their code had no lines."""
    elves, originals, common = _dwz_programs(
        tmp_path, {f"lambdas{k}": LAMBDAS_CPP.replace("SEED", str(k)) for k in (1, 2)},
        "g++", "-O0")
    for want in _same_frames_as_before_dwz(elves, originals, common, tmp_path):
        assert any("lambda" in f.function and f.line for fs in want.values() for f in fs)


TEMPLATES_CPP = r"""
#include <map>
#include <vector>
#include <string>
#include <algorithm>
#include <functional>
#include <memory>
#include <cstdio>
#include <numeric>
namespace app {
template <typename T> struct Box {
  T v;
  explicit Box(T x) : v(x) {}
  T get() const { return v * 2; }
};
template <typename K, typename V> class Table {
  std::map<K, std::vector<V>> m;
public:
  void add(const K& k, V v) { m[k].push_back(v); }
  V total() const {
    V s{};
    for (auto& [k, vs] : m) s = std::accumulate(vs.begin(), vs.end(), s);
    return s;
  }
  template <typename F> void each(F f) const {
    for (auto& [k, vs] : m) for (auto& v : vs) f(k, v);
  }
};
struct Shape { virtual ~Shape() = default; virtual double area() const = 0; };
struct Sq : Shape {
  double s;
  explicit Sq(double x) : s(x) {}
  double area() const override { return s * s; }
};
struct Ci : Shape {
  double r;
  explicit Ci(double x) : r(x) {}
  double area() const override { return 3.14159 * r * r; }
};
}
int main(int argc, char** argv) {
  app::Table<std::string, long> t;
  for (int i = 0; i < argc * SEED00; ++i)
    t.add(std::to_string(i % 7), app::Box<long>(i).get());
  std::vector<std::unique_ptr<app::Shape>> shapes;
  for (int i = 0; i < argc * 10; ++i) {
    if (i % 2) shapes.push_back(std::make_unique<app::Sq>(i));
    else shapes.push_back(std::make_unique<app::Ci>(i));
  }
  std::sort(shapes.begin(), shapes.end(),
            [](auto& a, auto& b) { return a->area() < b->area(); });
  double s = 0;
  for (auto& p : shapes) s += p->area();
  long n = 0;
  t.each([&](const std::string& k, long v) { n += v + (long)k.size(); });
  std::function<long(long)> f = [&](long x) { return x + n; };
  std::printf("%ld %f %ld\n", t.total(), s, f(argc));
  return 0;
}
"""


def test_a_line_row_running_into_the_next_function_is_not_its_line(tmp_path: Path) -> None:
    """gcc's .cold parts lie side by side, and the last line row of one can run past its end
    into the next one's first bytes (std::sort's `__adjust_heap.cold` into
    `__unguarded_linear_insert.cold`): symbolic gives those bytes no line, as the row is not
    the function's; the Breakpad text carried it over, a line of another function."""
    elves, originals, common = _dwz_programs(
        tmp_path, {f"templates{k}": TEMPLATES_CPP.replace("SEED", str(k)) for k in (1, 2)},
        "g++", "-O2")
    for want in _same_frames_as_before_dwz(elves, originals, common, tmp_path):
        assert sum(len(frames) > 1 for frames in want.values()) > 500


async def test_a_tenants_own_supplement_gives_the_tenant_lines_whoever_asked_first(
        start_symgate: SymgateFactory, dwz_upstream: tuple[Debuginfod, Path], dwz_set: DwzSet,
        tmp_path: Path) -> None:
    """The shared upstream serves the dwz'd debug files, only a tenant's own serves their
    supplementary file. Had a profile without a tenant cached the debug files first, the
    tenant's profiles never got the lines: its supplement was refused for the shared table
    (rightly: others see it) and nothing else was built. Its table is now the tenant's own;
    others still get the shared table without lines."""
    upstream, _served = dwz_upstream
    own = tmp_path / "own"
    (own / "served").mkdir(parents=True)
    shutil.copyfile(dwz_set.common, own / "served" / dwz_set.common.name)
    body = _profile(dwz_set)
    want, _r = await asyncio.to_thread(
        symbolize_bytes, body, [_tree(tmp_path / "orig", dwz_set, originals=True, common=False)],
        LIMITS)
    with running_debuginfod(own / "served", own, "-t", "1", "-g", "0") as tenants:
        for p in dwz_set.programs:
            await eventually(lambda p=p: serves(
                f"{upstream.url}/buildid/{p.build_id}/debuginfo"))
        await eventually(lambda: serves(f"{tenants.url}/buildid/{dwz_set.common_id}/debuginfo"))
        sg = await start_symgate([upstream.url], symbolize=SymbolizeConfig(build_workers=1),
                                 negative=NegativeConfig(not_found_initial_ttl_s=1,
                                                         not_found_ttl_s=1),
                                 tenants={"acme": TenantConfig(upstreams=(tenants.url,))})

        async def symbolized(tenant: str) -> bytes:
            headers = {"Content-Type": "application/octet-stream"}
            if tenant:
                headers["X-Scope-OrgID"] = tenant
            status, _h, answer = await sg.request("POST", "/symbolize", data=body,
                                                  headers=headers)
            assert status == 200
            return answer

        bare = await symbolized("")
        assert bare != want

        async def tenant_has_lines() -> bool:
            return await symbolized("acme") == want

        await eventually(tenant_has_lines)
        assert await symbolized("") == bare


def test_a_damaged_supplement_of_the_linked_build_id_names_alone(
        dwz_set: DwzSet, tmp_path: Path) -> None:
    """A supplementary file with the linked build ID whose DWARF is not what dwz wrote (its
    .debug_info zeroed or garbled: damaged, cut short, forged) resolved none of the debug
    file's references: its inline functions were dropped and their lines put in their
    callers', whose frames then named another function's file."""
    from symbolize.elf_headers import read_headers

    p = dwz_set.programs[0]
    with dwz_set.common.open("rb") as f:
        headers = read_headers(f.fileno())
        assert headers is not None
        info = headers.section(".debug_info")
        assert info is not None
    raw = dwz_set.common.read_bytes()
    zeroed = tmp_path / "zeroed.debug"
    zeroed.write_bytes(raw[:info.offset] + bytes(info.size) + raw[info.offset + info.size:])
    assert build_id_of_file(zeroed) == dwz_set.common_id
    _lines, bare = _frames(p.debug, p, None, tmp_path / "bare")
    lines, got = _frames(p.debug, p, zeroed, tmp_path / "zeroed")
    assert not lines
    assert got == bare
