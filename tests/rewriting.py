"""The rewrite run directly, with no server: symbol tables built from files, a profile's bytes
in, the rewritten profile and its report out."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from symbolize.chains import FunctionIds
from symbolize.pprof.codec import decode, encode
from symbolize.pprof.profile_pb2 import Profile
from symbolize.rewrite import MappingSymbols, Report, candidates, rewrite
from symbolize.symtab import BuildResult, SymbolTable, build_symbol_table
from tests.elfs import Elf
from tests.profiles import Expected, code_addresses, frames_of


def open_table(path: Path, built: BuildResult, ids: FunctionIds) -> SymbolTable:
    """The table at `path`, as `build_symbol_table` described it when it wrote it."""
    return SymbolTable(path, built.load_address, built.code_ranges, built.cold_ranges,
                       built.has_lines, ids)


def run_rewrite(body: bytes, tables: Mapping[str, MappingSymbols], ids: FunctionIds
                ) -> tuple[Profile, Report]:
    """Symbolize every mapping of `body` whose build ID has a table, as /symbolize would."""
    decoded = decode(body, 1 << 30)
    report = Report()
    rewrite(decoded.profile, candidates(decoded.profile, report), tables, ids, report)
    return Profile.FromString(encode(decoded.profile, False)), report


def table_frames(source: Path, elf: Elf, work: Path, supplement: Path | None = None
                 ) -> tuple[bool, dict[int, list[Expected]]]:
    """The table of `elf` built from `source` (its debug file, or the executable itself),
    with `elf`'s executable beside and `supplement`: whether it has lines, and its frames at
    every instruction of .text (ELF-relative addresses)."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"{elf.name}-{source.parent.name}-{source.name}.symc"
    built = build_symbol_table(source, out, elf.build_id, elf.executable, supplement)
    profile = Profile()
    profile.string_table.extend(["", str(elf.executable), elf.build_id])
    profile.mapping.add(id=1, filename=1, build_id=2)
    for i, v in enumerate(code_addresses(elf), start=1):
        profile.location.add(id=i, mapping_id=1, address=v)
    ids = FunctionIds()
    rewritten = run_rewrite(profile.SerializeToString(),
                            {elf.build_id: MappingSymbols(open_table(out, built, ids), ())},
                            ids)[0]
    return built.has_lines, {loc.address: frames_of(rewritten, loc)
                             for loc in rewritten.location}
