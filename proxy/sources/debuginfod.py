"""One debuginfod upstream over HTTP: timeouts, retries with backoff, redirects, breaker."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

import aiohttp

from proxy import __version__
from proxy.config import UpstreamConfig
from proxy.errors import UpstreamTimeout, UpstreamUnavailable
from proxy.headers import decimal, printable
from proxy.keys import ArtifactKey
from proxy.metrics import ProxyMetrics
from proxy.sources.base import ArtifactMeta, Body, Hop
from proxy.sources.breaker import CircuitBreaker
from symbolize.outcome import Outcome

USER_AGENT = f"symgate/{__version__}"
CHUNK = 256 * 1024
_NOT_FOUND = frozenset({404, 410})
_TRANSIENT_STATUS = frozenset({408, 429}) | frozenset(range(500, 600))


class UpstreamBody:
    """A 200 response whose body has not been read yet."""

    def __init__(self, upstream: Upstream, response: aiohttp.ClientResponse) -> None:
        self.upstream = upstream
        self._response = response
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
            last_modified=printable(h.get("Last-Modified"), 64),
        )

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, raising UpstreamTimeout / UpstreamUnavailable when it stops short."""
        name = self.upstream.name
        idle = self.upstream.cfg.read_timeout_s or None
        content = self._response.content
        try:
            while True:
                # The idle limit is timed here rather than as aiohttp's sock_read, which would
                # also cut short the wait for the headers that first_byte_timeout_s allows.
                async with asyncio.timeout(idle):
                    chunk = await content.read(CHUNK)
                if not chunk:
                    return
                self.upstream.metrics.upstream_bytes.labels(name).inc(len(chunk))
                yield chunk
        except TimeoutError as e:
            self.upstream.body_failed(Outcome.TIMEOUT)
            raise UpstreamTimeout(f"{name}: stopped sending the body") from e
        except (aiohttp.ClientError, OSError) as e:
            self.upstream.body_failed(Outcome.UPSTREAM_ERROR)
            raise UpstreamUnavailable(f"{name}: body cut off ({type(e).__name__})") from e

    def close(self) -> None:
        self._response.close()


class Upstream:
    """A debuginfod server over HTTP(S)."""

    remembers_misses = True

    def __init__(
        self, cfg: UpstreamConfig, session: aiohttp.ClientSession, metrics: ProxyMetrics,
        scope: str = "",
    ) -> None:
        self.cfg = cfg
        self.name = cfg.url if not scope else f"{cfg.url} [{scope}]"
        self.scope = scope
        self.base = cfg.url.rstrip("/")
        self.metrics = metrics
        self._session = session
        self.breaker = CircuitBreaker(
            cfg.breaker_failures, cfg.breaker_cooldown_s,
            lambda state: metrics.set_breaker(self.name, state),
        )
        metrics.add_upstream(self.name)
        self._timeout = aiohttp.ClientTimeout(
            total=cfg.total_timeout_s or None,
            sock_connect=cfg.connect_timeout_s or None,
        )

    def has(self, key: ArtifactKey) -> bool | None:
        return None  # only a request can tell

    def count(self, result: Outcome, *, failed: bool = False) -> None:
        """Count one request's result; any answer at all closes the breaker again."""
        self.metrics.upstream_requests.labels(self.name, result).inc()
        if not failed:
            self.breaker.success()
        elif self.breaker.failure():
            self.metrics.breaker_trips.labels(self.name).inc()

    def body_failed(self, result: Outcome) -> None:
        self.metrics.upstream_body_failures.labels(self.name, result).inc()
        if self.breaker.failure():
            self.metrics.breaker_trips.labels(self.name).inc()

    async def open(self, key: ArtifactKey, hop: Hop) -> UpstreamBody | None:
        """The upstream's 200 response, or None for its 404.

        Transient failures are retried with exponential backoff before any body byte is read;
        what remains after the retries is raised as UpstreamTimeout or UpstreamUnavailable.
        """
        last: UpstreamUnavailable | None = None
        for attempt in range(self.cfg.retries + 1):
            if not self.breaker.allow():
                raise last or UpstreamUnavailable(f"{self.name}: circuit breaker open")
            if attempt:
                delay = min(self.cfg.retry_backoff_s * 2 ** (attempt - 1),
                            self.cfg.retry_backoff_max_s)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            try:
                return await self._attempt(key, hop)
            except _Permanent as e:
                raise e.error from None
            except UpstreamUnavailable as e:
                last = e
        assert last is not None
        raise last

    async def _attempt(self, key: ArtifactKey, hop: Hop) -> UpstreamBody | None:
        headers = {"User-Agent": USER_AGENT, **hop.headers(),
                   **self.cfg.headers}
        started = time.perf_counter()
        response: aiohttp.ClientResponse | None = None
        try:
            async with asyncio.timeout(self.cfg.first_byte_timeout_s or None):
                response = await self._session.get(
                    self.base + key.upstream_path, headers=headers, timeout=self._timeout,
                    # aiohttp counts redirect responses, not hops followed: one more.
                    max_redirects=self.cfg.max_redirects + 1,
                )
        except TimeoutError as e:
            self.count(Outcome.TIMEOUT, failed=True)
            raise UpstreamTimeout(f"{self.name}: no response in time") from e
        except aiohttp.TooManyRedirects as e:
            self.count(Outcome.UPSTREAM_ERROR)
            raise _Permanent(UpstreamUnavailable(f"{self.name}: too many redirects")) from e
        except (aiohttp.InvalidURL, aiohttp.InvalidUrlRedirectClientError,
                aiohttp.NonHttpUrlRedirectClientError) as e:
            self.count(Outcome.UPSTREAM_ERROR)
            raise _Permanent(UpstreamUnavailable(f"{self.name}: bad redirect ({e})")) from e
        except (aiohttp.ClientError, OSError) as e:
            self.count(Outcome.UPSTREAM_ERROR, failed=True)
            raise UpstreamUnavailable(f"{self.name}: {type(e).__name__}: {e}") from e
        finally:
            self.metrics.upstream_latency.labels(self.name).observe(
                time.perf_counter() - started
            )
        status = response.status
        if status == 200:
            self.count(Outcome.OK)
            return UpstreamBody(self, response)
        response.release()
        if status in _NOT_FOUND:
            self.count(Outcome.NOT_FOUND)
            return None
        if status in _TRANSIENT_STATUS:
            self.count(Outcome.UPSTREAM_ERROR, failed=True)
            raise UpstreamUnavailable(f"{self.name}: answered {status}")
        # 401/403 and the like: a misconfiguration, not a miss, and not worth retrying.
        self.count(Outcome.UPSTREAM_ERROR)
        raise _Permanent(UpstreamUnavailable(f"{self.name}: answered {status}"))


class _Permanent(Exception):
    """Carries an upstream failure that retrying would not cure."""

    def __init__(self, error: UpstreamUnavailable) -> None:
        super().__init__(error.reason)
        self.error = error


def close_quietly(body: Body | None) -> None:
    if body is not None:
        with contextlib.suppress(Exception):
            body.close()
