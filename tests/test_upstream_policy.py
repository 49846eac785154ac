"""Which upstreams are asked, and when: `in_order` asks the next one only after a 404; `race`
asks them all at once, answers with the first 200 and cancels the rest."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.config import FetchConfig
from proxy.keys import ArtifactKey, Kind
from proxy.sources.base import Hop
from proxy.sources.policy import ask
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, fast_upstream


async def test_in_order_asks_the_next_upstream_after_a_404(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("notfound"), faults.url_for("ok")])
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    # For the debug file (the table's prebuild may ask for the executable meanwhile).
    assert [p.split("/")[1] for p in faults.paths if p.endswith("/debuginfo")] \
        == ["notfound", "ok"]


async def test_race_takes_the_first_200_and_cancels_the_rest(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    faults.first_byte_delay = 5
    sg = await start_symgate(
        [fast_upstream(faults.url_for("slow-first-byte"), first_byte_timeout_s=10),
         faults.url_for("notfound"), faults.url_for("late")],
        fetch=FetchConfig(policy="race"))
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, _headers, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert loop.time() - started < 4  # did not wait for the slow one
    # All three were asked at once: the slow one had its request before the 0.3 s winner.
    # (For the debug file: the table's prebuild, once it is committed, asks for the executable.)
    asked = [p.split("/")[1] for p in faults.paths if p.endswith("/debuginfo")]
    assert sorted(asked) == sorted(["slow-first-byte", "notfound", "late"]), faults.paths


class _Closed:
    """A body that tells whether it was closed."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Answers:
    """An upstream stand-in for the race alone: answers at once (`body`), or never, and then
    takes some turns of the loop to stop once cancelled (an aiohttp request winding down),
    in the first of which it cancels `then_cancel`: the await point where the race's own
    cancellation was lost."""

    scope = ""
    remembers_misses = True

    def __init__(self, name: str, body: _Closed | None = None) -> None:
        self.name = name
        self.body = body
        self.then_cancel: asyncio.Task[object] | None = None

    async def open(self, key: ArtifactKey, hop: Hop) -> _Closed | None:
        if self.body is not None:
            return self.body
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if self.then_cancel is not None:
                self.then_cancel.cancel()
            for _turn in range(3):
                await asyncio.sleep(0)
            raise
        return None

    def has(self, key: ArtifactKey) -> bool | None:
        return None


async def test_a_race_cancelled_as_its_losers_wind_down_is_cancelled() -> None:
    """The race awaited its cancelled losers one by one under suppress(BaseException): a
    cancellation of the race itself (a shutdown's) that came meanwhile was swallowed, and the
    fetch went on as if nothing had asked it to stop. It now ends cancelled, and the winner's
    body, which nobody will read, is closed."""
    body = _Closed()
    slow = _Answers("slow")
    upstreams: list[Any] = [_Answers("fast", body), slow]
    race = asyncio.ensure_future(ask(upstreams, ArtifactKey("ab" * 20, Kind.DEBUGINFO), Hop(),
                                     "race"))
    slow.then_cancel = race
    with pytest.raises(asyncio.CancelledError):
        await race
    assert race.cancelled() and body.closed


async def test_a_race_lost_before_any_answer_is_no_response_time(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """The slow upstream, cancelled when the other won, never answered: it was observed
    (1 sample of a millisecond, the time to its cancellation) in the response-time histogram,
    where it looked the fastest, with no request counted beside it."""
    faults.first_byte_delay = 5
    sg = await start_symgate(
        [fast_upstream(faults.url_for("slow-first-byte"), first_byte_timeout_s=10),
         faults.url_for("ok")], fetch=FetchConfig(policy="race"))
    status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200
    await sg.settled()
    metrics = await sg.metrics()
    counts = {}
    for mode in ("slow-first-byte", "ok"):
        upstream = faults.url_for(mode)
        answered = sum(v for (name, labels), v in metrics.items()
                       if name == "symgate_upstream_requests_total"
                       and ("upstream", upstream) in labels)
        timed = metrics[("symgate_upstream_response_seconds_count", (("upstream", upstream),))]
        counts[mode] = (timed, answered)
    assert counts["slow-first-byte"] == (0, 0)
    # The debug file, and maybe the executable for its table: each timed once, counted once.
    assert counts["ok"][0] == counts["ok"][1] >= 1, counts
