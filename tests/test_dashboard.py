"""The Grafana dashboard queries only metrics that symgate really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.faults import FaultUpstream
from tests.harness import SymgateFactory

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "symgate.json"
_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def queried_metrics() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    return {m for e in exprs for m in re.findall(r"\bsymgate_[a-z_]+", e)}


async def test_every_dashboard_metric_is_exported(
    start_symgate: SymgateFactory, faults: FaultUpstream
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    status, _, body = await sg.get("/metrics")
    assert status == 200
    exported: set[str] = set()
    for family in text_string_to_metric_families(body.decode()):
        exported.add(family.name)
        exported.update(family.name + s for s in _SUFFIXES)
    missing = queried_metrics() - exported
    assert not missing, sorted(missing)
    # The views operators asked for: hit and negative-hit ratios, upstream latency and
    # timeouts, bytes saved, cache size, symbolization success.
    assert {"symgate_requests_total", "symgate_upstream_response_seconds_bucket",
            "symgate_upstream_requests_total", "symgate_served_bytes_total",
            "symgate_cache_size_bytes", "symgate_symbolize_mappings_total"} <= queried_metrics()


async def test_every_documented_symbolize_outcome_exists_from_the_start(
    start_symgate: SymgateFactory, faults: FaultUpstream
) -> None:
    """A series that first appears at 1 is no increase() to Prometheus: the first profile
    named only, or aborted, and the first location named module+offset, went unseen."""
    sg = await start_symgate([faults.url_for("ok")])
    samples = await sg.metrics()
    for outcome in ("symbolized", "named", "unchanged", "disabled", "rejected", "unavailable",
                    "internal", "aborted"):
        assert ("symgate_symbolize_profiles_total", (("outcome", outcome),)) in samples, outcome
    for result in ("symbolized", "outside_mapping", "no_symbol", "module_offset"):
        assert ("symgate_symbolize_locations_total", (("result", result),)) in samples, result


async def test_upload_and_metadata_series_exist_from_the_start(
    start_symgate: SymgateFactory, faults: FaultUpstream
) -> None:
    """As /buildid's do: an alert on the first refused upload or incomplete /metadata answer
    (an upstream that cannot be asked) must see it."""
    sg = await start_symgate([faults.url_for("ok")])
    samples = await sg.metrics()
    for endpoint, kind, outcome in (("upload", "debuginfo", "uploaded"),
                                    ("upload", "executable", "rejected"),
                                    ("upload", "debuginfo", "unavailable"),
                                    ("metadata", "glob", "incomplete"),
                                    ("metadata", "invalid", "rejected")):
        labels = (("endpoint", endpoint), ("kind", kind), ("outcome", outcome))
        assert ("symgate_requests_total", labels) in samples, labels
