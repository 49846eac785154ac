"""ELF and DWARF symbol tables, and pprof rewriting. Never imports `proxy`."""
