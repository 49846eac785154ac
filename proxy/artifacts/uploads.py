"""Uploads: a site's own debug files, put by PUT /buildid/ID/debuginfo|executable.

An upload is checked (its build-ID note must be the one in the URL), committed like a fetched
file (fsync, rename, row, sha256) into its uploader's scope, and pinned: never evicted, not
counted against cache.max_bytes but against upload.max_bytes. Its symbol table is built as for
any committed file, and remembered misses of its key are forgotten, so the next request finds it.

Every process on the data dir commits and removes uploads under one flock (cache/uploads.lock):
concurrent PUTs of one key end with one whole file and its own row, and the budget is judged
from SQL with no other upload between the check and the commit.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from proxy.artifacts.index import key_hash
from proxy.artifacts.scope import SHARED
from proxy.artifacts.service import ArtifactService
from proxy.config import UploadConfig
from proxy.errors import (
    Conflict,
    InsufficientStorage,
    NotFound,
    OutOfResources,
    PayloadTooLarge,
    RequestTimeout,
    UnprocessableUpload,
    UploadBudgetFull,
    out_of_descriptors,
)
from proxy.health import DISK
from proxy.keys import ArtifactKey, Kind
from proxy.store.repository import DATABASE_ERRORS, ArtifactRecord, Repository, is_disk_full
from symbolize.elf import build_id_of_file, layout_of_file

log = logging.getLogger(__name__)
UPSTREAM = "upload"  # what the artifact's row names as where it came from
ELF_MAGIC = b"\x7fELF"
# Room made beyond the bytes at hand on a full disk: SQLite's pages for the upload's row, on
# the same disk where it is the data dir's.
ROW_ROOM = 256 * 1024


@dataclass(frozen=True, slots=True)
class Uploaded:
    size: int
    sha256: str
    created: bool  # False: the very same file was uploaded before


def _debug_only(path: Path) -> bool:
    """Whether the file's sections say its code is not in it (a debug file); blocking. A file
    whose sections cannot tell (none, or no code section: a kernel module's have theirs) is
    taken as it is."""
    layout = layout_of_file(path)
    return layout is not None and layout.holds_code is False


class Uploads:
    def __init__(self, service: ArtifactService, repo: Repository, config: UploadConfig
                 ) -> None:
        self._service = service
        self._cache = service.cache
        self._repo = repo
        self._config = config

    async def put(self, scope: str, key: ArtifactKey, body: AsyncIterator[bytes],
                  announced: int | None, filename: str, ima_signature: str | None
                  ) -> Uploaded:
        limit = self._config.max_file_bytes
        if announced is not None and announced > limit:
            raise PayloadTooLarge(f"{announced} bytes; uploads are at most {limit} "
                                  "(upload.max_file_bytes)")
        # What the body may be at most: past it, it is refused as it arrives, before it has
        # evicted cached files for room it was never going to take.
        room = (await self._check_budget(scope, key, announced or 0))[2]
        temp, fd = self._new_temp()
        try:
            size, digest = await self._receive(body, fd, limit, room)
            found = await asyncio.to_thread(build_id_of_file, temp)
            if found != key.build_id:
                raise UnprocessableUpload(
                    f"the file's build ID is {found}, not {key.build_id}" if found
                    else "not an ELF file with a GNU build-ID note")
            if key.kind is Kind.EXECUTABLE and await asyncio.to_thread(_debug_only, temp):
                # Served as the executable, it would give gdb and eu-stack a program with no
                # code to disassemble or unwind through, under the build ID they asked for.
                raise UnprocessableUpload(
                    "a debug file, not the executable: its code is not in it (as objcopy "
                    "--only-keep-debug leaves it); upload it as debuginfo")
            async with self._cache.uploads_locked(budgeted=True):
                return await self._commit(scope, key, temp, fd, size, digest, filename,
                                          ima_signature)
        finally:
            os.close(fd)
            temp.unlink(missing_ok=True)  # gone already once committed

    async def _receive(self, body: AsyncIterator[bytes], fd: int, limit: int, room: int
                       ) -> tuple[int, str]:
        """The body written to `fd`: its size and sha256. A client slower than
        upload.body_timeout_s is cut off (408); one that sends more than it may, at once (413,
        or 507 past the `room` left in upload.max_bytes); one that is no ELF file, at its
        first bytes (422)."""
        digest = hashlib.sha256()
        size = 0
        head = b""
        try:
            async with asyncio.timeout(self._config.body_timeout_s or None):
                async for chunk in body:
                    if size + len(chunk) > limit:
                        raise PayloadTooLarge(f"more than {limit} bytes; uploads are at most "
                                              f"{limit} (upload.max_file_bytes)")
                    if size + len(chunk) > room:
                        raise UploadBudgetFull(
                            f"more than the {room} bytes left of upload.max_bytes "
                            f"{self._config.max_bytes}: delete uploads first")
                    if len(head) < len(ELF_MAGIC):
                        head += chunk[:len(ELF_MAGIC) - len(head)]
                        if not ELF_MAGIC.startswith(head):
                            raise UnprocessableUpload("not an ELF file")
                    await self._write(fd, chunk, size)
                    digest.update(chunk)
                    size += len(chunk)
        except TimeoutError:
            raise RequestTimeout(f"the upload did not arrive within "
                                 f"{self._config.body_timeout_s:g} s") from None
        return size, digest.hexdigest()

    async def _commit(self, scope: str, key: ArtifactKey, temp: Path, fd: int, size: int,
                      digest: str, filename: str, ima_signature: str | None) -> Uploaded:
        old, upload, _ = await self._check_budget(scope, key, size, digest)
        if upload is not None and (self._cache.whole_here(old) if upload is old
                                   else await self._in_bucket(upload)):
            # The same file again (through this replica or another): done.
            return Uploaded(size, digest, created=False)
        if (held := self._held(scope, key, old)) is not None:
            # A download of the same ID in this scope, or this very upload with its file gone
            # or cut short on this disk (it has no upstream to come back from): this upload
            # takes its place, in the other serving processes too, which hold it in memory.
            await self._retire(held, "replacing a damaged copy of an upload" if held.pinned
                               else "replacing a download with an upload")
        elif key.kind in (Kind.DEBUGINFO, Kind.EXECUTABLE):
            # A file new to its scope is the first the scope's requests cut from: cuts it
            # held were of another scope's file (a tenant's, of the shared debuginfo, kept in
            # its own scope beside its executable), or of the file's other kind.
            try:
                await self._retire_cuts(key.build_id, scope)
            except DATABASE_ERRORS as e:
                self._cache.sql_failed("uploading", e)
                raise OutOfResources("the database cannot be reached to retire the cuts the "
                                     "upload replaces; retry later") from e
        try:
            final = await asyncio.to_thread(self._cache.store.commit, temp, fd, scope, key)
        except OSError as e:
            raise self._os_failure(e) from e
        now = datetime.now(UTC)
        record = ArtifactRecord(
            key_hash=key_hash(scope, key), scope=scope, key=key.id, build_id=key.build_id,
            kind=str(key.kind), size=size, sha256=digest, upstream=UPSTREAM, filename=filename,
            archive=None, fetched_at=now, last_access=now, hits=0,
            ima_signature=ima_signature, pinned=True)
        try:
            # Not kept for a later flush as a download's row is: until SQL has it, the other
            # serving processes neither serve nor delete it, nor count it in the budget, and
            # a restart removes its file as an orphan, though the PUT was told 201.
            await self._cache.add(record, row_now=True)
        except DATABASE_ERRORS as e:
            # Its row taken back (ArtifactCache.add): the COMMIT may have reached the database
            # with its answer lost (a cut connection).
            self._cache.store.remove_artifact(scope, key)
            if is_disk_full(e):  # SQLite's, on the cache's disk or another
                raise InsufficientStorage("insufficient storage: the database's disk is full"
                                          ) from e
            raise OutOfResources("the database cannot take the upload's row; retry later"
                                 ) from e
        self._service.uploaded(scope)
        if (tier := self._service.tier) is not None:
            # Every replica finds it once the PUT has its answer; a bucket that is down gets
            # it from the catch-up instead.
            with self._cache.lease(scope, key):
                await tier.publish_upload(record, final)
        await self._forget_misses(scope, key)
        for listener in self._service.committed:
            listener(scope, key, None)
        log.info("upload of %s into %s: %d bytes", key.id, scope or "the shared scope", size)
        return Uploaded(size, digest, created=True)

    async def _in_bucket(self, upload: ArtifactRecord) -> bool:
        """Whether another replica's upload of the key is in the bucket, where every replica
        finds it. Its row alone is not enough: that replica may have died between its row and
        its copy (the PUT then had no answer, and is sent again here), and its disk may never
        come back. Taken again here, it is written to the bucket afresh."""
        tier = self._service.tier
        return tier is not None and await tier.holds(upload.key_hash) is True

    async def _check_budget(self, scope: str, key: ArtifactKey, size: int,
                            digest: str | None = None
                            ) -> tuple[ArtifactRecord | None, ArtifactRecord | None, int]:
        """UploadBudgetFull unless `size` more bytes fit upload.max_bytes, counting every
        process's uploads (from SQL) less the upload of this key it would replace; Conflict
        when the key has an upload (on this replica, or, with a bucket, on any: it is the
        cluster's) of another file than `digest` says. The row of this key and scope here, if
        any, the key's upload, if any, and the bytes an upload of the key may have at most."""
        kh = key_hash(scope, key)
        try:
            _, total = await self._repo.totals(pinned=True)
            old = await self._repo.get_artifact(kh)
            upload = old if old is not None and old.pinned else None
            if upload is None and self._service.tier is not None:
                upload = await self._repo.upload_anywhere(kh)
        except DATABASE_ERRORS as e:
            self._cache.sql_failed("judging the upload budget", e)
            raise OutOfResources("the database cannot be reached to judge the upload "
                                 "budget; retry later") from e
        replaced = old.size if old is not None and old.pinned else 0
        if upload is not None and digest is not None and upload.sha256 != digest:
            # Serving processes keep small files' bytes in memory by key: a different file
            # under the same key would leave some answering with the old one.
            raise Conflict(f"a different upload of {key.id} is here; DELETE it first")
        room = self._config.max_bytes - total + replaced
        if size > room:
            raise UploadBudgetFull(
                f"uploads hold {total} bytes of upload.max_bytes {self._config.max_bytes}; "
                f"{size} more do not fit: delete uploads first")
        return old, upload, room

    async def _forget_misses(self, scope: str, key: ArtifactKey) -> None:
        try:
            await self._repo.delete_negatives_of_key(key.id)
        except DATABASE_ERRORS as e:  # the misses then expire by themselves
            self._cache.sql_failed("forgetting remembered misses of an upload", e)
        for s in {scope, ""}:
            self._service.misses.forget(s, key)

    async def delete(self, scope: str, key: ArtifactKey) -> None:
        """Remove the upload of `key` in `scope`; NotFound when there is none (a downloaded
        file is the cache's to evict, not an uploader's to delete)."""
        async with self._cache.uploads_locked(budgeted=True):
            kh = key_hash(scope, key)
            try:
                row = await self._repo.get_artifact(kh)
                upload = self._held(scope, key, row)
                if (upload is None or not upload.pinned) and self._service.tier is not None:
                    # Taken in by another replica (this one has a copy from the bucket, or
                    # none): it is the cluster's, and any replica deletes it.
                    elsewhere = await self._repo.upload_anywhere(kh)
                    if elsewhere is not None:
                        upload = upload if upload is not None \
                            and upload.sha256 == elsewhere.sha256 else elsewhere
                        upload = replace(upload, pinned=True)
            except DATABASE_ERRORS as e:
                self._cache.sql_failed("looking up an upload to delete", e)
                raise OutOfResources("the database cannot be reached to delete the upload "
                                     "everywhere; retry later") from e
            if upload is None or not upload.pinned:
                raise NotFound(f"no upload of {key.id} here")
            if (tier := self._service.tier) is not None:
                # First, so that no replica takes it from the bucket again.
                try:
                    await tier.forget([upload])
                except DATABASE_ERRORS as e:
                    self._cache.sql_failed("deleting an upload from the shared bucket", e)
                    raise OutOfResources("the database cannot be reached to delete the "
                                         "upload everywhere; retry later") from e
            await self._retire(upload, "deleting an upload")

    def _held(self, scope: str, key: ArtifactKey, row: ArtifactRecord | None
              ) -> ArtifactRecord | None:
        """The commit of `key` this replica holds: SQL's row (`row`, read under the upload
        lock), which this process's memory may lag (another process deleted and uploaded the
        key again, and this one has not polled its notice yet); without a row, this
        process's memory (a commit SQL has not taken yet, while it was failing)."""
        if row is not None:
            return row
        hit = self._cache.peek(scope, key)
        return hit.record if hit is not None else None

    async def _retire(self, rec: ArtifactRecord, doing: str) -> None:
        """Remove this version of a key from every serving process and replica (see
        ArtifactCache.retire); OutOfResources, with nothing removed, when SQL cannot take it:
        a removal the other processes were not told of would leave them serving it."""
        try:
            # The sections cut from it are artifacts of their own, in its scope: kept, they
            # went on serving the bytes of an upload deleted with a 204. Cut from this file or
            # from its build ID's other one, which cannot be told apart: all go (first, so that
            # a failure leaves the file itself in place), and the next request cuts again from
            # what is left.
            await self._retire_cuts(rec.build_id, rec.scope)
            await self._cache.retire(rec)
        except DATABASE_ERRORS as e:
            self._cache.sql_failed(doing, e)
            raise OutOfResources(f"the database cannot be reached for {doing} everywhere; "
                                 "retry later") from e

    async def _retire_cuts(self, build_id: str, scope: str) -> None:
        """Retire the sections of `build_id` that may have been cut from a file of `scope`:
        those kept in it, and where it is the shared scope those of every tenant as well,
        which keeps the cuts of the shared file in its own scope once it has a file of its
        own (ArtifactService._section). DATABASE_ERRORS."""
        for cut in await self._repo.artifacts_of(build_id, every_replica=False):
            if cut.kind == Kind.SECTION and scope in (cut.scope, SHARED):
                await self._cache.retire(cut)

    def _new_temp(self) -> tuple[Path, int]:
        try:
            return self._cache.store.new_temp()
        except OSError as e:
            raise self._os_failure(e) from e

    async def _write(self, fd: int, chunk: bytes, offset: int) -> None:
        """On a full disk, least recently used downloads are evicted to make room: a disk full
        of cached files is room for an upload, which a 507 would otherwise wait for until some
        download evicted them. Only for the bytes at hand (and the row's share), where a
        download (ArtifactService._write) takes twice all it has so far: an upload's size is
        not known before its end, and one refused then had cost files it never needed."""
        view = memoryview(chunk)
        for _ in range(8):
            try:
                while view:
                    n = os.pwrite(fd, view, offset)
                    view, offset = view[n:], offset + n
                return
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise self._os_failure(e) from e
                error = e
            if await self._cache.make_room(len(view) + ROW_ROOM) == 0:
                break
        raise self._os_failure(error) from error

    def _os_failure(self, error: OSError) -> Exception:
        """A full disk is a 507 (and /healthz says so); no descriptor left, a 503."""
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            self._cache.health.fail(DISK, f"no space left for an upload ({error})")
            return InsufficientStorage("insufficient storage: the cache's disk is full")
        return out_of_descriptors(error) or error
