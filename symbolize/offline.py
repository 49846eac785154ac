"""Symbolizing a profile from local debug directories alone: `symgate symbolize --debug-dir`.

The same pipeline as the server's, with a provider that builds each table into a temporary
directory and looks for the executable only in the given directories, and the CPU-bound steps
in a thread rather than in worker processes.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .debugdirs import find_debug_file, find_executable
from .outcome import Outcome
from .pipeline import Limits, Resolved, symbolize_profile
from .rewrite import Report
from .supplementary import supplement_beside, supplement_link
from .symtab import MalformedObject, NoSymbols, TableSpec, build_symbol_table


class LocalDebugDirs:
    """A SymbolProvider over trees laid out like /usr/lib/debug."""

    def __init__(self, dirs: Sequence[Path], workdir: Path) -> None:
        self._dirs = tuple(dirs)
        self._workdir = workdir

    async def resolve(self, build_id: str, *, needs_layout: bool) -> Resolved:
        return await asyncio.to_thread(self._resolve, build_id, needs_layout)

    async def unreadable(self, build_id: str, table: TableSpec) -> None:
        pass  # built for this run alone: never given again

    def _resolve(self, build_id: str, needs_layout: bool) -> Resolved:
        exe = find_executable(self._dirs, build_id)
        source = find_debug_file(self._dirs, build_id) or exe
        if source is None:
            return Resolved(None, outcome=Outcome.NOT_FOUND)
        out = self._workdir / f"{build_id}.symc"
        try:
            built = build_symbol_table(source, out, build_id, exe, self._supplement(source))
        except NoSymbols:
            return Resolved(None, outcome=Outcome.NO_SYMBOLS)
        except MalformedObject:
            return Resolved(None, outcome=Outcome.MALFORMED)
        table = TableSpec(out, built.load_address, built.code_ranges, built.cold_ranges,
                          built.has_lines)
        # The executable's program headers when it was at hand (build_symbol_table read them).
        return Resolved(table, built.file_layout if needs_layout else None)

    def _supplement(self, debug_file: Path) -> Path | None:
        """The supplementary file that dwz gave `debug_file`: by its build ID in the debug
        directories, else where the link names it (`/usr/lib/debug/.dwz/<package>`, or beside
        the debug file), as gdb finds it."""
        link = supplement_link(debug_file)
        if link is None:
            return None
        if link.build_id and (found := find_debug_file(self._dirs, link.build_id)) is not None:
            return found
        return supplement_beside(debug_file, link)


def symbolize_bytes(body: bytes, dirs: Sequence[Path], limits: Limits) -> tuple[bytes, Report]:
    """The rewritten profile (or `body` itself when nothing was filled in) and its report."""
    with tempfile.TemporaryDirectory(prefix="symgate-") as tmp:
        done = asyncio.run(symbolize_profile(body, LocalDebugDirs(dirs, Path(tmp)), limits))
    return bytes(done.body), done.report
