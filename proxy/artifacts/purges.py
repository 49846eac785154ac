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

Notices are read by id. Two purges committed at once on PostgreSQL may take ids in one order
and commit in the other; a poll between the commits then skips the first's notice on the
processes that ran it. Purges are rare operator commands; the skipped file is still gone
from SQL, and is dropped at that replica's next start or when found stale on a request.
Uploads' notices of one data dir cannot cross so: each is left under the upload lock
(proxy.artifacts.uploads), its transaction done before the next one's starts.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from proxy.artifacts.index import ArtifactCache
from proxy.store.repository import Repository

log = logging.getLogger(__name__)
NOTICE_KEEP = timedelta(days=1)


class PurgeNotices:
    def __init__(self, repo: Repository, cache: ArtifactCache) -> None:
        self._repo = repo
        self._cache = cache
        self._seen = 0  # the newest notice applied (ids only grow)

    async def start(self) -> None:
        """Take the notices already there as applied; call it before the index loads. Their
        rows are gone, so the index will not load their files (and a file fetched again since
        must not be removed)."""
        self._seen = await self._repo.newest_purge_notice()
        await self._repo.delete_purge_notices(datetime.now(UTC) - NOTICE_KEEP)

    async def poll(self) -> int:
        """Apply the notices that came since the last poll; how many."""
        notices = await self._repo.purge_notices(self._seen)
        for notice in notices:
            await self._cache.purged(notice)
            self._seen = notice.id
        if notices:
            log.info("applied %d purges (by an operator, or of uploads deleted or "
                     "replaced)", len(notices))
            await self._repo.delete_purge_notices(datetime.now(UTC) - NOTICE_KEEP)
        return len(notices)
