"""Prometheus metrics of the proxy, registered on a registry the caller owns.

The hit ratio is one expression:
  sum(rate(symgate_requests_total{endpoint="buildid",outcome="hit"}[5m]))
    / sum(rate(symgate_requests_total{endpoint="buildid"}[5m]))
"""

from __future__ import annotations

from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Outcome(StrEnum):
    HIT = "hit"
    MISS = "miss"  # fetched from an upstream (or joined a fetch under way)
    NEGATIVE_HIT = "negative_hit"  # answered 404 from a remembered miss
    NOT_FOUND = "not_found"  # asked the upstreams, none had it
    NOT_CACHED = "not_cached"  # Cache-Control: only-if-cached, and it is not
    BAD_REQUEST = "bad_request"
    ERROR = "error"


class UpstreamResult(StrEnum):
    OK = "ok"
    NOT_FOUND = "not_found"
    TIMEOUT = "timeout"
    ERROR = "error"


class BreakerState(StrEnum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


_BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry, prefix: str = "symgate") -> None:
        p = prefix
        self.requests = Counter(
            f"{p}_requests", "Client requests by endpoint, artifact kind and outcome",
            ["endpoint", "kind", "outcome"], registry=registry,
        )
        self.upstream_requests = Counter(
            f"{p}_upstream_requests", "Requests sent to upstreams, by result",
            ["upstream", "result"], registry=registry,
        )
        self.upstream_body_failures = Counter(
            f"{p}_upstream_body_failures",
            "Upstream 200 responses whose body stopped short (timeout or error)",
            ["upstream", "result"], registry=registry,
        )
        self.upstream_latency = Histogram(
            f"{p}_upstream_response_seconds",
            "Time from sending a request upstream to its response headers",
            ["upstream"], registry=registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.served_bytes = Counter(
            f"{p}_served_bytes", "Body bytes sent to clients, by where they came from",
            ["source"], registry=registry,
        )
        self.upstream_bytes = Counter(
            f"{p}_upstream_bytes", "Body bytes received from upstreams",
            ["upstream"], registry=registry,
        )
        self.inflight_fetches = Gauge(
            f"{p}_inflight_fetches", "Upstream fetches under way", registry=registry,
        )
        self.singleflight_joins = Counter(
            f"{p}_singleflight_joins",
            "Requests that joined a fetch already under way instead of starting one",
            registry=registry,
        )
        self.verification_failures = Counter(
            f"{p}_verification_failures",
            "Fetched artifacts rejected before caching, by reason",
            ["kind", "reason"], registry=registry,
        )
        self.cache_size = Gauge(
            f"{p}_cache_size_bytes", "Bytes of artifacts in the disk cache", registry=registry,
        )
        self.cache_entries = Gauge(
            f"{p}_cache_entries", "Artifacts in the disk cache", registry=registry,
        )
        self.cache_max = Gauge(
            f"{p}_cache_max_bytes", "The disk cache's size budget", registry=registry,
        )
        self.evictions = Counter(
            f"{p}_cache_evictions", "Artifacts evicted to stay under the size budget",
            registry=registry,
        )
        self.evicted_bytes = Counter(
            f"{p}_cache_evicted_bytes", "Bytes evicted to stay under the size budget",
            registry=registry,
        )
        self.negative_entries_written = Counter(
            f"{p}_negative_writes", "Misses recorded in SQL, per upstream",
            ["upstream"], registry=registry,
        )
        self.breaker_state = Gauge(
            f"{p}_upstream_breaker_state",
            "Circuit breaker per upstream: 0 closed, 1 half-open, 2 open",
            ["upstream"], registry=registry,
        )
        self.breaker_trips = Counter(
            f"{p}_upstream_breaker_trips", "Times an upstream's circuit breaker opened",
            ["upstream"], registry=registry,
        )
        self.aborted_responses = Counter(
            f"{p}_aborted_responses",
            "Responses cut off because the fetch they streamed failed",
            registry=registry,
        )

    def set_breaker(self, upstream: str, state: BreakerState) -> None:
        self.breaker_state.labels(upstream).set(_BREAKER_VALUE[state])


class SymbolizeMetrics:
    def __init__(self, registry: CollectorRegistry, prefix: str = "symgate") -> None:
        p = prefix
        self.profiles = Counter(
            f"{p}_symbolize_profiles", "Profiles posted to /symbolize, by outcome",
            ["outcome"], registry=registry,
        )
        self.mappings = Counter(
            f"{p}_symbolize_mappings", "Mappings seen by /symbolize: symbolized, or why not",
            ["result"], registry=registry,
        )
        self.locations = Counter(
            f"{p}_symbolize_locations", "Locations of candidate mappings: symbolized, or why not",
            ["result"], registry=registry,
        )
        self.symtab_builds = Counter(
            f"{p}_symtab_builds", "Symbol-table builds, by outcome", ["result"],
            registry=registry,
        )
        self.symtab_build_seconds = Histogram(
            f"{p}_symtab_build_seconds", "Time to build one symbol table", registry=registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.symtab_cache = Counter(
            f"{p}_symtab_cache", "Symbol-table lookups: hit (built) or miss (to build)",
            ["result"], registry=registry,
        )
        self.layout_guesses = Counter(
            f"{p}_symtab_layout_guesses",
            "Address translations that had to guess program headers (no executable found)",
            registry=registry,
        )
        self.duration = Histogram(
            f"{p}_symbolize_request_seconds", "Time to answer one /symbolize request",
            registry=registry, buckets=(0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
