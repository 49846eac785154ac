"""/metadata (elfutils 0.192): which ELF files are known by a name, a glob or a build ID.

Answered from what symgate holds (its cache, its uploads, its local directories) and merged
with its upstreams' answers the way a federating elfutils debuginfod merges them: every
source's "results" together, and "complete" only when every upstream answered completely. An
upstream that fails, or is too old to know /metadata, leaves the answer incomplete, not failed.

symgate knows a cached file by the X-DEBUGINFOD-FILE its upstream sent, a base name: a `file`
or `glob` value that is a path is also matched by its last component against those.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import logging
import posixpath
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlencode

import aiohttp

from proxy.artifacts.scope import RequestScope
from proxy.errors import InvalidRequest, SymgateError
from proxy.headers import printable
from proxy.keys import Kind, normalize_build_id
from proxy.sources.base import Hop
from proxy.sources.debuginfod import Upstream
from proxy.sources.localdir import LocalDirectory
from proxy.store.repository import DATABASE_ERRORS, Repository

log = logging.getLogger(__name__)
KEYS = ("file", "glob", "buildid")
MAX_VALUE = 4096  # PATH_MAX: no file name a client could mean is longer
# An upstream's answer past this many bytes is not read: the answer is then incomplete.
MAX_UPSTREAM_BYTES = 16 * 1024 * 1024
# Results kept from all sources together; past it the answer says it is incomplete.
MAX_RESULTS = 100_000
_RESULT_FIELDS = ("type", "buildid", "file", "archive")
_TYPE = re.compile(r"[a-z_]{1,32}")


@dataclass(frozen=True, slots=True)
class MetadataQuery:
    key: str
    value: str
    # A glob, and its last component, compiled once (compiled()). Not by fnmatch, which keeps
    # every pattern it compiles in a cache of 32,768: a client's 4 KiB glob compiles to
    # ~125 KB, so distinct globs grew a process by up to 4 GB. re's own cache keeps 512.
    globs: tuple[re.Pattern[str], ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def parse(cls, key: str | None, value: str | None) -> MetadataQuery:
        if key not in KEYS:
            raise InvalidRequest(f"metadata key must be one of {', '.join(KEYS)}")
        if not value:
            raise InvalidRequest("metadata value missing")
        if len(value) > MAX_VALUE or any(ord(c) < 0x20 or c == "\x7f" for c in value):
            raise InvalidRequest("invalid metadata value")
        if key == "buildid":
            value = normalize_build_id(value)
        return cls(key, value)

    def compiled(self) -> MetadataQuery:
        """This query, its glob compiled: tens of ms for a long one, so not on the loop."""
        if self.key != "glob" or self.globs:
            return self
        return replace(self, globs=(re.compile(fnmatch.translate(self.value)), re.compile(
            fnmatch.translate(posixpath.basename(self.value)))))

    @property
    def query_string(self) -> str:
        return urlencode({"key": self.key, "value": self.value})

    def matches(self, name: str) -> bool:
        """Whether a file known by `name` (a path, or a base name) answers the query."""
        if self.key == "glob":
            whole, last = self.globs or self.compiled().globs
            return whole.match(name) is not None or (
                "/" not in name and last.match(name) is not None)
        return name == self.value or ("/" not in name and name == posixpath.basename(self.value))


Result = dict[str, str]


@dataclass(frozen=True, slots=True)
class Answer:
    results: list[Result]
    complete: bool

    def as_json(self) -> dict[str, Any]:
        return {"results": self.results, "complete": self.complete}


class Catalogue:
    def __init__(self, repo: Repository, local_dirs: Sequence[LocalDirectory]) -> None:
        self._repo = repo
        self._local_dirs = tuple(local_dirs)
        # A file or glob query walks every entry of a local directory (0.1-0.2 s for 100,000),
        # and a glob is compiled first (up to ~60 ms): off the event loop, and one walk or
        # compile at a time, so that a flood of them takes neither
        # the loop nor the default executor's few threads (cached files' stat and open, uploads)
        # from other requests.
        self._walk = asyncio.Semaphore(1)

    async def find(self, query: MetadataQuery, req: RequestScope) -> Answer:
        if query.key == "glob":
            async with self._walk:  # a flood of long globs takes one thread, as walks do
                query = await asyncio.to_thread(query.compiled)
        upstreams = [s for s in req.sources if isinstance(s, Upstream)] if req.may_fetch else []
        own, *theirs = await asyncio.gather(
            self._own(query, req), *(_ask(u, query, req.hop) for u in upstreams))
        results: dict[tuple[str, ...], Result] = {}
        complete = req.may_fetch and own is not None
        for found in (own, *theirs):
            if found is None:
                complete = False
                continue
            answered, whole = found
            complete = complete and whole
            for result in answered:
                results.setdefault(tuple(result.get(f, "") for f in _RESULT_FIELDS), result)
                if len(results) >= MAX_RESULTS:
                    return Answer(list(results.values()), False)
        return Answer(list(results.values()), complete)

    async def _own(self, query: MetadataQuery, req: RequestScope
                   ) -> tuple[list[Result], bool] | None:
        """What symgate holds itself; None when SQL cannot be asked (then incomplete)."""
        out: list[Result] = []
        whole = True
        for local in self._local_dirs:
            if local not in req.sources:
                continue
            if query.key == "buildid":
                found = local.with_build_id(query.value)
            else:
                async with self._walk:
                    found = await asyncio.to_thread(_matching, local, query)
            # A path is what the directory holds: bytes that are not UTF-8 (a lone surrogate,
            # which JSON readers refuse or mangle) or a newline in a name are left out, as an
            # upstream's such entries are (_valid), and the answer is incomplete.
            shown = [(build_id, kind, path) for build_id, kind, path in found
                     if printable(path, MAX_VALUE) is not None]
            whole = whole and len(shown) == len(found)
            out += [{"type": str(kind), "buildid": build_id, "file": path}
                    for build_id, kind, path in shown]
        names: Sequence[str] = ()
        if query.key == "file":
            names = [query.value, posixpath.basename(query.value)]
        try:
            rows = await self._repo.named(
                req.visible, build_id=query.value if query.key == "buildid" else None,
                filenames=names)
        except DATABASE_ERRORS as e:
            log.warning("metadata: SQL failed: %s", e)
            return None
        for rec in rows:
            if query.key == "buildid" or query.matches(rec.filename):
                result = {"type": rec.kind, "buildid": rec.build_id, "file": rec.filename}
                if rec.archive:
                    result["archive"] = rec.archive
                out.append(result)
        return out, whole


def _matching(local: LocalDirectory, query: MetadataQuery) -> list[tuple[str, Kind, str]]:
    return [entry for entry in local.catalogue() if query.matches(entry[2])]


async def _ask(upstream: Upstream, query: MetadataQuery, hop: Hop
               ) -> tuple[list[Result], bool] | None:
    """An upstream's results and whether it called them complete; None when it gave no usable
    answer (failed, timed out, too old for /metadata, not JSON, too large)."""
    try:
        response = await upstream.query(f"/metadata?{query.query_string}", hop)
    except SymgateError as e:
        log.info("metadata: %s", e.reason)
        return None
    try:
        if response.status != 200:
            log.info("metadata: %s answered %d", upstream.name, response.status)
            return None
        body = bytearray()
        idle = upstream.cfg.read_timeout_s or None
        # No bound of its own: the upstream's total_timeout_s from the query's start ends
        # this read too (Upstream.query), so one that sends a byte within every
        # read_timeout_s, or its headers late, cannot hold the client's query past it.
        while chunk := await _read(response, idle):
            body += chunk
            if len(body) > MAX_UPSTREAM_BYTES:
                log.warning("metadata: %s answered more than %d bytes; not read",
                            upstream.name, MAX_UPSTREAM_BYTES)
                return None
    except (TimeoutError, OSError) as e:
        log.info("metadata: %s stopped answering: %s", upstream.name, type(e).__name__)
        return None
    except aiohttp.ClientError as e:  # a body cut off
        log.info("metadata: %s: %s", upstream.name, type(e).__name__)
        return None
    finally:
        response.release()
    if len(body) <= _PARSED_ON_THE_LOOP:
        return _parse(bytes(body), upstream.name)
    # Up to MAX_UPSTREAM_BYTES of JSON, parsed and checked entry by entry: 0.8 s for 16 MB,
    # which held every other request of the process.
    return await asyncio.to_thread(_parse, bytes(body), upstream.name)


# An answer this small is parsed at once: a thread costs more than its parse.
_PARSED_ON_THE_LOOP = 64 * 1024


async def _read(response: aiohttp.ClientResponse, idle: float | None) -> bytes:
    async with asyncio.timeout(idle):
        return await response.content.read(256 * 1024)


def _parse(body: bytes, name: str) -> tuple[list[Result], bool] | None:
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        log.info("metadata: %s did not answer JSON", name)
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        log.info("metadata: %s answered JSON without results", name)
        return None
    results = list(_valid(doc["results"]))
    whole = doc.get("complete") is True and len(results) == len(doc["results"])
    return results, whole


def _valid(results: Iterable[object]) -> Iterable[Result]:
    """Entries with the fields a client reads, as strings of sane size; others dropped (and
    the answer counted incomplete): what an upstream says reaches every client."""
    for r in results:
        if not isinstance(r, dict):
            continue
        # printable(), as a local directory's names and a cached file's X-DEBUGINFOD-FILE are
        # judged: str.isprintable() also dropped names those are listed by (a no-break space,
        # a soft hyphen, an emoji's zero width joiner), and the answer with them.
        kept = {f: r[f] for f in _RESULT_FIELDS if isinstance(r.get(f), str)
                and printable(r[f], MAX_VALUE)}
        if "type" not in kept or "buildid" not in kept or "file" not in kept:
            continue
        if not _TYPE.fullmatch(kept["type"]):
            continue
        try:
            kept["buildid"] = normalize_build_id(kept["buildid"])
        except InvalidRequest:
            continue
        yield kept
