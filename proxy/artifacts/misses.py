"""Remembered misses: which upstreams said 404 for a key, until when.

Rows are per upstream, so a key is a negative hit only while every upstream in the list being
asked has a live 404 for it; an upstream added to the config is asked at once, and one that
answered 404 is not asked again while another upstream is down. A short in-memory memo in front
of SQL makes repeated negative hits cost no SQL round trip.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from proxy.artifacts.index import key_hash
from proxy.config import NegativeConfig
from proxy.keys import ArtifactKey
from proxy.store.repository import Repository

_MEMO_MAX = 100_000


class NegativeCache:
    def __init__(self, repo: Repository, cfg: NegativeConfig) -> None:
        self._repo = repo
        self._cfg = cfg
        # key hash -> (upstreams with a live 404, monotonic time the memo is good until)
        self._memo: OrderedDict[str, tuple[frozenset[str], float]] = OrderedDict()

    def memo_covers(self, key: ArtifactKey, upstreams: Iterable[str]) -> bool:
        """True when memory alone proves every upstream said 404: the fast path."""
        entry = self._memo.get(key_hash(key))
        return (
            entry is not None
            and entry[1] > time.monotonic()
            and entry[0].issuperset(upstreams)
        )

    async def live(self, key: ArtifactKey) -> frozenset[str]:
        """Upstreams that have a live 404 for this key."""
        kh = key_hash(key)
        now = time.monotonic()
        entry = self._memo.get(kh)
        if entry is not None and entry[1] > now:
            return entry[0]
        wall = datetime.now(UTC)
        rows = await self._repo.get_negatives(kh)
        live = [r for r in rows if r.expires_at > wall]
        names = frozenset(r.upstream for r in live)
        if names:
            soonest = min(r.expires_at for r in live)
            good_until = now + min(self._cfg.memo_s, (soonest - wall).total_seconds())
            self._remember(kh, names, good_until)
        else:
            self._memo.pop(kh, None)
        return names

    def _remember(self, kh: str, names: frozenset[str], good_until: float) -> None:
        self._memo[kh] = (names, good_until)
        self._memo.move_to_end(kh)
        while len(self._memo) > _MEMO_MAX:
            self._memo.popitem(last=False)

    async def record(self, key: ArtifactKey, upstreams: Iterable[str]) -> float:
        """Remember a 404 from each of `upstreams`; returns the shortest TTL given."""
        kh = key_hash(key)
        wall = datetime.now(UTC)
        previous = {r.upstream: r for r in await self._repo.get_negatives(kh)}
        shortest = self._cfg.not_found_ttl_s
        recorded: set[str] = set()
        for name in upstreams:
            prev = previous.get(name)
            misses = prev.misses + 1 if prev else 1
            ttl = min(
                self._cfg.not_found_initial_ttl_s * 2 ** (misses - 1), self._cfg.not_found_ttl_s
            )
            shortest = min(shortest, ttl)
            await self._repo.put_negative(
                key_hash=kh, key=key.id, build_id=key.build_id, upstream=name, status=404,
                misses=misses, first_seen=wall, expires_at=wall + timedelta(seconds=ttl),
            )
            recorded.add(name)
        if recorded:
            live = {n for n, r in previous.items() if r.expires_at > wall} | recorded
            self._remember(kh, frozenset(live), time.monotonic() + min(self._cfg.memo_s, shortest))
        return shortest

    def forget(self, key: ArtifactKey) -> None:
        self._memo.pop(key_hash(key), None)

    async def expire(self) -> int:
        # Rows stay a while past expiry so a repeated miss can still grow its TTL.
        return await self._repo.delete_expired_negatives(
            datetime.now(UTC), keep_misses_s=4 * self._cfg.not_found_ttl_s
        )
