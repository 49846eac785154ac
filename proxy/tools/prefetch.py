"""`symgate prefetch`: warm a symgate's cache (and so its symbol tables) for build IDs given as
arguments, in a file, or found in a pprof profile."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from proxy import __version__
from proxy.tools.answers import failure
from symbolize.buildid import InvalidBuildId, normalize_build_id
from symbolize.pprof.codec import decode


@dataclass
class Summary:
    results: dict[str, dict[str, str]] = field(default_factory=dict)  # id -> kind -> status
    bytes: int = 0
    invalid: list[str] = field(default_factory=list)

    def counts(self) -> Counter[str]:
        return Counter(status for kinds in self.results.values() for status in kinds.values())


class IdFileError(ValueError):
    """A --file that cannot be a list of build IDs."""


def build_ids_from(args: Iterable[str], files: Iterable[Path], profiles: Iterable[Path],
                   max_decompressed: int, summary: Summary) -> list[str]:
    """Normalised, de-duplicated build IDs in the order given; invalid ones go to summary."""
    raw: list[str] = list(args)
    for f in files:
        try:
            text = f.read_text()
        except UnicodeDecodeError:  # a binary given for the list (the program itself)
            raise IdFileError(f"{f}: not a text file of build IDs") from None
        raw.extend(w for line in text.splitlines() for w in line.split("#", 1)[0].split())
    for p in profiles:
        prof = decode(p.read_bytes(), max_decompressed).profile
        raw.extend(prof.string_table[m.build_id] for m in prof.mapping
                   if m.build_id and not m.has_functions)
    seen: dict[str, None] = {}
    for r in raw:
        try:
            seen.setdefault(normalize_build_id(r), None)
        except InvalidBuildId:
            summary.invalid.append(r)
    return list(seen)


ELF_MAGIC = b"\x7fELF"

# What an artifact not done when the overall timeout came is reported as.
TIMED_OUT = "error: timed out"


async def prefetch(server: str, build_ids: list[str], kinds: Iterable[str], concurrency: int,
                   summary: Summary, progress: Callable[[int, int, Summary], None],
                   timeout_s: float) -> bool:
    """Fetch every kind of every build ID; False if `timeout_s` ran out first (what was not
    done is then TIMED_OUT): a server that accepts and never answers, or trickles, would
    otherwise hold the command for ever."""
    todo = [(b, k) for b in build_ids for k in kinds]
    done = 0
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(headers={"User-Agent": f"symgate-prefetch/{__version__}"},
                                     timeout=timeout) as session:
        async def one(build_id: str, kind: str) -> None:
            nonlocal done
            async with limit:
                status = "error"
                try:
                    async with session.get(f"{server.rstrip('/')}/buildid/{build_id}/{kind}") as r:
                        if r.status == 200 and not await _elf_follows(r):
                            # Another service (a login page, a catch-all 200): every artifact
                            # was counted cached, and the exit status said all was well.
                            status = f"error: 200 but no ELF file ({r.content_type})"
                        else:
                            summary.bytes += len(ELF_MAGIC) if r.status == 200 else 0
                            # Reading the body to the end is what makes the download
                            # complete. Only a file's bytes count: an error's text is nothing
                            # warmed.
                            async for chunk in r.content.iter_chunked(1 << 20):
                                if r.status == 200:
                                    summary.bytes += len(chunk)
                            status = str(r.status)
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    status = f"error: {failure(e)}"
            summary.results.setdefault(build_id, {})[kind] = status
            done += 1
            progress(done, len(todo), summary)

        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(one(b, k) for b, k in todo))
        except TimeoutError:
            for b, k in todo:
                summary.results.setdefault(b, {}).setdefault(k, TIMED_OUT)
            progress(len(todo), len(todo), summary)
            return False
    return True


async def _elf_follows(r: aiohttp.ClientResponse) -> bool:
    """Whether the body starts as every debuginfo and executable does (read from it)."""
    try:
        head = await r.content.readexactly(len(ELF_MAGIC))
    except asyncio.IncompleteReadError:
        return False
    return head == ELF_MAGIC


def terminal_progress(done: int, total: int, summary: Summary) -> None:
    c = summary.counts()
    progress_bar(done, total, f"ok={c['200']} missing={c['404']} "
                              f"failed={done - c['200'] - c['404']}  {summary.bytes / 1e6:.1f} MB")


def progress_bar(done: int, total: int, detail: str) -> None:
    """A one-line progress bar, redrawn in place; only on a terminal."""
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {detail}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
