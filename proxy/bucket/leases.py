"""Leases in SQL: one replica process at a time does a named job for the whole cluster (the
upstream fetch of a key, the bucket's eviction).

A lease is a row with a holder and an expiry, taken by one INSERT ... ON CONFLICT statement
and renewed by its holder while it works. A holder that dies (SIGKILL, a lost machine) stops
renewing; once its time is up the next taker gets it. Not an advisory lock: those live as long
as a database connection, which would have to be held out of the pool for a whole download,
and they exist on PostgreSQL only.

Expiry times are the replicas' wall clocks: they must agree to well within lease_s (NTP does).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from datetime import UTC, datetime, timedelta

from proxy.store.repository import DATABASE_ERRORS, Repository
from proxy.to_the_end import to_the_end

log = logging.getLogger(__name__)


class Lease:
    """A lease this process holds, renewed every third of its time until released."""

    def __init__(self, repo: Repository, name: str, holder: str, lease_s: float,
                 held: set[str]) -> None:
        self._repo = repo
        self.name = name
        self._holder = holder
        self._lease_s = lease_s
        self._held = held
        self.lost = False
        self._renewing = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            until = datetime.now(UTC) + timedelta(seconds=self._lease_s)
            try:
                if not await self._repo.renew_lease(self.name, self._holder, until):
                    # Taken over (this process stalled past its time): the job now runs twice,
                    # which costs an upstream request, never a wrong file.
                    log.warning("lost the lease %s to another replica", self.name)
                    self.lost = True
                    return
            except DATABASE_ERRORS as e:  # tried again next time; it may lapse meanwhile
                log.warning("cannot renew the lease %s: %s", self.name, type(e).__name__)

    async def release(self) -> None:
        """Drop the row. A cancel meanwhile (a server stopping as a fetch ends) waits for
        that, then is raised: it cut the DELETE short, and the row stayed until it lapsed,
        the other replicas waiting on it for nothing."""
        await to_the_end(self._release())

    async def _release(self) -> None:
        self._renewing.cancel()
        # Its end, without its CancelledError: taken for this task's own, that swallowed a
        # cancel of the task that released.
        await asyncio.wait([self._renewing])
        await _drop(self._repo, self.name, self._holder, self._held)


async def _drop(repo: Repository, name: str, holder: str, held: set[str]) -> None:
    """Delete `holder`'s row of `name` (never another holder's: the DELETE names both), then
    let go of the name."""
    try:
        await repo.drop_lease(name, holder)
    except DATABASE_ERRORS as e:  # it lapses by itself
        log.warning("cannot release the lease %s: %s", name, type(e).__name__)
    finally:
        # Only now: a second job of this process taking the name before the DELETE (the row
        # is its holder's to take again) had its row deleted under it.
        held.discard(name)


class Leases:
    def __init__(self, repo: Repository, replica: str, lease_s: float) -> None:
        self._repo = repo
        # Each process its own holder: two processes of one replica must not share a lease.
        self._holder = f"{replica}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._lease_s = lease_s
        # Names this process holds. The row is its holder's to take again (a renewal's
        # terms), but a second job of this process on the same name (the catch-up of a key
        # whose fetch is publishing it to a slow bucket) would release the row under the
        # first: the other replicas then stopped waiting and fetched the key themselves.
        self._held: set[str] = set()

    async def take(self, name: str) -> Lease | None:
        """The lease, or None while another holder (or another job of this process) has it.
        Raises DATABASE_ERRORS.

        A cancel meanwhile (a server stopping, a client leaving) waits for the INSERT's end,
        drops the row if it may be this holder's, then is raised: landing once the database
        had committed it, before its answer came, it left a row that nothing renewed or
        released, and the other replicas waited lease_s on it for a fetch nobody made."""
        if name in self._held:
            return None
        self._held.add(name)
        now = datetime.now(UTC)
        taking = asyncio.ensure_future(self._repo.take_lease(
            name, self._holder, now, now + timedelta(seconds=self._lease_s)))
        try:
            taken = await to_the_end(taking)
        except asyncio.CancelledError:
            # Taken, or failed with its COMMIT's outcome unknown: dropped, which never costs
            # another holder its row. Found held by another: nothing of this holder's there.
            if taking.cancelled() or taking.exception() is not None or taking.result():
                await to_the_end(_drop(self._repo, name, self._holder, self._held))
            else:
                self._held.discard(name)
            raise
        except BaseException:
            self._held.discard(name)
            raise
        if not taken:
            self._held.discard(name)
            return None
        return Lease(self._repo, name, self._holder, self._lease_s, self._held)
