"""Who a request is for: X-Scope-OrgID, checked against bearer tokens where a tenant has them,
and the RequestScope that follows (its scope and sources).

X-Scope-OrgID is trusted as a gateway set it, as in Grafana's stack. A site without such a
gateway gives its tenants tokens; a request then proves its tenant with `Authorization: Bearer
TOKEN`, and a tenant with tokens cannot be named without one.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

from aiohttp import web

from proxy.artifacts.scope import SHARED, RequestScope
from proxy.config import MAX_TENANT, Config, TenantConfig
from proxy.errors import Forbidden, InvalidRequest, Unauthorized
from proxy.sources.base import Hop, Source


class Tenancy:
    def __init__(self, config: Config, shared: Sequence[Source],
                 private: Mapping[str, Sequence[Source]]) -> None:
        self._tenants = config.tenants
        self._shared = tuple(shared)
        self._private = {name: tuple(sources) for name, sources in private.items()}
        self._tokens = [(token.encode(), name) for name, t in config.tenants.items()
                        for token in t.tokens]
        self._needs_token = {name for name, t in config.tenants.items() if t.tokens}
        self._admin_tokens = [token.encode() for token in config.upload.admin_tokens]

    @property
    def shared_sources(self) -> tuple[Source, ...]:
        return self._shared

    @property
    def anonymous_allowed(self) -> bool:
        """Whether a request that names no tenant and shows no token is served, as the shared
        scope's: not where the nameless tenant ([tenants.""]) has tokens of its own."""
        return "" not in self._needs_token

    def settings(self, tenant: str) -> TenantConfig | None:
        return self._tenants.get(tenant)

    def tenant_of(self, request: web.BaseRequest) -> str:
        """The tenant the request is for, "" for none; Unauthorized, InvalidRequest."""
        if not self._tokens and "X-Scope-OrgID" not in request.headers:
            return ""  # the common case of a site without tenants, at no cost
        claimed = _claimed(request)
        if self._tokens and (token := _bearer(request)):
            if self._is_admin(token):
                return claimed  # an admin may act for any tenant
            return self._owner(token, claimed)
        if claimed in self._needs_token:
            raise Unauthorized(f"tenant {claimed!r} needs its bearer token")
        if claimed not in self._tenants and not self.anonymous_allowed:
            # A name no config lists proves nothing: where requests naming no tenant need a
            # token, one naming any unlisted tenant passed as that tenant, into the shared
            # scope and its upstreams (the egress the tokens were to close), with a header
            # any client can send.
            raise Unauthorized(f"tenant {claimed!r} is not configured, and requests without "
                               "a token are refused here ([tenants.\"\"] tokens)")
        return claimed

    def uploader(self, request: web.BaseRequest) -> str:
        """The scope an upload (or its deletion) acts on: its token's tenant, or with an
        admin token the tenant X-Scope-OrgID names, else the shared scope. Unauthorized
        without a token: X-Scope-OrgID alone proves nothing to write with. Forbidden with
        the nameless tenant's: its scope is the shared one, which every tenant sees."""
        token = _bearer(request)
        if not token:
            raise Unauthorized("uploads need a tenant's or an admin's bearer token")
        claimed = _claimed(request)
        if self._is_admin(token):
            return claimed
        owner = self._owner(token, claimed)
        if owner == SHARED:
            # A token that lets requests naming no tenant in is a reader's: what it wrote
            # would answer every tenant, before a tenant's own private server is asked.
            raise Forbidden("the nameless tenant's token does not upload: the shared scope "
                            "takes an admin's token ([upload] admin_tokens)")
        return owner

    def _owner(self, token: str, claimed: str) -> str:
        owner = self._owner_of(token)
        if owner is None:
            raise Unauthorized("unknown bearer token")
        if claimed and claimed != owner:
            raise Unauthorized("the bearer token is not X-Scope-OrgID's")
        return owner

    def _is_admin(self, token: str) -> bool:
        given = _as_sent(token)
        # Every one compared, in constant time, as for tenants' tokens.
        return sum(hmac.compare_digest(given, admin) for admin in self._admin_tokens) > 0

    def _owner_of(self, token: str) -> str | None:
        """Compared with every token, in constant time: a mismatch tells nothing of where."""
        given = _as_sent(token)
        owner: str | None = None
        for candidate, name in self._tokens:
            if hmac.compare_digest(given, candidate):
                owner = name
        return owner

    def scope(self, tenant: str, hop: Hop, may_fetch: bool = True
              ) -> RequestScope:
        own = self._private.get(tenant)
        if own is None:
            return RequestScope(tenant, SHARED, self._shared, hop, may_fetch)
        # A list of global sources only keeps the shared scope: one fetch serves everyone.
        scope = tenant if any(s.scope == tenant for s in own) else SHARED
        return RequestScope(tenant, scope, own, hop, may_fetch)


def _claimed(request: web.BaseRequest) -> str:
    """The tenant X-Scope-OrgID names, "" for none; InvalidRequest for a bad one."""
    given = request.headers.getall("X-Scope-OrgID", [])
    if len(given) > 1:  # a gateway that appends rather than replaces: trust neither
        raise InvalidRequest("more than one X-Scope-OrgID")
    # Only the blanks HTTP allows around a field's value (RFC 9110's OWS), which aiohttp has
    # taken off already: str.strip() also took Unicode spaces and separators (U+00A0, U+3000,
    # U+2028, U+0085, ...) off either end, so "acme\u3000", a name a gateway sets for another
    # tenant, was served as "acme", its private files and all.
    claimed = given[0].strip(" \t") if given else ""
    if len(claimed) > MAX_TENANT or any(ord(c) < 0x20 or c == "\x7f" for c in claimed) \
            or not _is_utf8(claimed):
        # Bytes that are not UTF-8 (kept by aiohttp as surrogate escapes) name no tenant a
        # config can have, and a scope of them can be neither hashed nor stored.
        raise InvalidRequest("invalid X-Scope-OrgID")
    return claimed


def _as_sent(value: str) -> bytes:
    """A header's value as the client sent it: aiohttp decodes header bytes as UTF-8, and
    keeps those that are not as surrogate escapes, which plain encode() refuses."""
    return value.encode("utf-8", "surrogateescape")


def _is_utf8(value: str) -> bool:
    try:
        value.encode()
    except UnicodeEncodeError:  # surrogate escapes: bytes that were not UTF-8
        return False
    return True


def _bearer(request: web.BaseRequest) -> str:
    given = request.headers.getall("Authorization", [])
    if len(given) > 1:  # one field (RFC 9110): a proxy in front may have read the other
        raise InvalidRequest("more than one Authorization")
    scheme, _, token = (given[0] if given else "").partition(" ")
    # HTTP's blanks only, as for X-Scope-OrgID (_claimed): str.strip() took Unicode spaces
    # off too, and a token sent with one was taken for the token without it.
    return token.strip(" \t") if scheme.lower() == "bearer" else ""
