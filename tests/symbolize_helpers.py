"""Asking a symgate server to symbolize a profile, and reading what comes back."""

from __future__ import annotations

import gzip
from dataclasses import replace
from pathlib import Path

from proxy.config import SymbolizeConfig
from symbolize.pprof.profile_pb2 import Profile
from tests.harness import Symgate
from tests.profiles import Expected

# Where a loader would put each kind of file: PIE and shared libraries anywhere, ET_EXEC at 0.
BASES = {"prog": 0x55D0C0DE0000, "nopie": 0, "libmix.so": 0x7F3A12340000, "cpp": 0x5612AB000000}


async def post(sg: Symgate, body: bytes, **headers: str) -> tuple[int, dict[str, str], bytes]:
    return await sg.request("POST", "/symbolize", data=body,
                            headers={"Content-Type": "application/octet-stream", **headers})


def parse(body: bytes) -> Profile:
    return Profile.FromString(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)


def symbolize_config(**kw: object) -> SymbolizeConfig:
    return replace(SymbolizeConfig(build_workers=1), **kw)  # type: ignore[arg-type]


def same_frames(got: list[Expected], want: list[Expected]) -> bool:
    """The same chain of functions, and of files and lines where there is DWARF.

    Names are compared demangled, except where llvm-symbolizer 14 could not demangle one (it
    then prints the raw name, which libstdc++'s demangler handles): there the raw names are.
    Raw names alone would differ where a symbol has aliases (GCC gives a destructor's one body
    both its D1 and D2 names; llvm takes the .symtab alias, symbolic the DWARF linkage name).
    For functions known only from .symtab (crt startup code) llvm-symbolizer takes a file
    name from the STT_FILE symbol, which symbolic does not; both report line 0. Start lines
    are compared where llvm-symbolizer knows one.
    """
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        demangled_by_llvm = w.function != w.system_name or not w.system_name.startswith("_Z")
        if (g.function if demangled_by_llvm else g.system_name) != w.function:
            return False
        if w.line and (g.file, g.line) != (w.file, w.line):
            return False
        if w.start_line and g.start_line != w.start_line:
            return False
    return True


def table_lock_file(sg: Symgate, build_id: str) -> Path:
    """The flock(2) file a build of `build_id`'s shared table holds (proxy.symbols.build_lock)."""
    return sg.config.server.data_dir / "symtabs" / build_id[:2] / f"{build_id}.symc.lock"


def peak_rss(pid: int) -> int:
    """VmHWM: the most memory the process ever held, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def reset_peak_rss(pid: int | str = "self") -> None:
    """VmHWM from now on (proc(5): clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
