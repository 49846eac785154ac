"""Remembered misses: which upstreams said 404 for a key in a scope, until when.

Rows are per upstream, so a key is a negative hit only while every upstream in the list being
asked has a live 404 for it; an upstream added to the config is asked at once, and one that
answered 404 is not asked again while another upstream is down. A short in-memory memo in front
of SQL makes repeated negative hits cost no SQL round trip.

Both clocks are injected: tests move time instead of sleeping.

A row's expiry is wall-clock time, which can step back (an NTP correction, a VM restored from a
snapshot): a row is believed for no longer from now than the time its count of misses is given
now, so that a step back of a day does not have a miss remembered for a day, and a lowered TTL
applies to the rows already written. Such a row is asked again, and written again by the clock
of now.

SQL failing (a database that is down, a full disk) never turns a fetchable artifact into an
error: a lookup that fails counts as "nothing remembered", and a miss that cannot be written
is remembered in memory only.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta

from proxy.artifacts.index import key_hash
from proxy.expiry import Expiry
from proxy.keys import ArtifactKey
from proxy.store.repository import DATABASE_ERRORS, NegativeRecord, Repository
from symbolize.outcome import Outcome

log = logging.getLogger(__name__)
def _utc_now() -> datetime:
    return datetime.now(UTC)


def _log_sql_failure(doing: str, error: BaseException) -> None:
    log.warning("SQL failed %s (%s); going on without it", doing, type(error).__name__)


class RememberedMisses:
    def __init__(
        self, repo: Repository, expiry: Expiry, *, memo_s: float, memo_entries: int,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = _utc_now,
    ) -> None:
        self._repo = repo
        self._expiry = expiry
        self._memo_s = memo_s
        self._memo_entries = memo_entries
        self._monotonic = monotonic
        self._wall = wall
        # key hash -> (upstreams with a live 404, monotonic time the memo is good until)
        self._memo: OrderedDict[str, tuple[frozenset[str], float]] = OrderedDict()
        # Told of each failed query (what was being done, the error); logs it by default.
        self.sql_failed: Callable[[str, BaseException], None] = _log_sql_failure

    def memo_covers(self, scope: str, key: ArtifactKey, upstreams: Iterable[str]) -> bool:
        """True when memory alone proves every upstream said 404: the fast path."""
        entry = self._memo.get(key_hash(scope, key))
        return (
            entry is not None
            and entry[1] > self._monotonic()
            and entry[0].issuperset(upstreams)
        )

    async def live(self, scope: str, key: ArtifactKey) -> frozenset[str]:
        """Upstreams that have a live 404 for this key."""
        kh = key_hash(scope, key)
        now = self._monotonic()
        entry = self._memo.get(kh)
        if entry is not None and entry[1] > now:
            return entry[0]
        wall = self._wall()
        try:
            rows = await self._repo.get_negatives(kh)
        except DATABASE_ERRORS as e:
            self.sql_failed("reading remembered misses", e)
            return frozenset()
        if (newer := self._memo.get(kh)) is not entry and newer is not None:
            # A miss was recorded while SQL was read: the read is older than the memo.
            return newer[0]
        live = [r for r in rows if self._believed(r, wall)]
        names = frozenset(r.upstream for r in live)
        if names:
            soonest = min(r.expires_at for r in live)
            good_until = now + min(self._memo_s, (soonest - wall).total_seconds())
            self._remember(kh, names, good_until)
        else:
            self._memo.pop(kh, None)
        return names

    def _believed(self, row: NegativeRecord, wall: datetime) -> bool:
        """Whether `row` is live at `wall` (Expiry.believed): its count of misses says for
        how long."""
        return self._expiry.believed(row.outcome, row.expires_at, wall, row.misses)

    def _remember(self, kh: str, names: frozenset[str], good_until: float) -> None:
        self._memo[kh] = (names, good_until)
        self._memo.move_to_end(kh)
        while len(self._memo) > self._memo_entries:
            self._memo.popitem(last=False)

    async def record(self, scope: str, key: ArtifactKey, upstreams: Iterable[str],
                     outcome: Outcome = Outcome.NOT_FOUND) -> float | None:
        """Remember `outcome` from each of `upstreams`; the shortest time given, or None when
        the outcome is not one to remember."""
        if self._expiry.seconds(outcome) is None:
            return None
        kh = key_hash(scope, key)
        wall = self._wall()
        try:
            previous = {r.upstream: r for r in await self._repo.get_negatives(kh)}
        except DATABASE_ERRORS as e:
            self.sql_failed("reading remembered misses", e)
            previous = {}  # the count starts again: a shorter TTL, never a wrong answer
        shortest: float | None = None
        recorded: set[str] = set()
        for name in upstreams:
            prev = previous.get(name)
            misses = prev.misses + 1 if prev else 1
            ttl = self._expiry.seconds(outcome, misses)
            assert ttl is not None
            shortest = ttl if shortest is None else min(shortest, ttl)
            try:
                await self._repo.put_negative(
                    key_hash=kh, scope=scope, key=key.id, build_id=key.build_id,
                    upstream=name, outcome=outcome, misses=misses, first_seen=wall,
                    expires_at=wall + timedelta(seconds=ttl),
                )
            except DATABASE_ERRORS as e:  # this process's memo still remembers it
                self.sql_failed("remembering a miss", e)
            recorded.add(name)
        if recorded and shortest is not None:
            live = {n for n, r in previous.items() if self._believed(r, wall)} | recorded
            self._remember(kh, frozenset(live), self._monotonic() + min(self._memo_s, shortest))
        return shortest

    def forget(self, scope: str, key: ArtifactKey) -> None:
        self._memo.pop(key_hash(scope, key), None)

    async def expire(self) -> int:
        # Rows stay a while past expiry so a repeated miss can still grow its time.
        return await self._repo.delete_expired_negatives(
            self._wall(), keep_misses_s=4 * self._expiry.not_found_max_s
        )
