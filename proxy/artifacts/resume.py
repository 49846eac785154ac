"""A copy read from the shared bucket that breaks off is finished from an upstream, so the
client's response goes on instead of being cut: the bucket failing mid-body costs a second
request, never a broken transfer.

The upstream's body is read from its start (debuginfod servers answer no ranges); the bytes
already sent are checked against the upstream's own first bytes before any later byte goes
out, so a client never gets the head of one file and the tail of another; and the whole is
checked against the copy's own sha256 before its last byte goes, so that what is kept under the
copy's scope is the copy: the upstream may be a tenant's private server, whose file of the same
build ID, size and head but another tail would otherwise be kept in the shared scope.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from proxy.errors import UpstreamTimeout, UpstreamUnavailable, VerificationFailed
from proxy.sources.base import ArtifactMeta, Body

log = logging.getLogger(__name__)
Reopen = Callable[[], Awaitable[Body | None]]


class ResumedBody:
    """`first` (a bucket copy) as a Body; when it stops short, the rest from `reopen()`."""

    def __init__(self, first: Body, reopen: Reopen, resumed: Callable[[], None],
                 sha256: str) -> None:
        self.meta: ArtifactMeta = first.meta
        self._first = first
        self._sha256 = sha256  # the copy's, the whole file's
        self._reopen = reopen
        self._resumed = resumed
        self._then: Body | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        sent = hashlib.sha256()
        size = 0
        try:
            async for chunk in self._first.chunks():
                sent.update(chunk)
                size += len(chunk)
                yield chunk
            return
        except (UpstreamUnavailable, UpstreamTimeout) as e:
            broken: Exception = e
        self._then = then = await self._reopen()
        if then is None:
            raise broken
        if then.meta.size is not None and self.meta.size is not None \
                and then.meta.size != self.meta.size:
            raise VerificationFailed(f"{then.meta.upstream} has {then.meta.size} bytes where "
                                     f"the bucket's copy had {self.meta.size}")
        log.info("the bucket's copy broke off after %d bytes (%s); the rest from %s", size,
                 broken, then.meta.upstream)
        self._resumed()
        again = hashlib.sha256()
        whole = sent.copy()
        skipped = 0
        held = b""  # the last chunk, sent once the whole is known to be the copy
        async for chunk in then.chunks():
            if skipped < size:
                head = chunk[:size - skipped]
                again.update(head)
                skipped += len(head)
                if skipped == size and again.digest() != sent.digest():
                    raise VerificationFailed(f"{then.meta.upstream}'s first {size} bytes are "
                                             "not the bucket copy's that were sent")
                chunk = chunk[len(head):]
                if not chunk:
                    continue
            whole.update(chunk)
            if held:
                yield held
            held = chunk
        if skipped < size:
            raise VerificationFailed(f"{then.meta.upstream} sent {skipped} bytes, fewer than "
                                     f"the bucket copy's {size} already sent")
        if whole.hexdigest() != self._sha256:
            raise VerificationFailed(f"{then.meta.upstream}'s file is not the bucket copy's "
                                     "(sha256)")
        if held:
            yield held

    def close(self) -> None:
        self._first.close()
        if self._then is not None:
            self._then.close()
