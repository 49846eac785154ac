"""What hits on recently served files need, kept in memory: their response headers, and the
bytes of the small ones.

A commit of a cached artifact never changes under its key (a new fetch follows a removal), so
a hit on a file seen before needs no stat(2) and no read: HEAD is answered from memory alone,
and a small file's GET too. An entry is of one commit (the row's fetched_at), read from that
commit's file (is_commit: another process may have put another at its path first), and
answers only a hit on that commit. Entries go when the cache removes their file (the eviction
listener); one that another process evicted meanwhile still holds the right bytes. One that
another process deleted or replaced (an upload's DELETE, an upload over a download) goes
when this process applies that process's notice (proxy.artifacts.purges; the cache's
`forgotten` listener).
"""

from __future__ import annotations

import email.utils
import hashlib
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

from aiohttp import web

from proxy.artifacts.index import CachedArtifact, key_hash
from proxy.headers import UPLOAD_SHA256
from proxy.keys import ArtifactKey
from proxy.sources.debuginfod import IMA_SIGNATURE
from proxy.store.disk import renamed_after
from proxy.store.repository import ArtifactRecord

# Bytes of small files kept, per serving process.
HOT_BYTES = 32 * 1024 * 1024
HOT_ENTRIES = 16384
# Hits up to this size are read and sent from memory rather than with sendfile.
SMALL_FILE_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class HotFile:
    headers: dict[str, str]  # with Content-Length: what HEAD answers
    body: bytes | None  # a small file's bytes; None for a file sent with sendfile
    # The header lines, encoded once: what proxy.web.fast_hits writes before Date and Server.
    head: bytes = b""
    # The commit of the key it was read from (its row's fetched_at); None for no file's.
    fetched_at: datetime | None = None
    # The file it was read from (inode_of); None for no file's.
    inode: tuple[int, int, int, int] | None = None

    def describes(self, fd: int) -> bool:
        """Whether the file open on `fd` is the one these headers were read from: another
        process may have put another commit of the key at its path (an upload over a
        download, a fetch after a purge) before this one's index hears of it, and that file's
        first Content-Length bytes, sent under these headers, would be a body that looks
        whole and is neither file. Its inode, not its ETag: a file fetched again has the
        upstream's time, and of the same size, the same ETag."""
        return inode_of(os.fstat(fd)) == self.inode


def inode_of(st: os.stat_result) -> tuple[int, int, int, int]:
    """Which file `st` is, as far as a commit goes: each commit is a new file renamed into
    place, whose inode number is another, or, reused once the old file went, comes with its
    own time (an upload's, to the nanosecond) or size; only a fetch again of the very same
    upstream file may look alike, and its headers are the same."""
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def is_commit(fd: int, artifact: CachedArtifact) -> bool | None:
    """Whether the file open on `fd` is the hit's commit, as far as its row tells without
    reading a big file: another process may have put another file of the same size there,
    which this one's index is not told of yet. One renamed into place after the row's commit
    may be: a small one's bytes are then checked against the row's sha256; a big one's only
    SQL can tell (None; ArtifactCache.still_current). Blocking: a small file may be read."""
    st = os.fstat(fd)
    if st.st_size != artifact.record.size:
        return False
    if not renamed_after(st, artifact.record.fetched_at):
        return True
    if st.st_size > SMALL_FILE_BYTES:
        return None
    return hashlib.sha256(os.pread(fd, st.st_size, 0)).hexdigest() == artifact.record.sha256


def hot_file(headers: dict[str, str], body: bytes | None, fetched_at: datetime | None = None,
             inode: tuple[int, int, int, int] | None = None) -> HotFile:
    # UTF-8, as aiohttp encodes headers (their values were made printable when stored).
    return HotFile(headers, body, "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode(),
                   fetched_at, inode)


# What an artifact answer (a file, or a failure: a 404 is cacheable by default) varies on: a
# tenant's request (its token, or X-Scope-OrgID) may be answered with its own file, or its own
# miss, where the same URL gives others the shared one; an HTTP cache in front of symgate must
# not give one the other's.
ARTIFACT_VARY = "Authorization, X-Scope-OrgID"


def private_to_asker(request: web.BaseRequest) -> dict[str, str]:
    """The header that makes an artifact answer its asker's alone, where the request says who
    sends it (a bearer token, a tenant's name): `Cache-Control: private`, where `public` let a
    shared HTTP cache in front of symgate store it, though the request had a bearer token,
    and give it to anyone asking the same URL (a tenant's own file, or past a site's token
    wall). Empty for an anonymous request."""
    if "Authorization" in request.headers or "X-Scope-OrgID" in request.headers:
        return {"Cache-Control": "private"}
    return {}


def artifact_headers(
    size: int | None, filename: str, archive: str | None, ima_signature: str | None = None,
    upload_sha256: str | None = None,
) -> dict[str, str]:
    """The debuginfod headers of an artifact's response, a hit's or a download's;
    `upload_sha256`, an upload's (UPLOAD_SHA256)."""
    headers = {"Content-Type": "application/octet-stream", "Cache-Control": "public",
               "Vary": ARTIFACT_VARY, "X-DEBUGINFOD-FILE": filename}
    if size is not None:
        headers["X-DEBUGINFOD-SIZE"] = str(size)
    if archive:
        headers["X-DEBUGINFOD-ARCHIVE"] = archive
    if ima_signature:
        headers[IMA_SIGNATURE] = ima_signature
    if upload_sha256:
        headers[UPLOAD_SHA256] = upload_sha256
    return headers


def record_headers(rec: ArtifactRecord) -> dict[str, str]:
    """artifact_headers of a committed file's row."""
    return artifact_headers(rec.size, rec.filename, rec.archive, rec.ima_signature,
                            rec.sha256 if rec.pinned else None)


def etag(st: os.stat_result) -> str:
    """FileResponse's ETag of the file of `st`: its time and size."""
    return f'"{st.st_mtime_ns:x}-{st.st_size:x}"'


def file_headers(artifact: CachedArtifact, st: os.stat_result) -> dict[str, str]:
    """What FileResponse says of a file, for the responses that do without it."""
    headers = record_headers(artifact.record)
    headers.update({
        "ETag": etag(st),
        # Rounded up, as FileResponse says it: a file written at 100.5 s (one whose upstream
        # gave no date, an upload) was 100 s here and 101 s there, and a client resuming with
        # If-Range and the date a range's answer told it got the whole file again.
        "Last-Modified": email.utils.formatdate(math.ceil(st.st_mtime), usegmt=True),
        "Accept-Ranges": "bytes",
    })
    return headers


class HotFiles:
    def __init__(self, max_bytes: int = HOT_BYTES, max_entries: int = HOT_ENTRIES) -> None:
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._entries: OrderedDict[str, HotFile] = OrderedDict()
        self._bytes = 0

    def get(self, kh: str, fetched_at: datetime) -> HotFile | None:
        """The entry of the key's commit fetched at `fetched_at` (the index's hit): one read
        from another commit (the key removed and committed again by another process, this
        one's index told, its entry here not) is not its answer."""
        hot = self._entries.get(kh)
        if hot is None or hot.fetched_at != fetched_at:
            return None
        self._entries.move_to_end(kh)
        return hot

    def load(self, kh: str, artifact: CachedArtifact) -> HotFile | None:
        """A hit's headers (FileResponse's), and a small file's bytes, read here and kept: a
        read of a few pages costs less than FileResponse's two trips to the thread pool and
        sendfile's setup, which dominated the cost of small hits. Read at once, with no await
        in between, so eviction cannot pull the file away halfway. None when the file is gone
        or could not be read whole, or may not be the hit's commit (another process replaced
        it, and this one's index is not told yet; see is_commit): aiohttp's path then finds
        what it is, and nothing is kept. Whether it is, is judged here, once per commit: a
        hit's later requests take the entry, or its inode (describes)."""
        try:
            fd = os.open(artifact.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return self.read(kh, artifact, fd)
        finally:
            os.close(fd)

    def read(self, kh: str, artifact: CachedArtifact, fd: int, *, vouched: bool = False
             ) -> HotFile | None:
        """load's entry, of the file open on `fd`; `vouched`: SQL has told that a big one is
        the hit's commit (ArtifactCache.still_current)."""
        try:
            st = os.fstat(fd)
            small = st.st_size <= SMALL_FILE_BYTES
            body = os.pread(fd, SMALL_FILE_BYTES + 1, 0) if small else None
        except OSError:
            return None
        if body is not None and len(body) != st.st_size:  # changed by another process
            return None
        if st.st_size != artifact.record.size:
            return None
        # As is_commit judges, with a small file's bytes at hand: hashed only when in doubt,
        # as a hash of 256 KiB costs several reads of it.
        if not vouched and renamed_after(st, artifact.record.fetched_at) and (
                body is None or hashlib.sha256(body).hexdigest() != artifact.record.sha256):
            return None
        hot = hot_file({**file_headers(artifact, st), "Content-Length": str(st.st_size)}, body,
                       artifact.record.fetched_at, inode_of(st))
        self.put(kh, hot)
        return hot

    def put(self, kh: str, hot: HotFile) -> None:
        self._drop(kh)
        self._entries[kh] = hot
        self._bytes += len(hot.body or b"")
        while len(self._entries) > self._max_entries or self._bytes > self._max_bytes:
            self._drop(next(iter(self._entries)))

    async def forget(self, scope: str, key: ArtifactKey) -> None:
        """The cache's eviction (and forgotten-version) listener."""
        self._drop(key_hash(scope, key))

    def _drop(self, kh: str) -> None:
        old = self._entries.pop(kh, None)
        if old is not None:
            self._bytes -= len(old.body or b"")
