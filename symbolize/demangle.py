"""Human-readable names from symbol-table names: Itanium C++ (via libstdc++'s own demangler,
the one c++filt uses) and Rust (legacy and v0)."""

from __future__ import annotations

import re
from functools import lru_cache

import cxxfilt
import rust_demangler
from rust_demangler import rust_v0

# Where rust_demangler's v0 printer strays from rustc-demangle's (and llvm's, and Rust's own
# backtraces'): a nameless closure or shim as `{closure:#0}` for `{closure#0}`, and an ABI as
# `extern "C-"fn(` (`"C-unwind-"` for C-unwind) for `extern "C" fn(`.
_NAMELESS = re.compile(r"\{(closure|shim|[A-Za-z]):#(\d+)\}")
_ABI = re.compile(r'extern "([^"]*)-"fn\(')


def _print_lifetime_from_index(self: rust_v0.Printer, lt: int) -> None:
    """rustc-demangle's: a bound lifetime by its de Bruijn index, `'a` for the innermost.
    rust_demangler's took the innermost for invalid and printed a number for a letter, so
    every name with a higher-ranked type (`dyn for<'a> Fn(&'a T)`, in every program's std)
    was left mangled, and its failure printed to stdout (into a CLI's output)."""
    self.out += "'"
    if lt == 0:
        self.out += "_"
        return
    depth = self.bound_lifetime_depth - lt
    if depth < 0:
        self.invalid()
    elif depth < 26:
        self.out += chr(ord("a") + depth)
    else:
        self.out += "_" + str(depth)


def _invalid(self: rust_v0.Printer) -> None:
    """rust_demangler's, without its print() of the partial name to stdout."""
    self.out += "?"
    raise rust_v0.UnableTov0Demangle("Error")


rust_v0.Printer.print_lifetime_from_index = _print_lifetime_from_index
rust_v0.Printer.invalid = _invalid


@lru_cache(maxsize=65536)
def demangle(name: str, lang: str = "") -> str:
    """The demangled name, or `name` itself when it is not mangled (C, or unknown schemes)."""
    if name.startswith("_R") or (lang == "rust" and name.startswith("_ZN")):
        try:
            out = str(rust_demangler.demangle(name))
        except Exception:  # the library raises bare Exceptions on names it cannot parse
            pass
        else:
            if name.startswith("_R"):
                out = _ABI.sub(r'extern "\1" fn(', _NAMELESS.sub(r"{\1#\2}", out))
            return out
    if name.startswith("_Z"):
        try:
            return str(cxxfilt.demangle(name, external_only=False))
        except cxxfilt.InvalidName:
            return name
    return name
