"""What `symgate cache ...` and `symgate negative ...` do: look at and edit the cache and the
remembered misses, in SQL and on disk, with the server running or not.

Listings and stats are of this data dir's replica (proxy.store.replica); a purge reaches
every replica sharing the database: their rows go now, and each running process removes its
own copy within `cache.purge_poll_s` (a replica that is down, at its next start), and the
shared bucket's copies ([storage]) go with them. Every
process trusts its in-memory copy of a cleared miss for at most `negative.memo_s` seconds.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

from proxy.config import Config
from proxy.keys import ArtifactKey, normalize_build_id
from proxy.store.disk import DiskStore
from proxy.store.replica import replica_id
from proxy.store.repository import ArtifactRecord, Repository, aware, create_engine
from symbolize.outcome import Outcome


@dataclass(frozen=True)
class CacheStats:
    entries: int
    bytes: int
    max_bytes: int
    by_kind: dict[str, tuple[int, int]]  # kind -> (entries, bytes)
    hits: int
    symbol_tables: int
    pinned_entries: int  # uploads: not in entries and bytes, which the LRU budget holds
    pinned_bytes: int
    upload_max_bytes: int


@dataclass(frozen=True)
class NegativeRow:
    key: str
    upstream: str
    misses: int
    first_seen: datetime
    expires_at: datetime

    @property
    def live(self) -> bool:
        return self.expires_at > datetime.now(UTC)


def _one_or_every(build_id: str | None) -> str | None:
    """The build ID an admin command is about; None (not given): every one. An empty one is
    no build ID (InvalidRequest): `cache purge "$ID"` with $ID unset purged the whole cache,
    uploads too, which only --all may."""
    return None if build_id is None else normalize_build_id(build_id)


class Admin:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.repo = Repository(create_engine(config.database_url, config.database.timeout_s),
                               replica=replica_id(config.cache_dir))
        self.store = DiskStore(config.cache_dir, config.server.data_dir / "symtabs")

    async def close(self) -> None:
        await self.repo.close()

    async def artifacts(self, build_id: str | None = None, *, every_replica: bool = False
                        ) -> list[ArtifactRecord]:
        bid = _one_or_every(build_id)
        return list(await self.repo.artifacts_of(bid, every_replica=every_replica))

    async def stats(self) -> CacheStats:
        every = await self.repo.artifacts_of(None, every_replica=False)
        rows = [r for r in every if not r.pinned]
        pinned = [r for r in every if r.pinned]
        counts: Counter[str] = Counter()
        sizes: Counter[str] = Counter()
        for r in rows:
            counts[r.kind] += 1
            sizes[r.kind] += r.size
        tables = self.store.count_symtabs()
        return CacheStats(len(rows), sum(r.size for r in rows), self.config.cache.max_bytes,
                          {k: (counts[k], sizes[k]) for k in sorted(counts)},
                          sum(r.hits for r in rows), tables, len(pinned),
                          sum(r.size for r in pinned), self.config.upload.max_bytes)

    async def purge(self, build_id: str | None) -> list[ArtifactRecord]:
        """Delete cached artifacts (of one build ID, or all) and their symbol tables, on every
        replica: each replica's copy is listed once per replica."""
        bid = _one_or_every(build_id)
        # Under the data dir's upload lock, which a serving process holds from a commit's
        # file rename to its row: an upload of a purged key committed between this purge's
        # rows and its files had its new file removed, after its PUT was told 201.
        lock = await asyncio.to_thread(self.store.upload_lock)
        try:
            rows = await self.artifacts(bid, every_replica=True)
            # Rows first, then files: a purge killed in between (a Ctrl-C in a long --all)
            # leaves files without rows, which the serving processes remove by the notices
            # and a start by itself, never rows naming files that are gone, which a PUT of
            # the same upload again took for the file being there (200, and nothing on disk).
            await self.repo.purge_artifacts(rows, datetime.now(UTC))
            for rec in rows:
                self.store.remove_artifact(rec.scope, ArtifactKey.from_id(rec.key))
        finally:
            if lock is not None:
                os.close(lock)
        # And those built from a local tree's file (symbolize.debug_dirs), which is read where
        # it lies, never cached: no artifact leads to them, and a tree's file replaced (one
        # without DWARF by the whole one) was otherwise never built again.
        tables = {(r.scope, r.build_id) for r in rows} \
            | set(await self.repo.symbol_tables_of(bid, Outcome.OK))
        await self.repo.delete_symbol_tables(tables)
        for scope, table_bid in tables:
            self.store.remove_symtab(scope, table_bid)
        await self._purge_bucket(bid)
        return list({r.key_hash: r for r in rows}.values())  # each artifact once

    async def forget_failed_builds(self, build_id: str | None) -> int:
        """Forget the symbol-table builds that failed (of one build ID, or all), which are
        otherwise believed for hours (symbolize.malformed_retry_s...): a debug tree fixed, the
        next profile builds again. How many were forgotten."""
        bid = _one_or_every(build_id)
        return await self.repo.delete_symbol_tables_but(Outcome.OK, bid)

    async def _purge_bucket(self, build_id: str | None) -> None:
        """The shared bucket's copies too (artifacts and symbol tables): their rows now, their
        objects if the bucket answers (a rowless object is never read)."""
        if self.config.storage is None:
            return
        from prometheus_client import CollectorRegistry

        from proxy.bucket.objects import Bucket
        from proxy.bucket.tier import SharedTier
        from proxy.health import Health
        from proxy.metrics import ProxyMetrics

        metrics = ProxyMetrics(CollectorRegistry())
        tier = SharedTier(Bucket(self.config.storage, metrics, Health()), self.repo,
                          self.config.storage, metrics, self.repo.replica)
        await tier.forget(await self.repo.bucket_objects_of(build_id))

    async def negatives(self, build_id: str | None = None) -> list[NegativeRow]:
        bid = _one_or_every(build_id)
        return [NegativeRow(n.key, n.upstream, n.misses, aware(n.first_seen),
                            aware(n.expires_at)) for n in await self.repo.negatives_of(bid)]

    async def clear_negatives(self, build_id: str | None) -> int:
        return await self.repo.delete_negatives(_one_or_every(build_id))
