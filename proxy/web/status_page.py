"""The human-readable status page at `/`: plain server-rendered HTML, no framework."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from html import escape

from prometheus_client import CollectorRegistry

from proxy import __version__
from proxy.health import Condition
from proxy.metrics import ARTIFACT_KINDS, REQUEST_OUTCOMES, UPSTREAM_RESULTS
from proxy.web.logs import shown

RECENT = 25
# The most of a recent miss's key and reason the page shows, in characters.
SHOWN_KEY = 200
SHOWN_REASON = 300


@dataclass(frozen=True, slots=True)
class Miss:
    at: float
    key: str
    outcome: str
    reason: str


class RecentMisses:
    """The last misses and failures, for the status page."""

    def __init__(self, size: int = RECENT) -> None:
        self._items: deque[Miss] = deque(maxlen=size)

    def add(self, key: str, outcome: str, reason: str) -> None:
        # The page is public, and a key is what a client asked for (a source path of 4 KB):
        # each is shown in part, and printable, so that no reason can make the page a 500.
        self._items.appendleft(Miss(time.time(), shown(key, SHOWN_KEY), outcome,
                                    shown(reason, SHOWN_REASON)))

    def __iter__(self) -> Iterator[Miss]:
        return iter(self._items)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _samples(registry: CollectorRegistry) -> Samples:
    """Every sample of the registry, collected once for the page. With serve --workers N each
    collection reads and merges every worker's metric files: looked up one figure at a time
    (get_sample_value collects anew each time), a page read them some eighty times, 0.1 to
    0.2 s of a serving process's event loop per view of a public page."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for metric in registry.collect() for s in metric.samples}


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_BREAKER = {0.0: ("closed", "ok"), 1.0: ("half-open", "warn"), 2.0: ("open", "bad")}
_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2rem auto; max-width: 70rem;
       color: #1d1d1f; padding: 0 1rem; }
h1 { font-size: 1.5rem; margin-bottom: .2rem; } h2 { font-size: 1.1rem; margin-top: 2rem; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .35rem .6rem; border-bottom: 1px solid #e3e3e3; }
th { background: #f6f6f6; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.tiles { display: flex; gap: 1rem; flex-wrap: wrap; }
.tile { border: 1px solid #e3e3e3; border-radius: 6px; padding: .7rem 1rem; min-width: 10rem; }
.tile b { display: block; font-size: 1.4rem; }
.ok { color: #1a7f37; } .warn { color: #9a6700; } .bad { color: #cf222e; }
code { font-size: 12px; }
"""


def render(*, registry: CollectorRegistry, upstreams: list[str], started: float,
           recent: RecentMisses, max_bytes: int, degraded: list[Condition] | None = None
           ) -> str:
    samples = _samples(registry)
    total = sum(_value(samples, "symgate_requests_total", endpoint="buildid", kind=k,
                       outcome=o)
                for k in ARTIFACT_KINDS for o in REQUEST_OUTCOMES)

    def outcome(o: str) -> float:
        return sum(_value(samples, "symgate_requests_total", endpoint="buildid", kind=k,
                          outcome=o) for k in ARTIFACT_KINDS)

    hits, negative = outcome("hit"), outcome("negative_hit")
    ratio = f"{100 * hits / total:.1f}%" if total else "no requests yet"
    size = _value(samples, "symgate_cache_size_bytes")
    rows = []
    for name in upstreams:
        label, css = _BREAKER.get(_value(samples, "symgate_upstream_breaker_state",
                                         upstream=name), ("closed", "ok"))
        counts = [_value(samples, "symgate_upstream_requests_total", upstream=name, result=r)
                  for r in UPSTREAM_RESULTS]
        rows.append(f"<tr><td><code>{escape(name)}</code></td><td class='{css}'>{label}</td>"
                    + "".join(f"<td class='num'>{int(c)}</td>" for c in counts) + "</tr>")
    misses = [f"<tr><td>{time.strftime('%H:%M:%S', time.gmtime(m.at))}</td>"
              f"<td><code>{escape(m.key)}</code></td><td>{escape(m.outcome)}</td>"
              f"<td>{escape(m.reason)}</td></tr>" for m in recent]
    uptime = int(time.time() - started)
    problems = "".join(
        f"<li><b>{escape(c.name)}</b> since {time.strftime('%H:%M:%S', time.gmtime(c.since))}"
        f" UTC: {escape(c.reason)}</li>" for c in degraded or [])
    health = (f'<p id="health" class="bad">degraded:</p><ul id="problems">{problems}</ul>'
              if problems else '<p id="health" class="ok">healthy</p>')
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>symgate</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{_STYLE}</style></head><body>
<h1>symgate</h1>
<p class="sub">debuginfod caching proxy and symbol cache &middot; version {escape(__version__)}
&middot; up {uptime // 3600}h {uptime // 60 % 60}m {uptime % 60}s &middot;
<a href="/metrics">/metrics</a> &middot; <a href="/healthz">/healthz</a></p>
{health}
<div class="tiles">
<div class="tile">hit ratio since start<b id="hit-ratio">{ratio}</b></div>
<div class="tile">requests<b>{int(total)}</b></div>
<div class="tile">remembered misses answered<b>{int(negative)}</b></div>
<div class="tile">cache<b id="cache-size">{_bytes(size)}</b>of {_bytes(max_bytes)},
 {int(_value(samples, "symgate_cache_entries"))} artifacts</div>
<div class="tile">served from cache<b>{_bytes(_value(samples, "symgate_served_bytes_total",
                                                source="cache"))}</b></div>
<div class="tile">profiles symbolized<b>{int(_value(samples,
    "symgate_symbolize_profiles_total", outcome="symbolized"))}</b></div>
</div>
<h2>Upstreams</h2>
<table id="upstreams"><tr><th>upstream</th><th>circuit breaker</th><th class="num">ok</th>
<th class="num">not found</th><th class="num">timeouts</th><th class="num">errors</th></tr>
{"".join(rows) or "<tr><td colspan=6>none configured</td></tr>"}</table>
<h2>Recent misses</h2>
<table id="misses"><tr><th>time (UTC)</th><th>artifact</th><th>outcome</th><th>why</th></tr>
{"".join(misses) or "<tr><td colspan=4>none since start</td></tr>"}</table>
</body></html>
"""
