"""A bound on the memory that parsing a client's protobuf bytes may take.

protobuf keeps an object for every entry of a repeated field, however small the entry is on
the wire: a profile of empty mappings (`\\x1a\\x00`, two bytes each) maps 85 bytes of memory
for every two of its own, and one of empty samples or strings 43. A 124 KB gzipped body that
inflated to 128 MB of empty mappings made a worker map 5 GB before its counts could be held
against the limits (the default 256 MiB inflated: 11 GB), and two such requests at once could
have the kernel's OOM killer end what it chose. Real profiles take far less for their size
(measured with RawProfile: 2.1x for a symbolized profile of a million locations and samples,
3.0x for two million functions; one-frame samples and bare locations, the densest a real
profile has, some 5-7x, but 12x mapped for 8.4 million one-frame samples of six bytes: a
repeated field's array grows by doubling, and the arrays it outgrew stay in protobuf's arena,
so that just past a power of two an entry maps some 72 bytes): a parse is allowed PARSE_FLOOR
and PARSE_PER_BYTE times its size, and refused past it (TooManyEntries, 422) instead of taking
the machine's memory. Empty entries, two bytes each, need 2-3 times what they are allowed,
and are refused.

The bound is the address space (RLIMIT_AS) of the process, lowered around the parse alone and
given back after it: protobuf's arena then fails its allocation, which it reports as a
DecodeError, and Python's own as a MemoryError. It binds every thread of the process, and what
another thread maps meanwhile is taken from the parse's share, to fail the one or the other:
so parses are bounded only in a process that says it runs nothing beside them (bound_parses):
the server's worker processes, one job at a time beside threads that allocate nothing of note
(proxy.symbols.worker_process's watcher and trimmer). The command-line tools' are not: their
table builds run in threads beside the check of the samples (pipeline.InThread), and a build of
libc's maps more than a small profile's share; their profiles are the user's own files.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from collections.abc import Iterator

PARSE_FLOOR = 64 << 20
PARSE_PER_BYTE = 12
# A parse into columns (codec.check_samples' MergedProfile): 8 bytes a value, in arrays that
# grow by doubling, 6-9 times the size of the densest real samples (10 million of one frame);
# a sample of a million one-byte location ids 27 times, refused past this.
COLUMNS_PER_BYTE = 16


def parse_budget(size: int, per_byte: int = PARSE_PER_BYTE) -> int:
    """The bytes of memory a parse of `size` bytes of protobuf may take."""
    return PARSE_FLOOR + per_byte * size


def mapped_bytes() -> int:
    """This process's mapped bytes (what RLIMIT_AS bounds); 0 where that cannot be told."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# One bounded parse at a time in a process: RLIMIT_AS is the process's, and two that overlapped
# would each give back the limit it found, so the later to end left the other's bound in place
# for good.
_one_at_a_time = threading.Lock()
_bounding = False


def bound_parses(on: bool = True) -> bool:
    """Bound this process's parses of clients' bytes from now on (or not); what was set
    before. For a process that runs nothing beside them (see the module's doc)."""
    global _bounding
    before, _bounding = _bounding, on
    return before


@contextlib.contextmanager
def mapping_at_most(extra: int) -> Iterator[None]:
    """Within the block, this process maps at most `extra` bytes more than it does at its
    start, where it bounds its parses (bound_parses); a lower bound already set (a build
    process's) stands. Nothing is bounded where the mapped size cannot be read (no /proc) or
    RLIMIT_AS cannot be set. Blocks of threads of one process run one at a time."""
    with _one_at_a_time:
        mapped = mapped_bytes() if _bounding else 0
        try:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        except (AttributeError, OSError, ValueError):
            mapped = 0  # no RLIMIT_AS here
        lowered = False
        try:
            # In the try: an exception raised between the setrlimit and the block (a
            # KeyboardInterrupt) gives the limit back too.
            if mapped:
                bound = mapped + extra
                for limit in (soft, hard):
                    if limit != resource.RLIM_INFINITY:
                        bound = min(bound, limit)
                if bound != soft:
                    with contextlib.suppress(OSError, ValueError):
                        lowered = True
                        resource.setrlimit(resource.RLIMIT_AS, (bound, hard))
            yield
        finally:
            if lowered:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
