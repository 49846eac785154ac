"""Who a request is for, and so what it may see and fetch: one object per request, handed
from the web layer to the artifact and symbol services instead of loose parameters.

The trust model: X-Scope-OrgID names the tenant, as in Grafana's stack, and is set by a
trusted gateway in front of symgate; a tenant configured with tokens must also present one of
them as a bearer token, for sites without such a gateway.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.sources.base import Hop, Source

# The scope of what every client may see: artifacts from the global sources and local debug
# directories, and the symbol tables built from them.
SHARED = ""


@dataclass(frozen=True, slots=True)
class RequestScope:
    tenant: str  # X-Scope-OrgID, "" for none
    # What this request's misses are keyed and its fetches are shared under: the tenant's name
    # when the tenant has sources of its own, else SHARED.
    scope: str
    sources: tuple[Source, ...]
    # What an upstream is told of the way the request came, and whether it may go upstream.
    hop: Hop
    may_fetch: bool = True

    @property
    def visible(self) -> tuple[str, ...]:
        """The scopes whose cached artifacts and tables answer this request, own first: the
        tenant's (what its own sources gave, and its uploads, even where it has no sources of
        its own), then the shared one."""
        return (self.tenant, SHARED) if self.tenant else (SHARED,)
