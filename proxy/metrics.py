"""Prometheus metrics of the proxy, registered on a registry the caller owns.

The hit ratio is one expression:
  sum(rate(symgate_requests_total{endpoint="buildid",outcome="hit"}[5m]))
    / sum(rate(symgate_requests_total{endpoint="buildid"}[5m]))
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any, BinaryIO

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from symbolize.outcome import NAMED, Outcome


class Served(StrEnum):
    """How a /buildid request that was answered from symgate itself was answered."""

    HIT = "hit"
    MISS = "miss"  # fetched from an upstream (or joined a fetch under way)
    NEGATIVE_HIT = "negative_hit"  # answered 404 from a remembered miss


# A response cut off after its status line: the download it streamed failed, or the client left.
ABORTED = "aborted"
# The outcome label of symgate_requests_total: how it was served, or the typed failure.
REQUEST_OUTCOMES: tuple[str, ...] = (
    *Served, ABORTED, Outcome.NOT_FOUND, Outcome.NOT_CACHED, Outcome.REJECTED, Outcome.TIMEOUT,
    Outcome.UPSTREAM_ERROR, Outcome.MALFORMED, Outcome.UNAVAILABLE, Outcome.INTERNAL,
)
ARTIFACT_KINDS = ("debuginfo", "executable", "source", "section", "invalid")
# requests_total's other endpoints: their series exist at 0 from the start, as /buildid's do.
METADATA_KINDS = ("buildid", "file", "glob", "invalid")
METADATA_OUTCOMES = ("ok", "incomplete", Outcome.REJECTED, Outcome.UNAVAILABLE, Outcome.INTERNAL,
                     ABORTED)
UPLOAD_KINDS = ("debuginfo", "executable")
UPLOAD_OUTCOMES = ("uploaded", "unchanged", "deleted", Outcome.NOT_FOUND, Outcome.REJECTED,
                   Outcome.UNAVAILABLE, Outcome.INTERNAL, ABORTED)
UPSTREAM_RESULTS = (Outcome.OK, Outcome.NOT_FOUND, Outcome.TIMEOUT, Outcome.UPSTREAM_ERROR)
VERIFICATION_REASONS = ("truncated", "not_elf", "build_id_mismatch", "too_large")
PROFILE_OUTCOMES = ("symbolized", "named", "unchanged", "disabled", Outcome.REJECTED,
                    Outcome.UNAVAILABLE, Outcome.INTERNAL, ABORTED)
MAPPING_RESULTS = ("symbolized", "has_functions", "kernel", "no_build_id", "invalid_build_id",
                   "no_locations", "unresolved", Outcome.NOT_FOUND, Outcome.NO_SYMBOLS,
                   Outcome.MALFORMED, Outcome.TIMEOUT, Outcome.UPSTREAM_ERROR, Outcome.DEADLINE,
                   Outcome.UNAVAILABLE, Outcome.INTERNAL)
LOCATION_RESULTS = ("symbolized", "outside_mapping", "no_symbol", NAMED)
BUILD_RESULTS = (Outcome.OK, Outcome.NO_SYMBOLS, Outcome.MALFORMED)


OTHER_UPSTREAM = "other"


def upstream_label(name: str, tenant: str = "", place: int = 0) -> str:
    """How the metrics, and the status page read from them, name the upstream `name`: /metrics
    (and the page) go to whoever may scrape them, who is no tenant. A global source is its
    name (its URL, credentials masked, or its directory); a tenant's own server is that
    tenant's, its address perhaps private (an internal host, a path naming a customer), so it
    is named by the tenant and its `place` in the tenant's list, from 1: "tenant:acme#2"."""
    return f"tenant:{tenant}#{place}" if tenant else name


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
            multiprocess_mode="livesum",
        )
        # Where clients queue behind an upstream: on a slow one it climbs, and the
        # requests counts tell nothing until the fetch ends.
        self.fetch_waiters = Gauge(
            f"{p}_fetch_waiters",
            "Requests waiting for a fetch under way (this process's or another's) to stream",
            registry=registry, multiprocess_mode="livesum",
        )
        self.singleflight_joins = Counter(
            f"{p}_singleflight_joins",
            "Requests that joined a fetch already under way instead of starting one",
            registry=registry,
        )
        self.verification_failures = Counter(
            f"{p}_verification_failures",
            "Fetched artifacts rejected before caching, by reason and by the upstream that sent "
            "them", ["kind", "reason", "upstream"], registry=registry,
        )
        # Each process tells the whole data dir's figures, as SQL had them when it read them:
        # the latest reading is the truth, whichever process made it, dead since or not (a
        # live mode showed a survivor's older reading once the process that made the latest
        # died, until its replacement had read them again). fold_dead_process keeps it.
        self.cache_size = Gauge(
            f"{p}_cache_size_bytes", "Bytes of artifacts in the disk cache (uploads are not)",
            registry=registry, multiprocess_mode="mostrecent",
        )
        self.cache_entries = Gauge(
            f"{p}_cache_entries", "Artifacts in the disk cache (uploads are not)",
            registry=registry, multiprocess_mode="mostrecent",
        )
        # 1, labelled with the id of this cache directory (proxy.store.replica): which
        # replica's disk the cache figures describe.
        self.replica = Gauge(
            f"{p}_replica_info", "This replica's id, as its rows in the database name it",
            ["replica"], registry=registry, multiprocess_mode="livemax",
        )
        self.cache_max = Gauge(
            f"{p}_cache_max_bytes", "The disk cache's size budget", registry=registry,
            multiprocess_mode="livemax",
        )
        self.evictions = Counter(
            f"{p}_cache_evictions", "Artifacts evicted to stay under the size budget",
            registry=registry,
        )
        self.evicted_bytes = Counter(
            f"{p}_cache_evicted_bytes", "Bytes evicted to stay under the size budget",
            registry=registry,
        )
        self.not_kept = Counter(
            f"{p}_cache_not_kept", "Downloads served but not kept: no room in the budget",
            registry=registry,
        )
        self.negative_entries_written = Counter(
            f"{p}_negative_writes", "Misses recorded in SQL, per upstream",
            ["upstream"], registry=registry,
        )
        self.breaker_state = Gauge(
            f"{p}_upstream_breaker_state",
            "Circuit breaker per upstream: 0 closed, 1 half-open, 2 open",
            # Each serving process has its own breaker: the worst of them.
            ["upstream"], registry=registry, multiprocess_mode="livemax",
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
        # The connection guard's (proxy.web.connections): before aiohttp, so in no request
        # count. A connection shed past server.max_connections gets a 503 unread.
        self.open_connections = Gauge(
            f"{p}_open_connections", "Client connections open (served, not shed)",
            registry=registry, multiprocess_mode="livesum",
        )
        self.shed_connections = Counter(
            f"{p}_shed_connections",
            "Client connections answered 503 unread: past server.max_connections",
            registry=registry,
        )
        self.header_timeouts = Counter(
            f"{p}_header_timeouts",
            "Client connections closed (408) for not sending a whole request head within "
            "server.header_timeout_s",
            registry=registry,
        )
        self.send_timeouts = Counter(
            f"{p}_send_timeouts",
            "Client connections closed because the client acknowledged none of the bytes "
            "sent to it for server.send_timeout_s",
            registry=registry,
        )
        self.log_lines_dropped = Counter(
            f"{p}_log_lines_dropped",
            "Log lines (access and events) dropped because stderr was not read as fast as "
            "they came",
            registry=registry,
        )
        self.bucket_requests = Counter(
            f"{p}_bucket_requests", "Requests to the shared bucket ([storage])",
            ["op", "outcome"], registry=registry,
        )
        # bucket: a copy in the bucket; upstream: fetched by this replica for the cluster
        # (holding the key's lease); waited: another replica's fetch, then its bucket copy;
        # alone: the bucket or the database failing, fetched without asking the cluster.
        self.cluster_fetches = Counter(
            f"{p}_cluster_fetches", "This replica's misses, by how the cluster answered them",
            ["how"], registry=registry,
        )
        self.bucket_copies_resumed = Counter(
            f"{p}_bucket_copies_resumed",
            "Bucket copies that broke off mid-body and were finished from an upstream",
            registry=registry,
        )
        self.bucket_uploads = Counter(
            f"{p}_bucket_uploads", "Artifacts and symbol tables written to the shared bucket",
            ["kind"], registry=registry,
        )
        self.quick_hits = Counter(
            f"{p}_quick_hits",
            "Hits answered from the connection's first read of the request, before aiohttp "
            "parsed it (proxy/web/fast_hits.py); counted in requests_total too",
            registry=registry,
        )
        self.quick_misses = Counter(
            f"{p}_quick_misses",
            "Remembered misses (404) answered from the connection's first read of the request, "
            "before aiohttp parsed it (proxy/web/fast_hits.py); counted in requests_total too",
            registry=registry,
        )

        # The children resolved once: labels() takes a lock and builds a tuple per call, a
        # visible share of what a remembered 404 costs.
        self._buildid_requests = {(kind, outcome): self.requests.labels("buildid", kind, outcome)
                                  for kind in ARTIFACT_KINDS for outcome in REQUEST_OUTCOMES}
        for endpoint, kinds, outcomes in (("metadata", METADATA_KINDS, METADATA_OUTCOMES),
                                          ("upload", UPLOAD_KINDS, UPLOAD_OUTCOMES)):
            for kind in kinds:
                for outcome in outcomes:
                    self.requests.labels(endpoint, kind, outcome)
        self._upstream_labels: dict[str, str] = {}
        self.served_from_cache = self.served_bytes.labels("cache")
        self.served_from_upstream = self.served_bytes.labels("upstream")

    def count_buildid(self, kind: str, outcome: str) -> None:
        child = self._buildid_requests.get((kind, outcome))
        (child or self.requests.labels("buildid", kind, outcome)).inc()

    def add_upstream(self, name: str, label: str) -> None:
        """Make every series of the upstream `name` exist at 0, so dashboards show 0, not no
        data, under its `label` (upstream_label)."""
        self._upstream_labels[name] = label
        name = label
        for result in UPSTREAM_RESULTS:
            self.upstream_requests.labels(name, result)
        for result in (Outcome.TIMEOUT, Outcome.UPSTREAM_ERROR):
            self.upstream_body_failures.labels(name, result)
        self.upstream_latency.labels(name)
        self.upstream_bytes.labels(name)
        self.negative_entries_written.labels(name)
        self.breaker_trips.labels(name)
        for kind in ("debuginfo", "executable"):
            for reason in VERIFICATION_REASONS:
                self.verification_failures.labels(kind, reason, name)

    def upstream_label(self, name: str) -> str:
        """The label of the upstream `name` (an artifact's row or meta names it so); one this
        server was not configured with (a row of another replica's, in the shared bucket) is
        "other": its name may be a tenant's private address."""
        return self._upstream_labels.get(name, OTHER_UPSTREAM)

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
            f"{p}_symtab_cache",
            "Symbol-table lookups: hit (built), bucket (built by another replica, read from the "
            "shared bucket) or miss (to build)",
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
        # Every series of a fixed label set exists from start at 0 (Prometheus' advice).
        for outcome in PROFILE_OUTCOMES:
            self.profiles.labels(outcome)
        for result in MAPPING_RESULTS:
            self.mappings.labels(result)
        for result in LOCATION_RESULTS:
            self.locations.labels(result)
        for result in BUILD_RESULTS:
            self.symtab_builds.labels(result)
        for result in ("hit", "bucket", "miss"):
            self.symtab_cache.labels(result)


# In a server's multiprocess folder: what the serving processes that died had counted
# (fold_dead_process), so that a counter never goes down while their files go away, and the
# latest reading of the figures that are the data dir's, not a process's.
ARCHIVE = "archive.json"
# The files a process keeps values in that outlive it: counters' and histograms', added up.
# A live gauge dies with its process (mark_process_dead).
_KEPT_TYPES = ("counter", "histogram", "summary")
# and its latest readings ("mostrecent" gauges), of which the archive keeps the latest.
_LATEST = "gauge_mostrecent"


def fold_dead_process(folder: Path, pid: int) -> None:
    """The serving process `pid` is dead: its live gauges no longer count, what it counted
    joins the archive, in place of its files, and so do its readings of the data dir's cache
    where they are the latest. Kept, they piled up, two for every worker a
    server ever replaced, and every scrape read them all.

    A scrape must count each value once however it interleaves with this (ServerCollector):
    the archive that holds the process's values says so ("folded") until its files are gone,
    and each archive is a new file (renamed into place), which the scrape sees."""
    from prometheus_client.mmap_dict import MmapedDict
    from prometheus_client.multiprocess import mark_process_dead

    mark_process_dead(pid, str(folder))  # type: ignore[no-untyped-call]
    dead = [f for typ in (*_KEPT_TYPES, _LATEST) if (f := folder / f"{typ}_{pid}.db").exists()]
    if not dead:
        return
    archive = _read_archive(folder / ARCHIVE)
    values = archive["values"]
    latest: dict[str, list[float]] = archive.setdefault("latest", {})
    for path in dead:
        if path.stat().st_size == 0:  # killed between creating and sizing it: nothing in it
            continue
        typ = path.name.rpartition("_")[0]
        kept = values.setdefault(typ, {}) if typ != _LATEST else {}
        for key, value, stamp, _at in MmapedDict.read_all_values_from_file(  # type: ignore[no-untyped-call]
                str(path)):
            if typ != _LATEST:
                kept[key] = kept.get(key, 0.0) + value
            elif stamp > latest.get(key, [0.0, 0.0])[1]:
                latest[key] = [value, stamp]
    _write_archive(folder, {**archive, "folded": [pid]})
    for path in dead:
        path.unlink()
    # Not folded any more: a new process given the same pid counts anew.
    _write_archive(folder, {**archive, "folded": []})


def _read_archive(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return _archive_of(f)
    except FileNotFoundError:
        return {"folded": [], "values": {}, "latest": {}}


def _archive_of(f: BinaryIO) -> dict[str, Any]:
    archive: dict[str, Any] = json.load(f)
    return archive


def _write_archive(folder: Path, archive: dict[str, Any]) -> None:
    # Named so that no collector takes it for a process's file (*.db) while it is written.
    new = folder / f"{ARCHIVE}.new"
    new.write_text(json.dumps(archive))
    os.replace(new, folder / ARCHIVE)


class ServerCollector(MultiProcessCollector):
    """Every serving process's metrics (`serve --workers N`), read from prometheus-client's
    multiprocess folder, with what dead ones counted (fold_dead_process), past the files a
    process has created and not yet sized: MmapedDict opens its file (empty), then extends
    it, and an empty one is no file of values but a struct.error, which made every /metrics a
    500 while a worker started, and for good once one was killed between the two."""

    def __init__(self, registry: CollectorRegistry, path: str) -> None:
        super().__init__(registry, path)  # type: ignore[no-untyped-call]

    def collect(self) -> Iterable[Metric]:
        # A process folded meanwhile (its archive replaced, its files removed) is read again:
        # the files read may have missed its values, or the archive read not have them yet.
        # Folds are rare (a worker died): a scrape that meets one at every try fails, rather
        # than tell a counter lower than it was (a reset, to rate()).
        for _ in range(_TRIES):
            read = self._read_once()
            if read is not None:
                merged: Iterable[Metric] = self._accumulate_metrics(  # type: ignore[no-untyped-call]
                    read, True)
                return merged
        raise RuntimeError(f"metrics folder {self._path}: processes folded at every read")

    def _read_once(self) -> dict[str, Metric] | None:
        """The metrics by name before accumulation; None if a fold came meanwhile."""
        archive_path = os.path.join(self._path, ARCHIVE)
        with contextlib.ExitStack() as held:
            try:
                archive_file: BinaryIO | None = held.enter_context(open(archive_path, "rb"))
            except FileNotFoundError:
                archive_file = None
            archive = _archive_of(archive_file) if archive_file else {"folded": [], "values": {}}
            folded = {str(pid) for pid in archive["folded"]}
            files = []
            for name in glob.glob(os.path.join(self._path, "*.db")):
                if name.rpartition("_")[2].removesuffix(".db") in folded:
                    continue
                try:
                    if os.stat(name).st_size > 0:
                        files.append(name)
                except FileNotFoundError:  # a dead process's live gauges, removed meanwhile
                    continue
            try:
                metrics: dict[str, Metric] = self._read_metrics(files)  # type: ignore[no-untyped-call]
            except FileNotFoundError:  # a dead process's counters, folded meanwhile
                return None
            # As prometheus-client's _read_metrics adds a process's file: what the dead
            # counted as one more process's count, their latest readings as its readings.
            for typ, values in archive["values"].items():
                for key, value in values.items():
                    metric_name, name, labels, help_text = json.loads(key)
                    metric = metrics.setdefault(metric_name, Metric(metric_name, help_text, typ))
                    metric.add_sample(name, tuple(sorted(labels.items())), value)  # type: ignore[arg-type]
            for key, (value, stamp) in archive.get("latest", {}).items():
                metric_name, name, labels, help_text = json.loads(key)
                metric = metrics.setdefault(metric_name, Metric(metric_name, help_text, "gauge"))
                metric._multiprocess_mode = "mostrecent"  # type: ignore[attr-defined]
                metric.add_sample(name, (*sorted(labels.items()), ("pid", "archive")),  # type: ignore[arg-type]
                                  value, stamp)
            if _replaced(archive_file, archive_path):
                return None
        return metrics


_TRIES = 8


def _replaced(read: BinaryIO | None, path: str) -> bool:
    """Whether the archive at `path` is another than the one `read` (still open, so its inode
    cannot be another's meanwhile)."""
    try:
        now = os.stat(path).st_ino
    except FileNotFoundError:
        return read is not None
    return read is None or os.fstat(read.fileno()).st_ino != now
