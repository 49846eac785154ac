"""`symgate inspect PROFILE`: why a profile's native frames are (or are not) symbolized.

One row per mapping: its file, address range and build ID, whether /symbolize would touch it,
whether each configured upstream and symgate's own cache has its debug info, and a verdict with
the fix, in the words of the common causes. For a tenant (--tenant), the sources its requests
use ([tenants.NAME] upstreams, else the global ones), its own view of the cache, and its
[tenants.NAME] symbolize setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import aiohttp
from prometheus_client import CollectorRegistry

from proxy import __version__
from proxy.config import Config, shown_url
from proxy.errors import UpstreamTimeout, UpstreamUnavailable
from proxy.keys import ArtifactKey, Kind
from proxy.metrics import ProxyMetrics
from proxy.sources.base import Hop
from proxy.sources.debuginfod import Sessions, Upstream, upstream_names
from proxy.sources.env_routes import EnvironmentRoutes
from proxy.sources.localdir import LocalDirectory
from proxy.tools.answers import not_from_symgate, one_line, said
from proxy.tools.text_table import render_table
from proxy.web.app import client_session
from symbolize.buildid import InvalidBuildId, normalize_build_id
from symbolize.pprof.codec import decode
from symbolize.rewrite import Report, candidates, sampled

USER_AGENT = f"symgate-inspect/{__version__}"
SERVER_CACHE = "symgate cache"


@dataclass
class Check:
    where: str  # an upstream URL, a local directory, or "symgate cache"
    status: str  # "200", "404", "timeout", "unreachable", "error...", "504" (not cached)
    size: int | None = None
    # Why it failed, in the server's words (a refused redirect, a reset): "" for an answer.
    reason: str = ""


@dataclass
class Row:
    mapping_id: int
    file: str
    memory_start: int
    memory_limit: int
    build_id: str | None
    has_functions: bool
    would_symbolize: bool
    checks: list[Check] = field(default_factory=list)
    verdict: str = ""
    # What the profile sent as a build ID and why it is none: "" where it sent none.
    invalid_build_id: str = ""
    invalid_reason: str = ""
    # A mapping /symbolize would take, but that no location of the profile lies in.
    no_locations: bool = False

    @property
    def range(self) -> str:
        return f"{self.memory_start:#x}-{self.memory_limit:#x}"


def _answered(where: str, r: aiohttp.ClientResponse) -> Check:
    size = r.headers.get("X-DEBUGINFOD-SIZE") or r.headers.get("Content-Length")
    known = r.status == 200 and size is not None and size.isdigit()
    return Check(where, str(r.status), int(size) if known and size else None)


async def _server_check(session: aiohttp.ClientSession, base: str, build_id: str,
                        timeout_s: float) -> Check:
    """symgate's own cache, asked with only-if-cached, so that inspecting fetches nothing."""
    url = f"{base.rstrip('/')}{ArtifactKey(build_id, Kind.DEBUGINFO).upstream_path}"
    try:
        # GET rather than HEAD: elfutils 0.188 answers HEAD with 400. Only the headers are read.
        # Not redirected: a login page it led to answered 200, and the verdict was
        # "available from symgate cache".
        async with asyncio.timeout(timeout_s), session.get(
                url, headers={"Cache-Control": "only-if-cached"}, allow_redirects=False) as r:
            if r.status == 200 and "X-DEBUGINFOD-FILE" not in r.headers:
                return Check(SERVER_CACHE, "error",
                             reason=not_from_symgate(r, "a debuginfod's answer"))
            if r.status in (200, 404, 504):
                return _answered(SERVER_CACHE, r)
            return Check(SERVER_CACHE, str(r.status), reason=f"answered {r.status}"
                                                             f"{await said(r)}")
    except TimeoutError:
        return Check(SERVER_CACHE, "timeout", reason=f"no answer within --timeout {timeout_s:g} s")
    except aiohttp.ClientConnectorError as e:
        return Check(SERVER_CACHE, "unreachable", reason=f"cannot connect: {e.os_error}")
    except (aiohttp.ClientError, OSError) as e:
        return Check(SERVER_CACHE, f"error: {type(e).__name__}",
                     reason=one_line(f"{type(e).__name__}: {e}")[:200])


def server_failures(rows: Sequence[Row]) -> list[Check]:
    """The checks of --server that had no answer from a symgate's cache."""
    return [c for r in rows for c in r.checks
            if c.where == SERVER_CACHE and c.status not in ("200", "404", "504")]


async def _upstream_check(upstream: Upstream, build_id: str, timeout_s: float) -> Check:
    """An upstream asked as the server asks it (proxy.sources.debuginfod): with its configured
    headers and URL credentials, the environment's proxy and netrc, and following only the
    redirects its redirect_hosts and max_redirects allow. Followed blindly, a redirect the
    server refuses made the verdict "available", and took the upstream's credentials to the
    host it named."""
    where = shown_url(upstream.cfg.url)  # printed: never the credentials the URL may hold
    path = ArtifactKey(build_id, Kind.DEBUGINFO).upstream_path
    try:
        async with asyncio.timeout(timeout_s):
            response = await upstream.query(path, Hop(user_agent=USER_AGENT))
        with contextlib.closing(response):  # only the headers are read
            return _answered(where, response)
    except (TimeoutError, UpstreamTimeout):
        return Check(where, "timeout")
    except UpstreamUnavailable as e:
        reason = e.reason.removeprefix(f"{upstream.name}: ")
        if isinstance(e.__cause__, aiohttp.ClientConnectorError):
            return Check(where, "unreachable", reason=reason)
        return Check(where, "error", reason=reason)


# A Go build ID (`go tool buildid`): two to four base64url hashes joined by slashes, which
# profilers that fall back on it send as is or hex-encoded.
_GO_BUILD_ID = re.compile(r"^[A-Za-z0-9_-]+(?:/[A-Za-z0-9_-]+){1,3}$")


def _is_go_build_id(raw: str) -> bool:
    text = raw.strip()
    with contextlib.suppress(ValueError):  # not hex, or not ASCII once decoded: as sent
        text = bytes.fromhex(text).decode("ascii")
    return bool(_GO_BUILD_ID.match(text))


def _local_check(local: LocalDirectory, key: ArtifactKey) -> Check:
    return Check(local.name, "200" if local.has(key) else "404")


def _verdict(row: Row, tenant: str, symbolizes: bool) -> str:
    if row.build_id is None and row.invalid_build_id:
        raw = row.invalid_build_id
        shown = raw if len(raw) <= 48 else raw[:45] + "..."
        said = (f"build ID {shown!r} is not a GNU build ID ({row.invalid_reason}): /symbolize "
                "skips this mapping")
        if _is_go_build_id(raw):
            return (f"{said}. It is a Go build ID (.note.go.buildid), which no debuginfod "
                    "server knows: link the Go program with a GNU build ID too "
                    "(go build -ldflags=-B=gobuildid, Go 1.20+, or -ldflags='-B 0x<hex>') "
                    "and check that the profiler sends that one")
        return f"{said}. Check what the profiler puts in Mapping.build_id"
    if row.build_id is None:
        if row.file.startswith("["):
            return (f"{row.file} is not a file on disk (kernel, vdso, anonymous memory): "
                    "there is no debug info to look up")
        return ("no build ID: the profiler did not record one. Link with -Wl,--build-id "
                "(gcc and clang do by default on most distributions) and check that the "
                "profiler reads build IDs")
    if row.has_functions:
        return ("HasFunctions is already true: the profiler symbolized this mapping itself, "
                "so /symbolize leaves it alone")
    if row.no_locations:
        return ("no location of the profile lies in it: /symbolize does not look it up "
                "(no_locations), as it has no address to fill in")
    if not row.would_symbolize:
        return ("the kernel's or a module's code: /symbolize leaves it alone (its addresses "
                "are the running kernel's, and its debug file hundreds of MB); have the "
                "profiler name kernel frames, as perf and the eBPF profilers do")
    if not symbolizes:
        return (f"[tenants.{json.dumps(tenant)}] symbolize = false: /symbolize returns this "
                "tenant's profiles unchanged")
    found = [c for c in row.checks if c.status == "200"]
    if found:
        c = found[0]
        size = f" ({c.size} bytes)" if c.size is not None else ""
        return f"debug info available from {c.where}{size}: /symbolize will fill this mapping in"
    failing = [c for c in row.checks if c.status not in ("404", "504")]
    if failing:
        names = ", ".join(f"{c.where} ({c.reason if c.status == 'error' else c.status})"
                          for c in failing)
        return (f"upstream unreachable: {names}. Check the network path, proxy and credentials "
                "(headers = { Authorization = ... }) of those upstreams")
    return ("debug info not on any upstream: install the package's -dbg/-debuginfo files, "
            "upload the .debug file to your debuginfod, or put it under a local directory "
            "source (.build-id/xx/rest.debug)")


async def inspect_profile(
    body: bytes, config: Config, *, server: str | None, timeout_s: float,
    max_decompressed: int, tenant: str = "", server_headers: Mapping[str, str] | None = None,
) -> list[Row]:
    """`tenant`: whose requests to judge, as X-Scope-OrgID names it ("" for none);
    `server_headers`: sent to `server` beside (the tenant's, its token)."""
    profile = decode(body, max_decompressed).profile
    strings = profile.string_table
    rows: list[Row] = []
    # The mappings /symbolize would take, by its own rule (a kernel's is left alone), and of
    # them those it looks up: one no location lies in is not (its scan's `sampled`).
    candidate = candidates(profile, Report())
    taken = sampled(profile, candidate)
    for m in profile.mapping:
        raw = strings[m.build_id] if m.build_id < len(strings) else ""
        reason = ""
        try:
            bid = normalize_build_id(raw) if raw else None
        except InvalidBuildId as e:
            bid, reason = None, str(e).removeprefix("invalid build ID: ")
        rows.append(Row(m.id, strings[m.filename] if m.filename < len(strings) else "",
                        m.memory_start, m.memory_limit, bid, m.has_functions, m.id in taken,
                        invalid_build_id=raw if reason else "", invalid_reason=reason,
                        no_locations=m.id in candidate and m.id not in taken))
    metrics = ProxyMetrics(CollectorRegistry())  # LocalDirectory counts; nobody reads them here
    settings = config.tenants.get(tenant)
    # A tenant with upstreams of its own is served by those instead of the global ones (the
    # server's proxy.web.app._sources), under the names the server gives them.
    own = settings.upstreams if settings is not None else ()
    listed = own or config.upstreams
    locals_ = [LocalDirectory(u.path, 0, metrics) for u in listed if u.path is not None]
    for local in locals_:
        await local.rescan()
    servers = [u for u in listed if u.url]
    names = upstream_names(servers, tenant) if own else upstream_names(servers)
    routes = EnvironmentRoutes()
    async with client_session(config, limit=0) as upstream_session, \
            aiohttp.ClientSession(headers={"User-Agent": USER_AGENT,
                                           **(server_headers or {})}) as session:
        sessions = Sessions(upstream_session, upstream_session)
        # Each a new Upstream, its breaker closed: a failure is shown, never skipped.
        remote = [Upstream(u, sessions, metrics, routes, name=name)
                  for u, name in zip(servers, names, strict=True)]

        async def checks(bid: str) -> list[Check]:
            key = ArtifactKey(bid, Kind.DEBUGINFO)
            tasks = [_upstream_check(upstream, bid, timeout_s) for upstream in remote]
            if server:
                tasks.append(_server_check(session, server, bid, timeout_s))
            asked = iter(await asyncio.gather(*tasks))
            local = iter(locals_)
            # In the order the sources are listed, which is the order the server asks them
            # in: the verdict names the first that has the file, as the one it is fetched from.
            found = [next(asked) if u.url else _local_check(next(local), key) for u in listed]
            found.extend(asked)  # the server's cache, last
            return found

        wanted = sorted({r.build_id for r in rows if r.would_symbolize and r.build_id})
        results = dict(zip(wanted, await asyncio.gather(*(checks(b) for b in wanted)),
                           strict=True))
    for row in rows:
        if row.would_symbolize and row.build_id:
            row.checks = results[row.build_id]
        row.verdict = _verdict(row, tenant, settings is None or settings.symbolize)
    return rows


def _size(n: int | None) -> str:
    if n is None:
        return ""
    value = float(n)
    for unit in ("B", "KB", "MB"):
        if value < 1000:
            return f" {value:.0f}{unit}" if unit == "B" else f" {value:.1f}{unit}"
        value /= 1000
    return f" {value:.1f}GB"


def render(rows: Sequence[Row]) -> str:
    """A table, one row a mapping, a column per place asked; then a verdict per mapping."""
    sources = next((r.checks for r in rows if r.checks), [])
    names = [f"[{i}]" for i in range(1, len(sources) + 1)]
    table = render_table(
        [[str(r.mapping_id), r.file or "-", r.range,
          r.build_id or ("invalid" if r.invalid_build_id else "none"),
          str(r.has_functions).lower(), "yes" if r.would_symbolize else "no",
          *([c.status + _size(c.size) for c in r.checks] or ["-"] * len(names))]
         for r in rows],
        ["ID", "FILE", "RANGE", "BUILD ID", "HAS_FUNCTIONS", "SYMBOLIZE", *names])
    parts = [table]
    if names:
        parts.append("\n".join(f"{n} {c.where}" for n, c in zip(names, sources, strict=True)))
    parts.append("verdicts:\n" + "\n".join(f"{r.mapping_id:>3}  {r.verdict}" for r in rows))
    return "\n\n".join(parts) + "\n"


def to_json(rows: Sequence[Row]) -> list[dict[str, object]]:
    return [{**asdict(r), "range": r.range} for r in rows]
