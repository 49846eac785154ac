"""Where an upstream's redirect may lead: its own origin, or a host the operator listed, and
never into a loopback, link-local or private network the upstream is not itself in.

symgate is a site's egress point; a redirect followed blindly would let any upstream (or
anyone who can answer for it) make symgate fetch, cache and serve internal pages (SSRF).
The decision is a pure function of the URLs and the addresses they resolve to, so the
address rule is the one that counts: a public name that resolves to 127.0.0.1 is loopback.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from yarl import URL

_DEFAULT_PORT = {"http": 80, "https": 443}
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_class(ip: IpAddress) -> str:
    """"public", or the kind of non-public range the address is in."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_link_local:
        return "link-local"
    if not ip.is_global or ip.is_multicast:
        return "private"
    return "public"


def origin(url: URL) -> tuple[str, str, int | None]:
    return (url.scheme, (url.host or "").lower(), url.port)


def _listed(url: URL, allowed_hosts: Iterable[str]) -> bool:
    default = _DEFAULT_PORT.get(url.scheme)
    for entry in allowed_hosts:
        listed = URL(f"//{entry}")  # "host", "host:port", "[v6]:port"
        if ((listed.host or "").lower() == (url.host or "").lower()
                and (listed.explicit_port or default) == url.port):
            return True
    return False


def refusal(base: URL, base_ips: Iterable[IpAddress], target: URL,
            target_ips: Iterable[IpAddress], allowed_hosts: Iterable[str]) -> str | None:
    """Why a redirect from the upstream at `base` to `target` may not be followed; None if it
    may. `base_ips` and `target_ips` are what the two hosts resolve to now."""
    if target.scheme not in _DEFAULT_PORT:
        return f"to a {target.scheme or 'relative'}: URL"
    if base.scheme == "https" and target.scheme != "https":
        return "from https to plain http"
    if not target.host:
        return "to a URL without a host"
    if origin(target) != origin(base) and not _listed(target, allowed_hosts):
        return "to another origin, not in the upstream's redirect_hosts"
    own = {address_class(ip) for ip in base_ips}
    for ip in target_ips:
        kind = address_class(ip)
        if kind != "public" and kind not in own:
            return f"to a {kind} address ({ip}) while the upstream is not on one"
    return None
