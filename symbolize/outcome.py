"""What became of asking for one thing: an artifact, a symbol table, a mapping's symbols.

One vocabulary for every place that records or reports a result: the remembered-miss rows,
the symbol-table rows, /symbolize's per-mapping reasons and the metric labels. It lives here,
not in proxy/, because the symbolization pipeline reports it and must not import the server.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    OK = "ok"
    NOT_FOUND = "not_found"  # no source has it
    NO_SYMBOLS = "no_symbols"  # an ELF file with neither DWARF nor a symbol table
    MALFORMED = "malformed"  # bytes that are not what was asked for, or cannot be read
    TIMEOUT = "timeout"  # a source did not answer, or stopped sending, in time
    UPSTREAM_ERROR = "upstream_error"  # a source failed: connect error, reset, 5xx, breaker
    REJECTED = "rejected"  # the client's request was refused (bad input, over a limit)
    NOT_CACHED = "not_cached"  # Cache-Control: only-if-cached, and it is not
    DEADLINE = "deadline"  # the request's own time ran out first; the work goes on
    # The server's own trouble, which passes (a full disk, the database down, a worker process
    # gone, out of file descriptors): apart from `internal`, so that an operator's alert on
    # bugs is not set off by a full disk, nor a full disk hidden among bugs. Never remembered.
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"  # a bug or an unexpected failure: never remembered


# The `fallback` setting that names a location outside every symbol table by its module and
# offset (symbolize.fallback), and the count of such locations among a report's unresolved.
# Here, not there: the server reads them on every start, and symbolize.fallback brings numpy.
MODULE_OFFSET = "module-offset"
NAMED = "module_offset"


class TryAgain(Exception):
    """Not the thing's own outcome but the asker's trouble, which passes (its worker process
    died, its disk is full): a profile waiting on it is refused as a whole, to be sent again,
    rather than answered with that mapping bare (a backend keeps a 200 for good)."""
