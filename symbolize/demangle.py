"""Human-readable names from symbol-table names: Itanium C++ (via libstdc++'s own demangler,
the one c++filt uses) and Rust (legacy and v0)."""

from __future__ import annotations

import re
from functools import lru_cache

import cxxfilt
import rust_demangler

# Where rust_demangler's v0 printer strays from rustc-demangle's (and llvm's, and Rust's own
# backtraces'): a nameless closure or shim as `{closure:#0}` for `{closure#0}`, and an ABI as
# `extern "C-"fn(` (`"C-unwind-"` for C-unwind) for `extern "C" fn(`.
_NAMELESS = re.compile(r"\{(closure|shim|[A-Za-z]):#(\d+)\}")
_ABI = re.compile(r'extern "([^"]*)-"fn\(')


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
