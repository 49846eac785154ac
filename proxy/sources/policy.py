"""The ordered upstream list and the policy that asks it: in order, or all at once."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from proxy.config import FetchPolicy
from proxy.errors import UpstreamTimeout, UpstreamUnavailable
from proxy.keys import ArtifactKey
from proxy.sources.base import Body, Hop, Source
from proxy.sources.debuginfod import close_quietly


@dataclass
class AskResult:
    """What asking the upstreams gave: a body to stream, and who said 404 or failed."""

    body: Body | None = None
    not_found: list[str] = field(default_factory=list)
    failures: list[UpstreamUnavailable] = field(default_factory=list)

    def failure(self) -> UpstreamUnavailable:
        """The error to answer with when nobody had the file and not everybody said 404."""
        reasons = "; ".join(f.reason for f in self.failures)
        if any(isinstance(f, UpstreamTimeout) for f in self.failures):
            return UpstreamTimeout(reasons)
        # The soonest any of them may answer: only when each said when (Retry-After).
        waits = [f.retry_after_s for f in self.failures]
        soonest = min(w for w in waits if w is not None) if None not in waits else None
        return UpstreamUnavailable(reasons, soonest)


async def ask(
    upstreams: Sequence[Source], key: ArtifactKey, hop: Hop, policy: FetchPolicy,
    doubted: Collection[str] = (),
) -> AskResult:
    """The upstreams named in `doubted` (their last answer for the key was not its file) are
    asked only once the others have given no body, in the same way, after them."""
    first = [u for u in upstreams if u.name not in doubted]
    result = await _ask(first, key, hop, policy)
    if result.body is None and len(first) < len(upstreams):
        later = await _ask([u for u in upstreams if u.name in doubted], key, hop, policy)
        result = AskResult(later.body, result.not_found + later.not_found,
                           result.failures + later.failures)
    return result


async def _ask(
    upstreams: Sequence[Source], key: ArtifactKey, hop: Hop, policy: FetchPolicy
) -> AskResult:
    if policy == "race":
        return await _race(upstreams, key, hop)
    result = AskResult()
    for upstream in upstreams:
        try:
            body = await upstream.open(key, hop)
        except UpstreamUnavailable as e:
            result.failures.append(e)
            continue
        if body is not None:
            result.body = body
            return result
        result.not_found.append(upstream.name)
    return result


async def _race(upstreams: Sequence[Source], key: ArtifactKey, hop: Hop) -> AskResult:
    """First 200 wins; the others are cancelled, and a 200 that lost the race is closed."""
    result = AskResult()
    tasks = {asyncio.ensure_future(u.open(key, hop)): u for u in upstreams}
    pending = set(tasks)
    try:
        while pending and result.body is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                if isinstance(error, UpstreamUnavailable):
                    result.failures.append(error)
                elif error is not None:
                    raise error
                elif (body := task.result()) is None:
                    result.not_found.append(tasks[task].name)
                elif result.body is None:
                    result.body = body
                else:
                    close_quietly(body)  # two 200s in the same instant: keep one
        return result
    finally:
        for task in pending:
            task.cancel()
            task.add_done_callback(_close_a_late_body)
        if pending:
            # Waited for, but not awaited one by one under a suppress: a cancellation of this
            # race itself, arriving while they wind down, was swallowed with theirs.
            try:
                await asyncio.wait(pending)
            except BaseException:
                close_quietly(result.body)  # the winner's, which goes to nobody now
                raise


def _close_a_late_body(task: asyncio.Future[Body | None]) -> None:
    """A 200 that came as its task was cancelled, closed: it lost the race."""
    if not task.cancelled() and task.exception() is None:
        close_quietly(task.result())
