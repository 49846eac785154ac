"""Symbolizing a profile from local debug directories alone: `symgate symbolize --debug-dir`."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

from .chains import FunctionIds
from .debugdirs import find_debug_file, find_executable
from .elf import LoadSegment, layout_of_file
from .pprof.codec import decode, encode
from .rewrite import MappingSymbols, Report, candidates, rewrite
from .symtab import MalformedObject, NoSymbols, SymbolTable, build_symbol_table


def _segments(dirs: Sequence[Path], build_id: str, table: SymbolTable) -> tuple[LoadSegment, ...]:
    exe = find_executable(dirs, build_id)
    layout = layout_of_file(exe) if exe else None
    if layout is not None and layout.has_file_layout and layout.build_id == build_id:
        return layout.segments
    return table.guessed_layout()


def symbolize_bytes(body: bytes, dirs: Sequence[Path], max_decompressed: int
                    ) -> tuple[bytes, Report]:
    """The rewritten profile (or `body` itself when nothing was filled in) and its report."""
    decoded = decode(body, max_decompressed)
    report = Report()
    wanted = candidates(decoded.profile, report)
    symbols: dict[str, MappingSymbols] = {}
    ids = FunctionIds()
    with tempfile.TemporaryDirectory(prefix="symgate-") as tmp:
        for build_id in sorted(set(wanted.values())):
            source = find_debug_file(dirs, build_id) or find_executable(dirs, build_id)
            if source is None:
                continue
            out = Path(tmp) / f"{build_id}.symc"
            try:
                built = build_symbol_table(source, out, build_id)
            except (NoSymbols, MalformedObject):
                continue
            table = SymbolTable(out, built.load_address, built.code_ranges, built.cold_ranges,
                                built.has_lines, ids)
            symbols[build_id] = MappingSymbols(table, _segments(dirs, build_id, table))
        for _mid, bid in wanted.items():
            if bid not in symbols:
                report.mappings_skipped["not_found"] += 1
        rewrite(decoded.profile, {m: b for m, b in wanted.items() if b in symbols}, symbols,
                ids, report)
    if not report.changed:
        return body, report
    return encode(decoded.profile, decoded.gzipped), report
