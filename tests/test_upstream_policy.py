"""Which upstreams are asked, and when: `in_order` asks the next one only after a 404; `race`
asks them all at once, answers with the first 200 and cancels the rest."""

from __future__ import annotations

import asyncio

from proxy.config import FetchConfig
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
