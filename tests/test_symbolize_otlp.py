"""POST /symbolize/otlp: OpenTelemetry profiles (ExportProfilesServiceRequest) made from live
processes, as the eBPF profiler reports them (ELF virtual addresses, build IDs as mapping
attributes) and with runtime addresses, symbolized by the pprof pipeline and scored against
llvm-symbolizer. Everything that is not a native frame's lines comes back as it was sent."""

from __future__ import annotations

import gzip
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.proto.collector.profiles.v1development.profiles_service_pb2 import (
    ExportProfilesServiceRequest,
)
from opentelemetry.proto.profiles.v1development.profiles_pb2 import (
    ProfilesDictionary,
)

from symbolize.elf import LoadSegment, layout_of_file
from tests.elfs import ElfSet
from tests.harness import Debuginfod, Symgate, SymgateFactory
from tests.libc import LIBC, LIBC_DEBUG, LIBC_ID, libc_functions
from tests.profiles import Expected, code_addresses, llvm_symbolize, symbol_aliases
from tests.symbolize_helpers import peak_rss, reset_peak_rss, same_frames, symbolize_config

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def _text(path: Path) -> LoadSegment:
    layout = layout_of_file(path)
    assert layout is not None
    return next(s for s in layout.segments if s.executable)


def _maps(pid: int, name: str) -> tuple[int, int, int]:
    """(start, end, file offset) of the executable mapping of `name` in live process `pid`."""
    for _ in range(500):
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if " r-xp " in line and line.rstrip().endswith(name):
                addresses, _perms, offset = line.split()[:3]
                start, end = (int(a, 16) for a in addresses.split("-"))
                return start, end, int(offset, 16)
        subprocess.run(["sleep", "0.01"], check=True)
    raise AssertionError(f"{name} is not mapped in {pid}")


@pytest.fixture
def live_prog(elfs: ElfSet) -> Iterator[dict[str, tuple[int, int, int]]]:
    """The gcc-built program, running: where it and libc are mapped."""
    proc = subprocess.Popen([str(elfs.prog.executable), "2000000000"], stdout=subprocess.DEVNULL)
    try:
        yield {"prog": _maps(proc.pid, "/" + elfs.prog.executable.name),
               "libc": _maps(proc.pid, "libc.so.6")}
    finally:
        proc.kill()
        proc.wait()


class Builder:
    """An ExportProfilesServiceRequest as the OpenTelemetry eBPF profiler sends one."""

    def __init__(self) -> None:
        self.request = ExportProfilesServiceRequest()
        self.d: ProfilesDictionary = self.request.dictionary
        for table in (self.d.mapping_table, self.d.location_table, self.d.function_table,
                      self.d.attribute_table, self.d.stack_table):
            table.add()  # entry 0 of every table is the empty one
        self.d.string_table.append("")
        self.stack: list[int] = []

    def string(self, s: str) -> int:
        self.d.string_table.append(s)
        return len(self.d.string_table) - 1

    def attribute(self, key: str, value: str) -> int:
        a = self.d.attribute_table.add(key_strindex=self.string(key))
        a.value.string_value = value
        return len(self.d.attribute_table) - 1

    def mapping(self, path: Path, build_id: str, where: tuple[int, int, int]) -> int:
        self.d.mapping_table.add(
            memory_start=where[0], memory_limit=where[1], file_offset=where[2],
            filename_strindex=self.string(str(path)),
            attribute_indices=[self.attribute("process.executable.build_id.gnu", build_id)])
        return len(self.d.mapping_table) - 1

    def location(self, mapping: int, address: int, frame_type: str = "native") -> int:
        self.d.location_table.add(mapping_index=mapping, address=address, attribute_indices=[
            self.attribute("profile.frame.type", frame_type)])
        self.stack.append(len(self.d.location_table) - 1)
        return self.stack[-1]

    def finish(self) -> ExportProfilesServiceRequest:
        self.d.stack_table.add(location_indices=self.stack)
        profile = self.request.resource_profiles.add().scope_profiles.add().profiles.add()
        profile.sample_type.type_strindex = self.string("samples")
        profile.sample_type.unit_strindex = self.string("count")
        profile.samples.add(stack_index=1, values=[7], timestamps_unix_nano=[123])
        return self.request


def _frames(r: ExportProfilesServiceRequest, index: int) -> list[Expected]:
    d = r.dictionary
    s = d.string_table
    functions = [d.function_table[ln.function_index] for ln in d.location_table[index].lines]
    return [Expected(s[f.name_strindex], s[f.system_name_strindex], s[f.filename_strindex],
                     ln.line, f.start_line)
            for f, ln in zip(functions, d.location_table[index].lines, strict=True)]


async def _post(sg: Symgate, body: bytes, **headers: str) -> tuple[int, dict[str, str], bytes]:
    return await sg.request("POST", "/symbolize/otlp", data=body, headers={**PROTOBUF, **headers})


@pytest.mark.parametrize("runtime", [False, True], ids=["elf-relative", "runtime-addresses"])
async def test_otlp_from_a_live_process_matches_llvm_symbolizer(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet,
    live_prog: dict[str, tuple[int, int, int]], runtime: bool,
) -> None:
    debug_dirs = (Path("/usr/lib/debug"),) if LIBC_DEBUG.exists() else ()
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(debug_dirs=debug_dirs))
    prog = elfs.prog
    b = Builder()
    placed = {"prog": (prog.executable, prog.build_id), "libc": (LIBC, LIBC_ID)}
    where = {name: b.mapping(path, bid, live_prog[name]) for name, (path, bid) in placed.items()}

    def address(name: str, vaddr: int) -> int:
        if not runtime:
            return vaddr  # as the eBPF profiler reports native frames
        start, _end, offset = live_prog[name]
        text = _text(placed[name][0])
        return start + vaddr - text.vaddr + text.offset - offset

    prog_vaddrs = code_addresses(prog)
    at = {v: b.location(where["prog"], address("prog", v)) for v in prog_vaddrs}
    libc_vaddrs = libc_functions(300) if LIBC_DEBUG.exists() else []
    libc_at = {v: b.location(where["libc"], address("libc", v)) for v in libc_vaddrs}
    python = b.location(0, 0, "python")
    fn = b.d.function_table.add(name_strindex=b.string("handler"),
                                filename_strindex=b.string("app.py"))
    b.d.location_table[python].lines.add(function_index=len(b.d.function_table) - 1, line=42)
    assert fn is not None
    sent = b.finish()
    status, headers, body = await _post(sg, gzip.compress(sent.SerializeToString()),
                                        **{"Content-Encoding": "gzip"})
    assert status == 200, body
    assert headers["X-Symgate-Symbolize"] == "symbolized"
    got = ExportProfilesServiceRequest.FromString(body)

    expected = llvm_symbolize(prog.debug, prog_vaddrs)
    assert len(expected) > 20
    wrong = [(hex(v), _frames(got, at[v]), want) for v, want in expected.items()
             if not same_frames(_frames(got, at[v]), want)]
    assert not wrong, wrong[:5]
    if libc_vaddrs:
        # As for pprof (test_symbolize_exactness): the outer frame is named after its DWARF
        # subprogram or an exported name (llvm's --functions=short), llvm after one of its
        # .symtab aliases; an inlined frame's linkage name, which llvm prints, is symgate's
        # system name.
        aliases = symbol_aliases(LIBC_DEBUG)
        dwarf = llvm_symbolize(LIBC_DEBUG, libc_vaddrs, functions="short")
        for v, want in llvm_symbolize(LIBC_DEBUG, libc_vaddrs).items():
            frames = _frames(got, libc_at[v])
            names = [f.function for f in frames]
            llvm = [f.function for f in want]
            assert [f.system_name for f in frames[:-1]] == [f.system_name for f in want[:-1]] \
                and names and (names[-1] in {llvm[-1], dwarf[v][-1].function}
                               or names[-1] in aliases.get(llvm[-1], set())), (
                hex(v), names, llvm)
    # What is not a native frame's lines is what was sent.
    assert _frames(got, python) == [Expected("handler", "", "app.py", 42)]
    assert got.resource_profiles == sent.resource_profiles
    assert got.dictionary.stack_table == sent.dictionary.stack_table
    assert got.dictionary.mapping_table == sent.dictionary.mapping_table
    assert got.dictionary.attribute_table == sent.dictionary.attribute_table
    assert got.dictionary.string_table[:len(sent.dictionary.string_table)] == \
        sent.dictionary.string_table
    assert [loc.address for loc in got.dictionary.location_table] == \
        [loc.address for loc in sent.dictionary.location_table]


async def test_an_otlp_request_with_nothing_to_fill_comes_back_byte_for_byte(
    start_symgate: SymgateFactory, elfs: ElfSet,
) -> None:
    sg = await start_symgate([], symbolize=symbolize_config())
    b = Builder()
    m = b.mapping(elfs.prog.executable, elfs.prog.build_id, (0x5500000000, 0x5500010000, 0))
    b.location(m, 0x1139)
    body = b.finish().SerializeToString()
    status, headers, out = await _post(sg, body)
    assert status == 200 and out == body
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "not_found=1"
    # On request, the frame is named by its file offset, as in pprof profiles.
    status, headers, out = await sg.request("POST", "/symbolize/otlp?fallback=module-offset",
                                            data=body, headers=PROTOBUF)
    assert status == 200 and headers["X-Symgate-Symbolize"] == "named"
    named = ExportProfilesServiceRequest.FromString(out)
    assert [f.function for f in _frames(named, 1)] == [f"{elfs.prog.executable.name}+0x1139"]


async def test_mappings_with_no_native_frame_to_fill_cost_no_fetch(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet,
) -> None:
    """A kernel mapping with a build ID, reached only by kernel frames: nothing to fetch."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    b = Builder()
    kernel = b.mapping(Path("/vmlinux"), elfs.other.build_id, (0, 0, 0))
    b.location(kernel, 0x1139, "kernel")
    body = b.finish().SerializeToString()
    status, headers, out = await _post(sg, body)
    assert status == 200 and out == body
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "has_functions=1"
    asked = {k: v for k, v in (await sg.metrics()).items()
             if k[0] == "symgate_upstream_requests_total"}
    assert asked and sum(asked.values()) == 0, asked


async def test_hostile_otlp_requests_get_their_precise_status(
    start_symgate: SymgateFactory, elfs: ElfSet,
) -> None:
    sg = await start_symgate([], symbolize=symbolize_config(max_profile_locations=3,
                                                            max_request_bytes=64 * 1024))
    assert (await _post(sg, bytes(64 * 1024 + 1)))[0] == 413
    b = Builder()
    m = b.mapping(elfs.prog.executable, elfs.prog.build_id, (0, 0, 0))
    for a in range(4):
        b.location(m, 0x1139 + a)
    too_many = b.finish().SerializeToString()
    assert (await _post(sg, too_many))[0] == 422
    assert (await _post(sg, b"\xff\xff\xff not protobuf"))[0] == 400
    assert (await _post(sg, b""))[0] == 400
    status, _, _ = await sg.request("POST", "/symbolize/otlp", data=b"{}",
                                    headers={"Content-Type": "application/json"})
    assert status == 415
    bad = Builder()
    bad.d.location_table.add(mapping_index=9, address=1)  # no such mapping
    assert (await _post(sg, bad.finish().SerializeToString()))[0] == 400
    worse = Builder()
    worse.d.mapping_table.add(filename_strindex=999)
    assert (await _post(sg, worse.finish().SerializeToString()))[0] == 400


def _empty_stacks(size: int) -> bytes:
    """A request whose dictionary is `size` bytes of empty Stack messages (two bytes each):
    a gzip of a few KiB, which protobuf makes millions of messages of."""
    stack_table = ProfilesDictionary.DESCRIPTOR.fields_by_name["stack_table"].number
    dictionary = ExportProfilesServiceRequest.DESCRIPTOR.fields_by_name["dictionary"].number
    stacks = bytes([stack_table << 3 | 2, 0]) * (size // 2)
    length = len(stacks)
    varint = bytearray()
    while length > 0x7F:
        varint.append(length & 0x7F | 0x80)
        length >>= 7
    varint.append(length)
    return bytes([dictionary << 3 | 2]) + bytes(varint) + stacks


async def test_a_request_of_millions_of_messages_is_decoded_in_a_worker_not_the_server(
    start_symgate: SymgateFactory,
) -> None:
    """The conversion to and from pprof ran in a thread of the serving process, and protobuf
    parses a request in C, holding the GIL: a 32 KiB gzip of 32 MiB of empty stacks held the
    event loop (every /buildid hit) for 2 s and took 0.5 GB of the server, 4 s and 1 GB for
    twice that; the default limit, 256 MiB, took 16 s and 4 GB, four requests at once 16.
    It runs in the worker processes, as a pprof profile's decoding does, within the memory
    its size allows (symbolize.parse_memory): millions of empty messages are a 422 there."""
    sg = await start_symgate([], symbolize=symbolize_config())
    body = _empty_stacks(32 << 20)
    gzipped = gzip.compress(body)
    assert len(gzipped) < 64 << 10
    reset_peak_rss()  # the server is this process (tests/harness.py)
    before = peak_rss(os.getpid())
    status, _, answer = await _post(sg, gzipped, **{"Content-Encoding": "gzip"})
    grown = peak_rss(os.getpid()) - before
    assert status == 422 and b"too many entries" in answer, answer
    # The body inflated: 32 MiB.
    assert grown < 160 << 20, grown


async def test_frames_named_by_a_fallback_are_symbolized_once_debug_info_exists(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path,
) -> None:
    """As for pprof: `libfoo.so+0x1a2b` names are no symbols. A request named before its debug
    info existed, sent again, comes back symbolized (it came back unchanged: the named frames
    had lines, so the mapping looked symbolized), and as it came while there is still none."""
    bare = await start_symgate([], symbolize=symbolize_config(), data_dir=tmp_path / "bare")
    b = Builder()
    m = b.mapping(elfs.prog.executable, elfs.prog.build_id, (0x5500000000, 0x5500010000, 0))
    vaddrs = code_addresses(elfs.prog)[:3]
    at = {v: b.location(m, v) for v in vaddrs}
    body = b.finish().SerializeToString()
    named_url = "/symbolize/otlp?fallback=module-offset"
    status, headers, named = await bare.request("POST", named_url, data=body, headers=PROTOBUF)
    assert status == 200 and headers["X-Symgate-Symbolize"] == "named"
    for url in (named_url, "/symbolize/otlp"):
        status, _, again = await bare.request("POST", url, data=named, headers=PROTOBUF)
        assert status == 200 and again == named, url
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(),
                             data_dir=tmp_path / "full")
    status, headers, out = await sg.request("POST", named_url, data=named, headers=PROTOBUF)
    assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", headers
    got = ExportProfilesServiceRequest.FromString(out)
    expected = llvm_symbolize(elfs.prog.debug, vaddrs)
    wrong = [(hex(v), _frames(got, at[v]), want) for v, want in expected.items()
             if not same_frames(_frames(got, at[v]), want)]
    assert not wrong, wrong


async def test_a_line_of_no_function_is_no_symbol(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet,
) -> None:
    """Go's runtime/pprof writes a PC it cannot name (cgo's C code) as a line of a nameless
    function, which pprof-to-OTLP converters dedupe to entry 0 of the function table: such a
    frame was left as it came, where the same pprof profile's is symbolized."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    b = Builder()
    m = b.mapping(elfs.prog.executable, elfs.prog.build_id, (0, 0, 0))
    vaddr = code_addresses(elfs.prog)[0]
    go = b.location(m, vaddr)
    b.d.location_table[go].lines.add(function_index=0)
    status, headers, out = await _post(sg, b.finish().SerializeToString())
    assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", headers
    got = ExportProfilesServiceRequest.FromString(out)
    want = llvm_symbolize(elfs.prog.debug, [vaddr])[vaddr]
    assert same_frames(_frames(got, go), want), (_frames(got, go), want)
