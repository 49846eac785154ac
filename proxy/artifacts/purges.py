"""`cache purge` reaching every replica: each serving process polls the notices a purge
leaves in SQL (Repository.purge_artifacts) and removes its own copy of each purged file.

An upload's DELETE, and an upload that replaces a download, leave a notice too
(Repository.retire_artifact), of the one version they removed: the other serving processes
on the data dir hold it in memory (the index, and a small file's bytes in proxy.web.hot_files)
and would go on serving it. Such a notice removes that version only (ArtifactCache.purged):
a re-upload of the key made before the notice is applied stays.

The purge itself deletes every replica's rows, so a replica that is down removes its copies
as rowless files at its next start; the notices are for the processes that are running,
whose memory still holds the file. Notices older than NOTICE_KEEP are deleted (at a start,
or with newer ones): by then every running process has applied them (one poll every
cache.purge_poll_s).

Notices are read by id. Two notices committed at once on PostgreSQL (purges, or uploads
deleted on two replicas) may take ids in one order and commit in the other: a poll between
the commits reads the second only. The ids it passed over are looked for again by every poll
for GAP_WAIT_S (a transaction that took one and has not committed yet), then given up (a
transaction rolled back leaves its id unused for ever). A process that starts between such
commits looks for the ids missing below the newest notice alike.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta

from proxy.artifacts.index import ArtifactCache
from proxy.errors import InvalidRequest
from proxy.store.repository import Repository

log = logging.getLogger(__name__)
NOTICE_KEEP = timedelta(days=1)
# How long an id passed over may still come: far longer than a notice's transaction lasts.
GAP_WAIT_S = 60.0
# Ids passed over at once past which they are not waited for: not a transaction in flight
# but a sequence that jumped (PostgreSQL's, after a crash), whose ids never come.
MAX_GAP = 1000


class PurgeNotices:
    def __init__(self, repo: Repository, cache: ArtifactCache) -> None:
        self._repo = repo
        self._cache = cache
        self._seen = 0  # the newest notice applied (ids only grow)
        # Ids below it that no poll has read yet, and when they were first passed over.
        self._gaps: dict[int, float] = {}

    async def start(self) -> None:
        """Take the notices already there as applied; call it before the index loads. Their
        rows are gone, so the index will not load their files (and a file fetched again since
        must not be removed). The ids missing below the newest that a transaction may still
        commit are looked for as poll() looks for those it passed over: taken as applied,
        such a purge committed after the index loaded its rows was never applied here.

        Every id missing of the last MAX_GAP, for GAP_WAIT_S from now: a notice's purged_at
        is its replica's clock, and one slow by more than GAP_WAIT_S (or this one fast) made a
        notice committed a moment ago look settled, and the id in flight below it given up.
        Those long deleted or rolled back cost a few polls reading the notices above them."""
        newest = await self._repo.newest_purge_notice()
        floor = max(newest - MAX_GAP - 1, 0)
        present = {n.id for n in await self._repo.purge_notices(floor)}
        now = time.monotonic()
        self._gaps = {i: now for i in range(floor + 1, newest) if i not in present}
        self._seen = newest
        await self._repo.delete_purge_notices(datetime.now(UTC) - NOTICE_KEEP)

    async def poll(self) -> int:
        """Apply the notices that came since the last poll, and those passed over before that
        have come since; how many. Each is applied once: a purge applied again would remove a
        file fetched since."""
        now = time.monotonic()
        self._gaps = {i: t for i, t in self._gaps.items() if now - t < GAP_WAIT_S}
        after = min(self._gaps, default=self._seen + 1) - 1
        notices = [n for n in await self._repo.purge_notices(after)
                   if n.id > self._seen or n.id in self._gaps]
        for notice in notices:  # by id: those passed over first
            try:
                await self._cache.purged(notice)
            except InvalidRequest as e:
                # A key this version cannot read (a newer one's, written while replicas are
                # upgraded one by one): no file of this process is under it. Raised out of
                # the poll, it stopped every notice after it, at every poll, for good.
                log.warning("purge notice %d of %r passed over: %s", notice.id, notice.key,
                            e.reason)
            self._applied(notice.id, now)
        if notices:
            log.info("applied %d purges (by an operator, or of uploads deleted or "
                     "replaced)", len(notices))
            await self._repo.delete_purge_notices(datetime.now(UTC) - NOTICE_KEEP)
        return len(notices)

    def _applied(self, notice: int, now: float) -> None:
        """Note the notice of this id applied: a gap filled, or the newest, the ids it passed
        over (if a transaction's few) to be looked for again."""
        if notice in self._gaps:
            del self._gaps[notice]
            return
        if notice - self._seen - 1 <= MAX_GAP:
            self._gaps.update(dict.fromkeys(range(self._seen + 1, notice), now))
        self._seen = notice
