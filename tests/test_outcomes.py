"""One outcome vocabulary: the same words in SQL rows, /symbolize reasons, metric labels and
HTTP statuses; existing rows are converted by a migration; every metric series a dashboard
queries exists from start at 0."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
from sqlalchemy import text

from proxy.config import TenantConfig
from proxy.errors import SymgateError
from proxy.store.migrate import upgrade
from proxy.store.repository import Repository, create_engine
from proxy.web.errors import STATUS, status_of
from symbolize.outcome import Outcome
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, eventually, fast_upstream, read_rest

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


async def test_each_request_of_a_known_mix_is_counted_once_under_its_outcome(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """GETs and HEADs, hits, a cold miss that three more clients join, remembered 404s,
    an upstream's error, timeout, lie and cut body, malformed requests and a client that
    leaves mid-file: /metrics says exactly what was sent, each request once, the joins, and
    which upstream failed how."""
    faults.first_byte_delay = 2.0

    def own(mode: str, **kw: float) -> TenantConfig:
        return TenantConfig(upstreams=(fast_upstream(faults.url_for(mode), retries=0, **kw),))

    sg = await start_symgate([faults.url_for("ok")], tenants={
        "err": own("status500"), "slow": own("slow-first-byte", first_byte_timeout_s=0.3),
        "liar": own("wrong-bytes"), "cut": own("truncated"), "held": own("held")})
    prog, big = f"/buildid/{elfs.prog.build_id}", f"/buildid/{elfs.big.build_id}/debuginfo"
    async with aiohttp.ClientSession() as s:

        async def get(path: str, tenant: str = "", method: str = "GET") -> int:
            async with s.request(method, sg.url + path, headers={"X-Scope-OrgID": tenant}) as r:
                await read_rest(r)
                return r.status

        assert await get(f"{prog}/debuginfo") == 200
        await sg.settled()
        assert [await get(f"{prog}/debuginfo", method=m) for m in ("GET", "GET", "HEAD")] \
            == [200] * 3
        assert [await get(f"/buildid/{'ab' * 20}/debuginfo", method=m)
                for m in ("GET", "GET", "HEAD", "GET")] == [404] * 4
        assert [await get(f"{prog}/executable", t) for t in ("err", "err", "slow", "liar")] \
            == [502, 502, 504, 502]
        assert await get(f"/buildid/{elfs.other.build_id}/debuginfo", "cut") == 200  # cut
        assert [await get(p) for p in ("/buildid/xyz/debuginfo", f"{prog}/nonsense")] \
            == [400, 400]
        first = await s.get(sg.url + big, headers={"X-Scope-OrgID": "held"})
        await faults.held_half_sent.wait()
        followers = [await s.get(sg.url + big, headers={"X-Scope-OrgID": "held"})
                     for _ in range(3)]
        for r in followers:  # joined: the first half reaches them while the rest is held
            await r.content.readexactly(elfs.big.debug.stat().st_size // 2 - 1)
        faults.release.set()
        for r in (first, *followers):
            assert r.status == 200 and not (await read_rest(r))[2]
            r.release()
        await sg.settled()
        # Cached now (the tenant's): a client that leaves mid-file.
        async with s.get(sg.url + big, headers={"X-Scope-OrgID": "held"}) as r:
            await r.content.readexactly(65536)
            r.connection.transport.abort()  # type: ignore[union-attr]

    async def cut_counted() -> bool:
        return await sg.metric("symgate_requests_total", endpoint="buildid",
                               kind="debuginfo", outcome="aborted") == 2

    await eventually(cut_counted)
    samples = await sg.metrics()
    counted = {f"{dict(k)['kind']}/{dict(k)['outcome']}": v
               for (name, k), v in samples.items()
               if name == "symgate_requests_total" and v}
    assert counted == {"debuginfo/miss": 5, "debuginfo/hit": 3, "debuginfo/not_found": 1,
                       "debuginfo/negative_hit": 3, "executable/upstream_error": 2,
                       "executable/timeout": 1, "executable/malformed": 1,
                       "debuginfo/aborted": 2, "debuginfo/rejected": 1,
                       "invalid/rejected": 1}
    upstream = {f"{dict(k)['upstream']}/{dict(k)['result']}": v
                for (name, k), v in samples.items()
                if name == "symgate_upstream_requests_total" and v}
    assert upstream == {f"{faults.url_for('ok')}/ok": 1, f"{faults.url_for('ok')}/not_found": 1,
                        "tenant:err#1/upstream_error": 2, "tenant:slow#1/timeout": 1,
                        "tenant:liar#1/ok": 1, "tenant:cut#1/ok": 1, "tenant:held#1/ok": 1}
    assert await sg.metric("symgate_singleflight_joins_total") == 3
    assert await sg.metric("symgate_verification_failures_total", kind="executable",
                           reason="build_id_mismatch", upstream="tenant:liar#1") == 1
    assert await sg.metric("symgate_upstream_body_failures_total", result="upstream_error",
                           upstream="tenant:cut#1") == 1
