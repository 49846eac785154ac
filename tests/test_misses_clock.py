"""Remembered misses against a real SQLite database, with the clocks injected: TTL doubling,
the memo's lifetime, scopes and expiry, without sleeping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proxy.artifacts.index import key_hash
from proxy.artifacts.misses import RememberedMisses
from proxy.expiry import Expiry
from proxy.keys import ArtifactKey, Kind
from proxy.store.disk import DiskStore
from proxy.store.migrate import upgrade
from proxy.store.repository import Repository, SymbolTableRecord, create_engine
from proxy.symbols.table_store import TableStore
from symbolize.outcome import Outcome
from symbolize.symtab import FORMAT

KEY = ArtifactKey("ab" * 20, Kind.DEBUGINFO)
EXPIRY = Expiry(not_found_initial_s=60, not_found_max_s=600, no_symbols_s=600,
                malformed_s=86400)


class Clocks:
    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = datetime(2026, 12, 1, tzinfo=UTC)

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += timedelta(seconds=seconds)


@pytest.fixture
async def repo(tmp_path: Path) -> AsyncIterator[Repository]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'm.sqlite'}"
    await asyncio.to_thread(upgrade, url)
    r = Repository(create_engine(url))
    yield r
    await r.close()


def misses(repo: Repository, clocks: Clocks, memo_s: float = 1.0) -> RememberedMisses:
    return RememberedMisses(repo, EXPIRY, memo_s=memo_s, memo_entries=100,
                            monotonic=lambda: clocks.mono, wall=lambda: clocks.wall)


def test_expiry_doubles_a_repeated_miss_up_to_its_ceiling() -> None:
    assert [EXPIRY.seconds(Outcome.NOT_FOUND, n) for n in (1, 2, 3, 4, 5, 9)] == [
        60, 120, 240, 480, 600, 600]
    assert EXPIRY.seconds(Outcome.MALFORMED) == 86400
    assert EXPIRY.seconds(Outcome.NO_SYMBOLS) == 600
    for never in (Outcome.INTERNAL, Outcome.UNAVAILABLE, Outcome.TIMEOUT, Outcome.UPSTREAM_ERROR,
                  Outcome.DEADLINE, Outcome.REJECTED, Outcome.OK):
        assert EXPIRY.seconds(never) is None


async def test_a_repeated_miss_is_remembered_longer(repo: Repository) -> None:
    clocks = Clocks()
    m = misses(repo, clocks)
    assert await m.record("", KEY, ["u"]) == 60
    assert await m.live("", KEY) == {"u"}
    clocks.advance(59)
    assert await m.live("", KEY) == {"u"}
    clocks.advance(2)
    assert await m.live("", KEY) == frozenset()
    assert await m.record("", KEY, ["u"]) == 120  # the second miss in a row
    clocks.advance(119)
    assert await m.live("", KEY) == {"u"}
    [row] = await repo.get_negatives(key_hash("", KEY))
    assert (row.outcome, row.misses) == ("not_found", 2)


async def test_the_memo_answers_without_sql_only_for_memo_s(repo: Repository) -> None:
    clocks = Clocks()
    m = misses(repo, clocks, memo_s=1.0)
    await m.record("", KEY, ["u", "v"])
    assert m.memo_covers("", KEY, ["u", "v"])
    assert not m.memo_covers("", KEY, ["u", "w"])  # an upstream never asked
    clocks.advance(1.5)
    assert not m.memo_covers("", KEY, ["u"])  # SQL is asked again, as another replica might
    assert await m.live("", KEY) == {"u", "v"}  # ... and it still says so
    assert m.memo_covers("", KEY, ["u"])


async def test_scopes_do_not_share_misses(repo: Repository) -> None:
    clocks = Clocks()
    m = misses(repo, clocks)
    await m.record("tenant", KEY, ["u"])
    assert await m.live("tenant", KEY) == {"u"}
    assert await m.live("", KEY) == frozenset()
    assert not m.memo_covers("", KEY, ["u"])


async def test_failures_of_a_source_are_never_remembered(repo: Repository) -> None:
    m = misses(repo, Clocks())
    assert await m.record("", KEY, ["u"], Outcome.TIMEOUT) is None
    assert await m.record("", KEY, ["u"], Outcome.INTERNAL) is None
    assert await m.live("", KEY) == frozenset()


async def test_long_expired_rows_are_swept(repo: Repository) -> None:
    clocks = Clocks()
    m = misses(repo, clocks)
    await m.record("", KEY, ["u"])
    clocks.advance(60 + 4 * 600 - 1)
    assert await m.expire() == 0  # kept a while, so a repeat can grow its time
    clocks.advance(2)
    assert await m.expire() == 1


async def test_a_wall_clock_stepped_back_does_not_stretch_a_remembered_miss(
    repo: Repository,
) -> None:
    """Expiry is wall-clock time, written into SQL; stepped back an hour (NTP, a restored VM
    snapshot), the clock made a 60 s miss last an hour and a minute. Believed for no longer
    than its time from now, it is asked again, and remembered again by the clock of now."""
    clocks = Clocks()
    m = misses(repo, clocks)
    await m.record("", KEY, ["u"])
    clocks.mono += 2  # past the memo
    clocks.wall -= timedelta(hours=1)
    assert await m.live("", KEY) == frozenset()
    assert await m.record("", KEY, ["u"]) == 120  # the miss repeated: its time grows
    clocks.advance(119)
    assert await m.live("", KEY) == {"u"}
    clocks.advance(2)
    assert await m.live("", KEY) == frozenset()


async def test_a_restart_keeps_each_upstreams_expiry_and_applies_a_lowered_ttl(
    repo: Repository,
) -> None:
    clocks = Clocks()
    await misses(repo, clocks).record("", KEY, ["u"])
    clocks.advance(30)
    await misses(repo, clocks).record("", KEY, ["v"])
    clocks.advance(20)
    restarted = misses(repo, clocks)  # a new process: nothing in memory
    assert await restarted.live("", KEY) == {"u", "v"}
    clocks.advance(11)  # u's 60 s are over, v's are not
    assert await misses(repo, clocks).live("", KEY) == {"v"}
    # The operator lowers the TTL to 10 s: v's 29 s left are not believed after the restart.
    lowered = Expiry(not_found_initial_s=10, not_found_max_s=10, no_symbols_s=600,
                     malformed_s=86400)
    quick = RememberedMisses(repo, lowered, memo_s=1.0, memo_entries=100,
                             monotonic=lambda: clocks.mono, wall=lambda: clocks.wall)
    assert await quick.live("", KEY) == frozenset()
    assert await quick.record("", KEY, ["u", "v"]) == 10
    assert await quick.live("", KEY) == {"u", "v"}


async def test_a_symbol_table_verdict_is_believed_no_longer_from_now_than_its_time(
        repo: Repository, tmp_path: Path) -> None:
    """A build's failure (no symbols, malformed) and a table from an executable alone are kept
    for their outcome's time as wall-clock rows, as misses are: one written before the clock
    stepped back an hour (or under a longer configured time) was believed an hour too long,
    the build ID's mapping left bare or named by its exports alone all that while."""
    store = DiskStore(tmp_path / "cache", tmp_path / "symtabs")
    tables = TableStore(repo, store, EXPIRY)
    now = datetime.now(UTC)

    def row(build_id: str, outcome: Outcome, source_key: str, left_s: float
            ) -> SymbolTableRecord:
        return SymbolTableRecord(
            scope="", build_id=build_id, outcome=outcome, format=FORMAT, source_key=source_key,
            size=0, load_address=0, code_ranges="[]", cold_ranges="[]", has_lines=False,
            file_layout=None, error=None, built_at=now, build_seconds=0.0,
            expires_at=now + timedelta(seconds=left_s))

    for build_id, outcome, left_s, believed in (
            ("a1" * 20, Outcome.NO_SYMBOLS, 590, True),
            ("a2" * 20, Outcome.NO_SYMBOLS, 600 + 3600, False),  # the clock stepped back
            ("a3" * 20, Outcome.MALFORMED, 86000, True),
            ("a4" * 20, Outcome.MALFORMED, 86400 + 3600, False),
            ("a5" * 20, Outcome.NO_SYMBOLS, -1, False)):  # over
        await repo.put_symbol_table(row(build_id, outcome, "debuginfo", left_s))
        found, _from_bucket = await tables.find("", build_id)
        assert (found is not None) == believed, (outcome, left_s)
    # A table from the executable alone: its debug file is asked for again after a first
    # miss's time, 60 s here, however far ahead its row says.
    exe_only = row("b1" * 20, Outcome.OK, "local-executable:/x", 50)
    assert not tables.stale(exe_only)
    assert tables.stale(replace(exe_only, expires_at=now + timedelta(seconds=60 + 3600)))
    assert tables.stale(replace(exe_only, expires_at=now - timedelta(seconds=1)))
