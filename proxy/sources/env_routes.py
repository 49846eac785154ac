"""How the environment says to reach an upstream: the HTTP proxy (HTTPS_PROXY, HTTP_PROXY,
NO_PROXY) and ~/.netrc credentials, what aiohttp's `trust_env` would apply.

aiohttp looks both up again for every request, each in a thread of the default executor: two
thread hops, ~0.8 ms of every upstream request, a visible share of a cold fetch's time to its
first byte. The environment and ~/.netrc do not change while symgate runs (a site that edits
them restarts it), so each origin's route is looked up once, in a thread, and remembered.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from dataclasses import dataclass

from aiohttp.helpers import basicauth_from_netrc, get_env_proxy_for_url, netrc_from_env
from yarl import URL


@dataclass(frozen=True, slots=True)
class Route:
    proxy: URL | None = None
    # Proxy-Authorization, from credentials in the proxy's URL: a header of the request itself
    # for http://, of the CONNECT for https:// (aiohttp sends proxy_headers only there).
    proxy_headers: dict[str, str] | None = None
    # Authorization from ~/.netrc (or $NETRC): used only where the request carries none.
    authorization: str | None = None
    # Whether it is netrc's `default` entry, no `machine` entry naming the host.
    authorization_for_any_host: bool = False

    def add_headers(self, url: URL, headers: dict[str, str], *,
                    upstream_origin: bool = True) -> None:
        """What this route adds to a request for `url` beside `headers`: netrc's credentials
        where it carries none (nor its URL), Proxy-Authorization where it goes to an http://
        proxy as is (aiohttp sends proxy_headers only with a CONNECT).

        `upstream_origin`: whether `url` is of an upstream's own origin, not a host its
        redirect named; such a host, the upstream's choice, gets no `default` credentials."""
        if self.authorization and url.user is None \
                and (upstream_origin or not self.authorization_for_any_host) \
                and not any(k.lower() == "authorization" for k in headers):
            headers["Authorization"] = self.authorization
        if self.proxy_headers and url.scheme == "http":
            headers.update(self.proxy_headers)


# Origins whose routes are remembered: the upstreams' own, and the hosts their redirects name,
# which an upstream chooses (one redirecting each miss to a new port grew it without end).
MAX_ORIGINS = 512


class EnvironmentRoutes:
    def __init__(self) -> None:
        self._known: dict[tuple[str, str | None, int | None], Route] = {}

    def __len__(self) -> int:
        return len(self._known)

    async def route(self, url: URL) -> Route:
        origin = (url.scheme, url.host, url.port)
        known = self._known.get(origin)
        if known is None:
            known = await asyncio.to_thread(_look_up, url)
            if len(self._known) >= MAX_ORIGINS:
                # The oldest remembered first: an upstream's own origin is looked up at its
                # first fetch, and again (one thread hop) only after as many others.
                del self._known[next(iter(self._known))]
            self._known[origin] = known
        return known


class UnusableEnvironment(Exception):
    """What the environment says to reach an upstream with (an HTTP proxy, ~/.netrc) cannot
    be used: the same for every request, so a misconfiguration to say, never retried. Its
    reason never quotes the values, which may carry passwords."""


_NAMED = "an HTTP proxy the environment names (HTTP_PROXY, HTTPS_PROXY)"
_NETRC = "~/.netrc (or $NETRC)"
# What aiohttp's BasicAuth refuses: RFC 7617's one separator in a login, or a character its
# Latin-1 encoding cannot carry. Said without aiohttp's message, which quotes the character.
_NOT_BASIC = "cannot be sent as Basic credentials (a ':' in the login, or a character " \
    "outside Latin-1)"


def _look_up(url: URL) -> Route:
    # Each of these raised from deep in every fetch: a 500 that said nothing, the upstreams
    # after this one never asked (a local directory neither).
    try:
        # Read first: aiohttp's proxy lookup reads it too, and its failure there was taken for
        # the proxy's. Python's netrc reads UTF-8; aiohttp catches only its parse errors.
        netrc = netrc_from_env()
    except ValueError:
        raise UnusableEnvironment(f"{_NETRC} is not UTF-8") from None
    proxy: URL | None = None
    proxy_headers: dict[str, str] | None = None
    try:
        with suppress(LookupError):  # none set, or NO_PROXY exempts this host
            proxy, proxy_auth = get_env_proxy_for_url(url)
            if proxy_auth is not None:
                proxy_headers = {"Proxy-Authorization": proxy_auth.encode()}
    except UnicodeError:  # the proxy's password
        raise UnusableEnvironment(f"the credentials of {_NAMED} {_NOT_BASIC}") from None
    except ValueError as e:
        # aiohttp parses every *_proxy variable for each request (HTTPS_PROXY's too, for an
        # http:// upstream): an unclosed "[::1", a port past 65535, no host. The message is
        # yarl's or BasicAuth's, without the value.
        raise UnusableEnvironment(f"{_NAMED} is not a URL: {e}") from None
    if proxy is not None and proxy.scheme != "http":
        # aiohttp speaks plain HTTP to whatever it is given: to a SOCKS proxy's port, or to
        # "user:password@proxy:3128" (no scheme, which curl takes), whose whole text its
        # InvalidURL then carried into every 502, the password with it.
        raise UnusableEnvironment(f"{_NAMED} is not an http:// URL")
    authorization: str | None = None
    if netrc is not None and url.host is not None:
        try:
            with suppress(LookupError):
                authorization = basicauth_from_netrc(netrc, url.host).encode()
        except ValueError:  # UnicodeError too
            raise UnusableEnvironment(f"the entry of {_NETRC} for {url.host} {_NOT_BASIC}"
                                      ) from None
    for_any_host = netrc is not None and url.host not in netrc.hosts
    return Route(proxy, proxy_headers, authorization, for_any_host)
