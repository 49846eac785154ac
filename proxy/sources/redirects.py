"""Where an upstream's redirect may lead: its own origin, or a host the operator listed, and
never into a loopback, link-local or private network the upstream is not itself in.

symgate is a site's egress point; a redirect followed blindly would let any upstream (or
anyone who can answer for it) make symgate fetch, cache and serve internal pages (SSRF).
The decision is a pure function of the URLs and the addresses they resolve to, so the
address rule is the one that counts: a public name that resolves to 127.0.0.1 is loopback.

A name can answer differently each time it is asked (DNS rebinding), so checking a target's
addresses before the request is not enough: aiohttp resolves the name again to connect.
GuardedResolver applies the address rule to the answers aiohttp connects to.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Sequence

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from proxy.config import UpstreamConfig

_DEFAULT_PORT = {"http": 80, "https": 443}
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


# IPv6 ranges whose last 32 bits are an IPv4 address a connection ends up at: NAT64's
# well-known prefix (the site's translator connects there), SIIT's translated form and the
# deprecated IPv4-compatible one (ipaddress itself unwraps mapped and 6to4 addresses).
_CARRYING_IPV4 = tuple(ipaddress.IPv6Network(n) for n in (
    "64:ff9b::/96", "::ffff:0:0:0/96", "::/96"))
# Inside a site whatever the address: local-use NAT64 (its IPv4 placement varies by prefix
# length) and the deprecated site-local range, which this Python counts as global.
_SITE_IPV6 = tuple(ipaddress.IPv6Network(n) for n in ("64:ff9b:1::/48", "fec0::/10"))


def _stands_for(ip: IpAddress) -> IpAddress:
    """The IPv4 address an IPv6 one is a way to reach, or the address itself."""
    if not isinstance(ip, ipaddress.IPv6Address) or ip.is_loopback or ip.is_unspecified:
        return ip
    if (v4 := ip.ipv4_mapped or ip.sixtofour) is not None:
        return v4
    if any(ip in net for net in _CARRYING_IPV4):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def address_class(ip: IpAddress) -> str:
    """"public", or the kind of non-public range the address is in (for an IPv6 address that
    stands for an IPv4 one, the kind of that one)."""
    ip = _stands_for(ip)
    if isinstance(ip, ipaddress.IPv6Address) and any(ip in net for net in _SITE_IPV6):
        return "private"
    if ip.is_loopback:
        return "loopback"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_link_local:
        return "link-local"
    if not ip.is_global or ip.is_multicast:
        return "private"
    return "public"


def _parse(text: str) -> IpAddress:
    # Link-local IPv6 addresses come with a scope ("fe80::1%eth0").
    return ipaddress.ip_address(text.split("%")[0])


async def addresses(url: URL) -> list[IpAddress]:
    """What the URL's host resolves to now (an address literal is itself)."""
    # The name as aiohttp resolves it to connect: `host` is an international name's Unicode
    # form, which getaddrinfo encodes by IDNA 2003, another name where the two differ ("ß").
    host = url.raw_host or ""
    try:
        return [_parse(host)]
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, url.port, type=socket.SOCK_STREAM)
    return [_parse(str(info[4][0])) for info in infos]


def location_target(url: URL, location: str) -> URL | None:
    """Where a redirect's Location sends a request for `url`; None where it is no URL."""
    if not location:
        return None
    try:
        target = url.join(URL(location))
        # yarl decodes a punycode name when `host` is first asked: one that decodes to
        # nothing ("xn--a") raises there, which would be the redirect check's own failure.
        _ = target.host
    except ValueError:  # UnicodeError too
        return None
    return target


def is_address(url: URL) -> bool:
    """Whether the URL names an address rather than a name, which can answer differently to
    whoever resolves it next."""
    try:
        _parse(url.raw_host or "")
    except ValueError:
        return False
    return True


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
    if target.user is not None or target.password is not None:
        # aiohttp would send them, and refuses them beside the upstream's own Authorization
        # (a ValueError, not an upstream failure): a Location has no credentials to give.
        return "to a URL with credentials"
    if origin(target) != origin(base) and not _listed(target, allowed_hosts):
        return "to another origin, not in the upstream's redirect_hosts"
    own = {address_class(ip) for ip in base_ips}
    for ip in target_ips:
        kind = address_class(ip)
        if kind != "public" and kind not in own:
            return f"to a {kind} address ({ip}) while the upstream is not on one"
    return None


class RefusedAddress(OSError):
    """A redirect target's name resolved, when connecting, into a network it may not lead to."""


def _name(host: str) -> str:
    return host.rstrip(".").lower()


class GuardedResolver(AbstractResolver):
    """The resolver of the upstreams' connector: the addresses it answers are the ones
    connected to, so this is where the address rule holds whatever a name answered before.

    A host that only redirects lead to (listed in an upstream's redirect_hosts, and no
    upstream's own) may resolve to public addresses, or into the kinds of network the
    upstreams listing it are in; anything else raises RefusedAddress. The answers are
    cached per host, not per upstream, so a host listed by several upstreams may lead into
    any of their networks. Every other host (an upstream's own, an HTTP proxy) resolves as
    it does without symgate, and redirects can lead to no other host.
    """

    def __init__(self, upstreams: Iterable[UpstreamConfig],
                 inner: AbstractResolver | None = None) -> None:
        # Names resolved the way the OS does (hosts file, nsswitch), as refusal() sees them.
        self._inner = inner or ThreadedResolver()
        # Keyed by the raw (punycode) host aiohttp resolves to connect, not yarl's `host`,
        # an international name's Unicode form: a name keyed so was never asked for.
        servers = [u for u in upstreams if u.url]
        own = {_name(URL(u.url).raw_host or "") for u in servers}
        self._listed_by: dict[str, list[URL]] = {}
        for u in servers:
            for entry in u.redirect_hosts:
                host = _name(URL(f"//{entry}").raw_host or "")
                if host not in own:
                    self._listed_by.setdefault(host, []).append(URL(u.url))

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        answers = await self._inner.resolve(host, port, family)
        bases = self._listed_by.get(_name(host))
        if bases is None:
            return answers
        allowed = {"public"} | await _classes(bases)
        for answer in answers:
            address = _parse(answer["host"])
            if (kind := address_class(address)) not in allowed:
                raise RefusedAddress(
                    f"to a {kind} address ({address}) while the upstream is not on one")
        return answers

    async def close(self) -> None:
        await self._inner.close()


async def _classes(bases: Sequence[URL]) -> set[str]:
    """The kinds of network the upstreams at `bases` are in now (none for one that does not
    resolve: its redirects then lead to public addresses only)."""
    found: set[str] = set()
    for base in bases:
        try:
            found.update(address_class(a) for a in await addresses(base))
        except OSError:
            continue
    return found
