"""One outcome vocabulary: the same words in SQL rows, /symbolize reasons, metric labels and
HTTP statuses; existing rows are converted by a migration; every metric series a dashboard
queries exists from start at 0."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import text

from proxy.errors import SymgateError
from proxy.store.migrate import upgrade
from proxy.store.repository import Repository, create_engine
from proxy.web.errors import STATUS, status_of
from symbolize.outcome import Outcome
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "symgate.json"
NOW = datetime(2026, 12, 1, tzinfo=UTC)


def all_errors() -> list[type[SymgateError]]:
    seen: list[type[SymgateError]] = []
    todo: list[type[SymgateError]] = [SymgateError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def test_every_failure_has_an_outcome() -> None:
    for cls in all_errors():
        assert isinstance(cls.outcome, Outcome), cls
        assert 400 <= status_of(cls("x")) <= 599, cls
    # A new failure type must be placed in the status table, not fall through to a 500.
    listed = {cls for cls, _ in STATUS} - {SymgateError}
    for cls in set(all_errors()) - {SymgateError}:
        assert any(issubclass(cls, base) for base in listed), cls


async def test_the_migration_converts_existing_rows(database_url: str) -> None:
    """A database at revision 0002, with a remembered 404 and two symbol-table outcomes,
    reads back in the new words after the upgrade."""
    await asyncio.to_thread(upgrade, database_url, "0002")
    engine = create_engine(database_url)
    bid = "ab" * 20
    async with engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO negatives (key_hash, upstream, key, build_id, status, misses, "
            "first_seen, expires_at) VALUES (:h, 'http://u', :k, :b, 404, 3, :t, :e)"),
            {"h": "f" * 64, "k": f"{bid}/debuginfo", "b": bid, "t": NOW,
             "e": NOW + timedelta(hours=1)})
        for build_id, status, retry in ((bid, "ok", None), ("cd" * 20, "malformed", NOW)):
            await conn.execute(text(
                "INSERT INTO symbol_tables (build_id, status, format, source_key, size, "
                "load_address, code_ranges, cold_ranges, has_lines, file_layout, error, "
                "built_at, build_seconds, retry_after) VALUES (:b, :s, 'symcache-9', 'k', 1, "
                "0, '[]', '[]', :l, NULL, NULL, :t, 0.5, :r)"),
                {"b": build_id, "s": status, "l": True, "t": NOW, "r": retry})
    await engine.dispose()
    await asyncio.to_thread(upgrade, database_url)
    repo = Repository(create_engine(database_url))
    try:
        [neg] = await repo.get_negatives("f" * 64)
        assert (neg.upstream, neg.outcome, neg.misses) == ("http://u", "not_found", 3)
        ok = await repo.get_symbol_table("", bid)
        assert ok is not None and ok.outcome == Outcome.OK and ok.expires_at is None
        assert ok.has_lines and ok.size == 1
        bad = await repo.get_symbol_table("", "cd" * 20)
        assert bad is not None and bad.outcome == Outcome.MALFORMED and bad.expires_at == NOW
        assert await repo.get_symbol_table("tenant", bid) is None
        async with repo.engine.connect() as conn:
            scopes = (await conn.execute(text("SELECT scope FROM negatives"))).scalars().all()
        assert scopes == [""]
        if repo.engine.dialect.name == "postgresql":  # named as a later migration expects
            async with repo.engine.connect() as conn:
                names = (await conn.execute(text(
                    "SELECT conname FROM pg_constraint WHERE contype = 'p' "
                    "AND conrelid = 'symbol_tables'::regclass"))).scalars().all()
            assert names == ["symbol_tables_pkey"]
    finally:
        await repo.close()


def _selectors() -> list[tuple[str, dict[str, str]]]:
    """(metric, exact label matches) of every series selector in the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name, labels in re.findall(r"\b(symgate_[a-z_]+)(?:\{([^}]*)\})?",
                                           target["expr"]):
                wanted = dict(re.findall(r'(\w+)="([^"]*)"', labels))
                out.append((name, wanted))
    return out


async def test_every_queried_series_exists_at_zero_on_a_fresh_server(
    start_symgate: SymgateFactory, faults: FaultUpstream
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    samples = await sg.metrics()
    missing = []
    for name, wanted in _selectors():
        names = {name, name + "_total", name + "_bucket"}
        if not any(n in names and wanted.items() <= dict(labels).items()
                   for n, labels in samples):
            missing.append((name, wanted))
    assert not missing
    # Outcome labels are the shared words, and all of them are there.
    for outcome in ("hit", "miss", "negative_hit", "not_found", "rejected", "timeout",
                    "upstream_error", "malformed", "not_cached", "unavailable", "internal"):
        assert ("symgate_requests_total", (("endpoint", "buildid"), ("kind", "debuginfo"),
                                           ("outcome", outcome))) in samples
    for result in ("ok", "not_found", "timeout", "upstream_error"):
        assert ("symgate_upstream_requests_total",
                (("result", result), ("upstream", faults.url_for("ok")))) in samples
