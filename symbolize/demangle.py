"""Human-readable names from symbol-table names: Itanium C++ (via libstdc++'s own demangler,
the one c++filt uses) and Rust, legacy and v0 (via rustc-demangle, the Rust project's own
demangler, which Rust's backtraces and llvm-cxxfilt print alike)."""

from __future__ import annotations

import re
from functools import lru_cache

import cxxfilt
import pyderust

# A legacy Rust name is an Itanium one whose last part is its hash (`17h` and 16 hex digits),
# with no parameter types after its `E` (a C++ function's has them), and maybe LLVM's suffix.
_RUST_LEGACY = re.compile(r"_ZN.*17h[0-9a-f]{16}E(?:\.llvm\.\d+)?")


@lru_cache(maxsize=65536)
def demangle(name: str, lang: str = "") -> str:
    """The demangled name, or `name` itself when it is not mangled (C, or unknown schemes).

    `lang` "rust": the name is Rust's (its DWARF unit says so). A legacy name is known by its
    shape too: not every unit of a Rust program says so (std's, from an older rustc), and as
    C++ its escapes stay (`_$LT$$RF$$u5b$u8$u5d$...`)."""
    if name.startswith("_R") or (name.startswith("_ZN") and (
            lang == "rust" or _RUST_LEGACY.fullmatch(name) is not None)):
        try:
            # As llvm-symbolizer prints them: a legacy name with its hash (two monomorphic
            # copies of one generic function differ by it alone), a v0 name without its
            # crates' disambiguators (`object[4f4cc23e276cbdd5]::elf`).
            return str(pyderust.demangle(name, include_hash=name.startswith("_ZN")))
        except ValueError:  # pyderust.DemangleError
            pass  # not Rust's after all: a C++ name that began alike, or damaged
    if name.startswith("_Z"):
        try:
            return str(cxxfilt.demangle(name, external_only=False))
        except cxxfilt.InvalidName:
            return name
    return name
