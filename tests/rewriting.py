"""The rewrite run directly, with no server: symbol tables built from files, a profile's bytes
in, the rewritten profile and its report out."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from symbolize.chains import FunctionIds
from symbolize.pprof.codec import decode, encode
from symbolize.pprof.profile_pb2 import Profile
from symbolize.rewrite import MappingSymbols, Report, candidates, rewrite
from symbolize.symtab import BuildResult, SymbolTable


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
