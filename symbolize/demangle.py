"""Human-readable names from symbol-table names: Itanium C++ (via libstdc++'s own demangler,
the one c++filt uses) and Rust (legacy and v0)."""

from __future__ import annotations

from functools import lru_cache

import cxxfilt
import rust_demangler


@lru_cache(maxsize=65536)
def demangle(name: str, lang: str = "") -> str:
    """The demangled name, or `name` itself when it is not mangled (C, or unknown schemes)."""
    if name.startswith("_R") or (lang == "rust" and name.startswith("_ZN")):
        try:
            return str(rust_demangler.demangle(name))
        except Exception:  # the library raises bare Exceptions on names it cannot parse
            pass
    if name.startswith("_Z"):
        try:
            return str(cxxfilt.demangle(name, external_only=False))
        except cxxfilt.InvalidName:
            return name
    return name
