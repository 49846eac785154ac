"""What every source of artifacts offers the fetch path: an upstream debuginfod over HTTP
(proxy.upstream) or a local directory (proxy.localdir). A new kind of source is a new module."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from proxy import __version__
from proxy.headers import printable
from proxy.keys import ArtifactKey

USER_AGENT = f"symgate/{__version__}"
# A longer client User-Agent is not relayed upstream (elfutils' own is some 40 characters).
MAX_USER_AGENT = 256


@dataclass(frozen=True, slots=True)
class ArtifactMeta:
    """What the source said about the file before its bytes (response headers, for HTTP)."""

    upstream: str
    size: int | None  # uncompressed; None when the upstream streamed it without saying
    filename: str | None
    archive: str | None
    last_modified: str | None
    # X-DEBUGINFOD-IMASIGNATURE: kept with the file, so clients that enforce IMA work through
    # symgate on hits too.
    ima_signature: str | None = None
    # False: nothing tells the body's end (no size, length, chunks or compressed stream's end
    # marker), which is where the connection closes, and a cut there looks the same.
    framed: bool = True


@dataclass(frozen=True, slots=True)
class Hop:
    """What an upstream is told of the way a request came: the clients (X-Forwarded-For, as
    elfutils sends it) and the proxies it passed (Via, RFC 9110), so a loop of caches can be
    seen by the cache it comes back to."""

    forwarded_for: str = ""
    via: str = ""
    # The client's User-Agent as it came, relayed as a federating elfutils debuginfod does:
    # upstream operators count their users' tools by it. Checked only when it goes upstream.
    user_agent: str = ""

    def hops(self) -> int:
        """The hops X-Forwarded-For tells upstream: what elfutils' --forwarded-ttl-limit
        counts."""
        return sum(1 for h in self.forwarded_for.split(",") if h.strip())

    def headers(self) -> dict[str, str]:
        out = {"X-Forwarded-For": self.forwarded_for} if self.forwarded_for else {}
        out.update(self.loop_headers())
        if ua := printable(self.user_agent, MAX_USER_AGENT):
            out["User-Agent"] = f"{ua} {USER_AGENT}"
        return out

    def loop_headers(self) -> dict[str, str]:
        """Only what a loop of caches is seen by (Via): nothing of the client."""
        return {"Via": self.via} if self.via else {}


class Body(Protocol):
    """An artifact found, its bytes not yet read."""

    meta: ArtifactMeta

    def chunks(self) -> AsyncIterator[bytes]:
        """The bytes in order; UpstreamTimeout / UpstreamUnavailable when they stop short."""
        ...

    def close(self) -> None: ...


class Source(Protocol):
    name: str
    # How its metrics name it (proxy.metrics.upstream_label): /metrics is no tenant's.
    label: str
    # "" for a global source, whose artifacts every client may see; a tenant's name for one of
    # that tenant's own sources, whose artifacts only that tenant's requests see.
    scope: str
    # Whether this source's 404s are worth remembering in SQL (a remote round trip saved);
    # a local directory is asked again every time, so a file added to it is found at once.
    remembers_misses: bool

    async def open(self, key: ArtifactKey, hop: Hop) -> Body | None:
        """The artifact, or None when this source does not have it."""
        ...

    def has(self, key: ArtifactKey) -> bool | None:
        """Whether the source has the key, if it can tell without a round trip (else None)."""
        ...
