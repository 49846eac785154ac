"""One debuginfod upstream over HTTP: timeouts, retries with backoff, redirects, breaker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp
from yarl import URL

from proxy.config import UpstreamConfig, shown_url
from proxy.errors import OutOfResources, UpstreamTimeout, UpstreamUnavailable, out_of_descriptors
from proxy.headers import decimal, http_date, printable, retry_after
from proxy.inflating import CODINGS, Inflater, Unreadable
from proxy.keys import ArtifactKey, Kind
from proxy.metrics import BreakerState, ProxyMetrics, upstream_label
from proxy.sources import redirects
from proxy.sources.base import USER_AGENT, ArtifactMeta, Body, Hop
from proxy.sources.breaker import CircuitBreaker
from proxy.sources.env_routes import EnvironmentRoutes, Route, UnusableEnvironment
from symbolize.outcome import Outcome

log = logging.getLogger(__name__)

CHUNK = 256 * 1024
# elfutils' spelling in its code (its man page says X-DEBUGINFOD-IMA-SIGNATURE): a hex string.
IMA_SIGNATURE = "X-DEBUGINFOD-IMASIGNATURE"
MAX_IMA_SIGNATURE = 4096
_NOT_FOUND = frozenset({404, 410})
_TRANSIENT_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))
_REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})
# elfutils' debuginfod answers every 200 (file, archive member, section, federated) with this
# type, and so does symgate. A source cannot be verified by a build ID (sections are cut from
# verified files), so an HTML error page a proxy or CDN sends with 200 must not be kept.
_ARTIFACT_TYPE = "application/octet-stream"


class UpstreamBody:
    """A 200 response whose body has not been read yet."""

    def __init__(self, upstream: Upstream, response: aiohttp.ClientResponse, path: str
                 ) -> None:
        self.upstream = upstream
        self._response = response
        self._path = path  # what was asked of the upstream: the file its failure is about
        h = response.headers
        size: int | None = None
        for header in ("X-DEBUGINFOD-SIZE", "Content-Length"):
            if header == "Content-Length" and h.get("Content-Encoding", "identity") != "identity":
                continue  # the compressed length says nothing of what we will write
            if (size := decimal(h.get(header))) is not None:
                break
        # What an upstream says is stored in SQL and sent to every client: a value that could
        # not be (control characters, undecodable bytes) is dropped, never the artifact.
        self.meta = ArtifactMeta(
            upstream=upstream.name,
            size=size,
            filename=printable(h.get("X-DEBUGINFOD-FILE"), 4096),
            archive=printable(h.get("X-DEBUGINFOD-ARCHIVE"), 4096),
            last_modified=http_date(h.get("Last-Modified")),
            ima_signature=printable(h.get(IMA_SIGNATURE), MAX_IMA_SIGNATURE),
            framed=size is not None or "Content-Length" in h
            or "chunked" in h.get("Transfer-Encoding", "").lower()
            or h.get("Content-Encoding", "identity").strip().lower() not in ("", "identity"),
        )

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, raising UpstreamTimeout / UpstreamUnavailable when it stops short."""
        name = self.upstream.name
        idle = self.upstream.cfg.read_timeout_s or None
        content = self._response.content
        encoding = self._response.headers.get("Content-Encoding", "identity").strip().lower()
        # The upstream's own words go into the reason a client, the log and the status page
        # get: raw, an escape sequence or a byte that is not UTF-8 made the 502 a 500.
        shown = printable(encoding, 32) or "unprintable"
        try:
            inflater = None
            if encoding not in ("", "identity"):
                if encoding not in CODINGS:
                    raise Unreadable(f"unsupported Content-Encoding {shown}")
                # symgate asks for identity; some servers send gzip anyway, or raw deflate.
                inflater = Inflater(CODINGS[encoding], raw_deflate=True)
            while True:
                # The idle limit is timed here rather than as aiohttp's sock_read, which would
                # also cut short the wait for the headers that first_byte_timeout_s allows.
                async with asyncio.timeout(idle):
                    chunk = await content.read(CHUNK)
                if not chunk:
                    if inflater is not None:
                        # aiohttp checks this for deflate only: a gzip stream cut short at a
                        # whole Content-Length would otherwise be a short file taken as whole.
                        inflater.end()
                    return
                # What came over the wire (an operator's egress), not what it inflates to.
                self.upstream.metrics.upstream_bytes.labels(self.upstream.label).inc(len(chunk))
                # A piece at a time, each checked against the limits by the download before
                # the next is inflated: not all a bomb's chunk inflates to at once.
                for part in inflater.pieces(chunk) if inflater is not None else (chunk,):
                    yield part
        except Unreadable as e:
            error = UpstreamUnavailable(f"{name}: {shown} body unreadable ({e})")
            self.upstream.body_failed(Outcome.UPSTREAM_ERROR, error.reason, self._path)
            raise error from e
        except TimeoutError as e:
            timeout = UpstreamTimeout(f"{name}: stopped sending the body")
            self.upstream.body_failed(Outcome.TIMEOUT, timeout.reason, self._path)
            raise timeout from e
        except (aiohttp.ClientError, OSError) as e:
            error = UpstreamUnavailable(f"{name}: body cut off ({type(e).__name__})")
            self.upstream.body_failed(Outcome.UPSTREAM_ERROR, error.reason, self._path)
            raise error from e

    def close(self) -> None:
        self._response.close()


def upstream_names(cfgs: Sequence[UpstreamConfig], scope: str = "") -> list[str]:
    """The name of each server of `cfgs`, a list of upstreams asked together ("" for a local
    directory): its URL as shown, never with the credentials it may hold (the name is logged,
    labels metrics, is shown on the status page and is written into SQL rows), and the scope
    of a tenant's own. One shown as another before it in the list (the same server with other
    credentials or headers) is told apart by its place among those, " (2)": misses, breakers,
    doubts and metrics are by name, and one refused or down was taken to have said the 404
    the other said."""
    seen: Counter[str] = Counter()
    names = []
    for cfg in cfgs:
        if not cfg.url:
            names.append("")
            continue
        shown = shown_url(cfg.url)
        name = shown if not scope else f"{shown} [{scope}]"
        seen[name] += 1
        names.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return names


@dataclass(frozen=True, slots=True)
class Sessions:
    """The HTTP sessions upstream requests go through: `fetches` for artifacts, `queries` for
    other API paths (/metadata), each with a pool of its own, so that queries waiting for a
    connection never hold a fetch back (and its wait is never taken for the upstream's)."""

    fetches: aiohttp.ClientSession
    queries: aiohttp.ClientSession


# An elfutils debuginfod older than /metadata (0.188) answers a path it does not know with a 503
# whose body says so: a server too old for the query, not one failing.
_UNKNOWN_PATH = b"webapi error, unrecognized '"


async def _query_result(response: aiohttp.ClientResponse, idle: float | None) -> Outcome:
    """What Upstream.query's answer counts as. A 503's body is read for _UNKNOWN_PATH (its
    callers read a 200's alone), within `idle` and total_timeout_s (Upstream._follow): a
    503 that never sends its body holds the query no longer than a 200 that stalls."""
    if response.status == 200:
        return Outcome.OK
    if response.status in _NOT_FOUND:
        return Outcome.NOT_FOUND
    if response.status == 503:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, EOFError):
            async with asyncio.timeout(idle):
                said = await response.content.readexactly(len(_UNKNOWN_PATH))
            if said == _UNKNOWN_PATH:
                return Outcome.NOT_FOUND
    return Outcome.UPSTREAM_ERROR


class Upstream:
    """A debuginfod server over HTTP(S)."""

    remembers_misses = True

    def __init__(
        self, cfg: UpstreamConfig, sessions: Sessions, metrics: ProxyMetrics,
        routes: EnvironmentRoutes, scope: str = "", name: str = "", place: int = 1,
    ) -> None:
        """`name`: the one upstream_names() gives it among the upstreams asked with it;
        `place`: for a tenant's own (`scope`), its place in the tenant's list, from 1."""
        self.cfg = cfg
        self._routes = routes
        self.name = name or upstream_names([cfg], scope)[0]
        self.label = upstream_label(self.name, scope, place)
        self.scope = scope
        base = URL(cfg.url.rstrip("/"))
        # Credentials written into the URL are the upstream's Authorization, sent to its
        # origin alone as configured headers are: left in the URL, aiohttp refuses a request
        # that also carries one (from ~/.netrc), and a same-origin redirect went without them.
        url_auth = aiohttp.BasicAuth.from_url(base)
        self._url_authorization = url_auth.encode() if url_auth is not None else None
        self.base = str(base.with_user(None)) if url_auth is not None else str(base)
        self.metrics = metrics
        self._sessions = sessions
        self.breaker = CircuitBreaker(
            cfg.breaker_failures, cfg.breaker_cooldown_s,
            lambda state: metrics.set_breaker(self.label, state), name=self.name,
            key_rest_s=cfg.failed_file_rest_s,
        )
        self._base_url = URL(self.base)
        metrics.add_upstream(self.name, self.label)

    def has(self, key: ArtifactKey) -> bool | None:
        return None  # only a request can tell

    def count(self, result: Outcome, path: str | None, *, failed: str = "") -> None:
        """Count one request's result, for the file at `path` (None: the upstream could not be
        reached, so no file was asked); any answer at all closes the breaker again.

        `failed` says why, for a failure that is the upstream's own (it counts towards the
        breaker); answers that would be the same every time (a refused redirect, a 401) are
        a misconfiguration to report, not an outage to wait out.
        """
        self.metrics.upstream_requests.labels(self.label, result).inc()
        if not failed:
            self.breaker.success(path)
        elif self.breaker.failure(failed, path):
            self.metrics.breaker_trips.labels(self.label).inc()

    def body_failed(self, result: Outcome, reason: str, path: str) -> None:
        self.metrics.upstream_body_failures.labels(self.label, result).inc()
        if self.breaker.failure(reason, path):
            self.metrics.breaker_trips.labels(self.label).inc()

    async def open(self, key: ArtifactKey, hop: Hop) -> UpstreamBody | None:
        """The upstream's 200 response, or None for its 404.

        Transient failures are retried with exponential backoff before any body byte is read;
        what remains after the retries is raised as UpstreamTimeout or UpstreamUnavailable.
        A file that failed here a moment ago is not asked again until its rest is over.
        """
        if (rest := self.breaker.key_rest(key.upstream_path)) is not None:
            left, reason = rest
            # Its clients are answered from memory: one that asks for it again and again, on
            # purpose or not, costs the upstream one request (and its retries) per rest.
            raise UpstreamUnavailable(
                f"{self.name}: not asked for this file for {left:.0f} s more, after it failed: "
                f"{reason}", left)
        last: UpstreamUnavailable | None = None
        asked_wait = 0.0  # what the last answer's Retry-After asked for
        for attempt in range(self.cfg.retries + 1):
            delay = min(self.cfg.retry_backoff_s * 2 ** (attempt - 1),
                        self.cfg.retry_backoff_max_s) if attempt else 0.0
            if asked_wait > delay:
                # Asked again sooner than it said it could answer (a 429 or 503 with
                # Retry-After): the same answer, and more load on a server that said it has
                # too much. The request fails now, its client told to retry.
                break
            if not self.breaker.allow():
                if last is not None:
                    # Its breaker opened on the way, by this request's own failure perhaps:
                    # a Retry-After it carried still holds (below), past the cool-down.
                    break
                if resting := self.breaker.resting_s():
                    raise UpstreamUnavailable(
                        f"{self.name}: not asked for {resting:.0f} s more, as its "
                        f"Retry-After asked ({self.breaker.last_failure})", resting)
                raise UpstreamUnavailable(f"{self.name}: circuit breaker open")
            # Whether allow() let this attempt through as the half-open breaker's one trial,
            # which a cancellation (a race lost, during the backoff too) must give back.
            trial = self.breaker.state is BreakerState.HALF_OPEN
            try:
                if delay:
                    await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                return await self._attempt(key, hop)
            except (asyncio.CancelledError, OutOfResources):
                if trial:  # nothing learnt of the upstream: the next request is the trial
                    self.breaker.abandon()
                raise
            except _Permanent as e:
                raise e.error from None
            except _Busy as e:
                last, asked_wait = e.error, e.wait_s
            except UpstreamUnavailable as e:
                last, asked_wait = e, 0.0
        assert last is not None
        # Not asked again, for any file, until it said it could answer: every miss of the
        # site would otherwise ask a server that is turning it away.
        if asked_wait > 0 and self.breaker.rest(asked_wait, last.reason):
            self.metrics.breaker_trips.labels(self.label).inc()
        raise last

    async def query(self, path_qs: str, hop: Hop) -> aiohttp.ClientResponse:
        """A GET of another API path (/metadata?...), with this upstream's credentials,
        redirect rules and first-byte limit; the caller reads and releases the response, its
        body cut off (TimeoutError) at total_timeout_s from this call. UpstreamUnavailable
        (or UpstreamTimeout) when none came. Not counted towards the breaker: a server too old
        to know the path is not an outage; an open one is skipped. Counted in
        upstream_requests_total as a file's request is: an operator reading it for what
        leaves the site saw no /metadata query at all."""
        if self.breaker.state is BreakerState.OPEN:
            raise UpstreamUnavailable(f"{self.name}: circuit breaker open")
        counted = self.metrics.upstream_requests
        try:
            async with asyncio.timeout(self.cfg.first_byte_timeout_s or None):
                response = await self._follow(URL(self.base + path_qs, encoded=True), hop,
                                              session=self._sessions.queries)
        except TimeoutError as e:
            counted.labels(self.label, Outcome.TIMEOUT).inc()
            raise UpstreamTimeout(f"{self.name}: no response in time") from e
        except _Permanent as e:
            counted.labels(self.label, Outcome.UPSTREAM_ERROR).inc()
            raise e.error from None
        except _Unreachable as e:  # its cause says how (symgate inspect's "unreachable")
            counted.labels(self.label, e.error.outcome).inc()
            raise e.error from e.__cause__
        except (aiohttp.ClientError, OSError) as e:
            counted.labels(self.label, Outcome.UPSTREAM_ERROR).inc()
            raise UpstreamUnavailable(f"{self.name}: {type(e).__name__}: {_told(e)}") from e
        try:
            result = await _query_result(response, self.cfg.read_timeout_s or None)
        except BaseException:  # cancelled: the caller never has the response to release
            response.release()
            raise
        counted.labels(self.label, result).inc()
        return response

    async def _attempt(self, key: ArtifactKey, hop: Hop) -> UpstreamBody | None:
        started = time.perf_counter()
        timed = True
        path = key.upstream_path
        try:
            async with asyncio.timeout(self.cfg.first_byte_timeout_s or None):
                response = await self._follow(URL(self.base + key.upstream_path), hop,
                                              session=self._sessions.fetches,
                                              decompress=False)
        except asyncio.CancelledError:
            # Given up before it answered (another upstream won the race, or the server
            # stops): no result is counted, and its time so far is no response time. Observed,
            # a slow upstream that always loses would show as the fastest of all, and the
            # histogram's count would run ahead of upstream_requests_total.
            timed = False
            raise
        except _Unreachable as e:
            # Not about this file: every file would have failed so, and each such failure
            # counts towards the breaker.
            self.count(e.error.outcome, None, failed=e.error.reason)
            raise e.error from e.__cause__
        except TimeoutError as e:
            error: UpstreamUnavailable = UpstreamTimeout(f"{self.name}: no response in time")
            self.count(Outcome.TIMEOUT, path, failed=error.reason)
            raise error from e
        except _Permanent:
            self.count(Outcome.UPSTREAM_ERROR, path)
            raise
        except (aiohttp.ClientError, OSError) as e:
            # Sent, then reset or cut off before an answer: a request can cause that (a path
            # that crashes the server, or that a proxy in front of it drops), so it is the
            # file's failure, as a 5xx is.
            error = UpstreamUnavailable(f"{self.name}: {type(e).__name__}: {_told(e)}")
            self.count(Outcome.UPSTREAM_ERROR, path, failed=error.reason)
            raise error from e
        finally:
            if timed:
                self.metrics.upstream_latency.labels(self.label).observe(
                    time.perf_counter() - started
                )
        status = response.status
        if status == 200:
            if key.kind is Kind.SOURCE and response.content_type != _ARTIFACT_TYPE:
                response.release()
                self.count(Outcome.UPSTREAM_ERROR, path)
                reason = f"{self.name}: answered 200 with {printable(response.content_type, 64)}"
                log.warning("%s for %s; not an artifact, nothing kept", reason, key.id)
                raise _Permanent(UpstreamUnavailable(reason + ", not a debuginfod artifact"))
            self.count(Outcome.OK, path)
            return UpstreamBody(self, response, path)
        response.release()
        if status in _NOT_FOUND:
            self.count(Outcome.NOT_FOUND, path)
            return None
        if status in _TRANSIENT_STATUS:
            wait = retry_after(response.headers.get("Retry-After"), time.time())
            said = f" (Retry-After: {wait:g} s)" if wait is not None else ""
            error = UpstreamUnavailable(f"{self.name}: answered {status}{said}", wait)
            self.count(Outcome.UPSTREAM_ERROR, path, failed=error.reason)
            if wait is not None:
                raise _Busy(error, wait)
            raise error
        # 401/403 and the like: a misconfiguration, not a miss, and not worth retrying.
        self.count(Outcome.UPSTREAM_ERROR, path)
        raise _Permanent(UpstreamUnavailable(f"{self.name}: answered {status}"))

    async def _follow(self, url: URL, hop: Hop, session: aiohttp.ClientSession,
                      decompress: bool = True) -> aiohttp.ClientResponse:
        """The first answer that is not a redirect, following only the redirects the
        operator allows (proxy.sources.redirects); _Permanent for any other. TimeoutError
        past total_timeout_s from now, which bounds the answer's body too (aiohttp's timer)."""
        # One deadline for the whole exchange, every hop and the body read after: with a
        # total_timeout_s of each hop's own, an upstream that sent each hop's redirect a little
        # before its end held the request for max_redirects + 1 of them.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.total_timeout_s if self.cfg.total_timeout_s else None
        async with asyncio.timeout_at(deadline):  # resolving a redirect's host, too
            return await self._hops(url, hop, session, decompress, deadline)

    async def _hops(self, url: URL, hop: Hop, session: aiohttp.ClientSession, decompress: bool,
                    deadline: float | None) -> aiohttp.ClientResponse:
        loop = asyncio.get_running_loop()
        previous = url
        for _ in range(self.cfg.max_redirects + 1):
            own_origin = redirects.origin(url) == redirects.origin(self._base_url)
            # What the client told of itself (its address, its tool) is for the upstream the
            # operator chose, not for every host it redirects to (a third party's mirror).
            headers = {"User-Agent": USER_AGENT,
                       **(hop.headers() if own_origin else hop.loop_headers()),
                       # Bodies are counted against max_artifact_bytes as written; debuginfod
                       # serves files uncompressed, and elfutils' server never compresses.
                       "Accept-Encoding": "identity"}
            if own_origin:
                headers.update(self.cfg.headers)  # credentials go to the upstream alone
                if self._url_authorization and not any(k.lower() == "authorization"
                                                       for k in headers):
                    headers["Authorization"] = self._url_authorization
            route = await self._route(url)
            route.add_headers(url, headers, upstream_origin=own_origin)
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:  # aiohttp would take it for no limit at all
                raise TimeoutError
            timeout = aiohttp.ClientTimeout(
                total=left, sock_connect=self.cfg.connect_timeout_s or None)
            try:
                response = await session.get(
                    url, headers=headers, timeout=timeout, allow_redirects=False,
                    proxy=route.proxy, proxy_headers=route.proxy_headers,
                    # An artifact's body is inflated by UpstreamBody, which knows a stream
                    # that ends short (aiohttp does for deflate only).
                    auto_decompress=decompress)
            except aiohttp.ClientConnectorError as e:
                # No descriptor for the socket: this server's passing trouble, to be answered
                # with Retry-After, and nothing said of the upstream (its breaker).
                if (full := out_of_descriptors(e.os_error)) is not None:
                    raise full from e
                # The connector's resolver applies the address rule to the answer it connects
                # to, which may not be the one _refusal was given (DNS rebinding).
                if isinstance(e.os_error, redirects.RefusedAddress):
                    raise self._refused(previous, url, str(e.os_error)) from None
                if redirects.origin(url) == redirects.origin(self._base_url):
                    raise _Unreachable(UpstreamUnavailable(
                        f"{self.name}: {type(e).__name__}: {_told(e)}")) from e
                raise  # a host a redirect for this file named: the file's failure
            except aiohttp.ConnectionTimeoutError as e:
                if redirects.origin(url) == redirects.origin(self._base_url):
                    raise _Unreachable(UpstreamTimeout(
                        f"{self.name}: no connection in time")) from e
                raise
            if response.status not in _REDIRECT_STATUS:
                return response
            location = response.headers.get("Location", "")
            response.release()
            target = redirects.location_target(url, location)
            why = ("without a usable Location" if target is None
                   else await self._refusal(target))
            if target is None or why is not None:
                raise self._refused(url, target or location, why)
            previous, url = url, target
        log.warning("upstream %s: more than %d redirects, last to %s",
                    self.name, self.cfg.max_redirects, shown_url(str(url)))
        raise _Permanent(UpstreamUnavailable(f"{self.name}: too many redirects"))

    async def _route(self, url: URL) -> Route:
        try:
            return await self._routes.route(url)
        except UnusableEnvironment as e:  # the site's misconfiguration, the same on every retry
            raise _Permanent(UpstreamUnavailable(f"{self.name}: {e}")) from None

    def _refused(self, source: URL, target: URL | str, why: str | None) -> _Permanent:
        shown = printable(shown_url(str(target)), 512) or "?"
        log.warning("upstream %s: refused redirect from %s to %s: %s",
                    self.name, shown_url(str(source)), shown, why)
        return _Permanent(UpstreamUnavailable(f"{self.name}: bad redirect to {shown} ({why})"))

    async def _refusal(self, target: URL) -> str | None:
        if (why := redirects.refusal(self._base_url, [], target, [], self.cfg.redirect_hosts)):
            return why  # refused by name alone: nothing to resolve
        if redirects.origin(target) == redirects.origin(self._base_url):
            # The upstream's own host, which its every request reaches anyway: nothing to
            # compare, and behind an HTTP proxy symgate may not resolve it at all (the proxy
            # does), which refused every redirect of such an upstream.
            return None
        if (await self._route(target)).proxy is not None \
                and not redirects.is_address(target) \
                and target.raw_host != self._base_url.raw_host:
            # The proxy resolves the name itself, perhaps to another answer than the check
            # is given (DNS rebinding), and connects where this process cannot refuse it. The
            # upstream's own name it resolves for every request anyway, whatever the port.
            return "to a name the HTTP proxy would resolve, past the address rule"
        try:
            own = await redirects.addresses(self._base_url)
            theirs = await redirects.addresses(target)
        except OSError as e:
            return f"cannot resolve: {e}"
        return redirects.refusal(self._base_url, own, target, theirs, self.cfg.redirect_hosts)


# The most of an exception's text a reason carries: reasons go to clients, logs and the page.
MAX_TOLD = 200


def _told(error: BaseException) -> str:
    """What `error` says, for a reason: its first line, cut at MAX_TOLD characters. aiohttp's
    parser errors quote the bytes an upstream sent after it (a whole read of the body, 100 KB
    and more of escaped binary) on the lines after the first."""
    # A response error's str() is its message's repr, newlines escaped: the message itself.
    said = (f"{error.status} {error.message}" if isinstance(error, aiohttp.ClientResponseError)
            else str(error))
    text = said.split("\n", 1)[0].rstrip(" :")
    return text if len(text) <= MAX_TOLD else text[:MAX_TOLD] + "..."


class _Busy(Exception):
    """Carries a transient failure whose answer said when to ask again (Retry-After)."""

    def __init__(self, error: UpstreamUnavailable, wait_s: float) -> None:
        super().__init__(error.reason)
        self.error = error
        self.wait_s = wait_s


class _Unreachable(Exception):
    """The upstream's own host could not be connected to (refused, unresolvable, no answer to
    the connect, TLS refused, the egress proxy down): nothing was asked of it, so it says
    nothing of any file. A host a redirect names is a file's, not the upstream's: this
    upstream may send each file to another mirror, one of them down."""

    def __init__(self, error: UpstreamUnavailable) -> None:
        super().__init__(error.reason)
        self.error = error


class _Permanent(Exception):
    """Carries an upstream failure that retrying would not cure."""

    def __init__(self, error: UpstreamUnavailable) -> None:
        super().__init__(error.reason)
        self.error = error


def close_quietly(body: Body | None) -> None:
    if body is not None:
        with contextlib.suppress(Exception):
            body.close()
