"""Only a 404 is remembered as a miss: symgate answers it again from memory and SQL, asks
upstream again once the TTL is over and doubles the TTL each time the miss repeats; a failure
is never remembered, by symgate or by elfutils' client behind it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import select

from proxy.config import NegativeConfig
from proxy.store.models import Negative
from proxy.store.repository import create_engine
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, fast_upstream
from tests.processes import debuginfod_find


async def test_negative_cache_answers_from_sql_then_expires_and_grows(
    start_symgate: SymgateFactory, faults: FaultUpstream, database_url: str
) -> None:
    sg = await start_symgate(
        [faults.url_for("notfound")],
        negative=NegativeConfig(not_found_initial_ttl_s=0.6, not_found_ttl_s=10, memo_s=0.2))
    path = "/buildid/00112233445566778899/debuginfo"
    assert (await sg.get(path))[0] == 404
    assert faults.count("notfound") == 1
    for _ in range(5):
        status, _, body = await sg.get(path)
        assert status == 404 and b"remembered" in body
    await asyncio.sleep(0.3)  # past the memo: this one is answered from SQL
    assert (await sg.get(path))[0] == 404
    assert faults.count("notfound") == 1
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="negative_hit") == 6
    await asyncio.sleep(0.5)  # past the first TTL
    assert (await sg.get(path))[0] == 404
    assert faults.count("notfound") == 2
    engine = create_engine(database_url)
    async with engine.connect() as conn:
        row = (await conn.execute(select(Negative.misses, Negative.first_seen,
                                         Negative.expires_at))).one()
    await engine.dispose()
    assert row.misses == 2  # the second miss doubled the TTL


async def test_errors_are_not_remembered_as_misses(
    start_symgate: SymgateFactory, faults: FaultUpstream
) -> None:
    sg = await start_symgate([fast_upstream(faults.url_for("status500"), retries=0),
                              faults.url_for("notfound")])
    path = "/buildid/aabbccdd/debuginfo"
    for expected_count in (1, 2):
        status, _, _ = await sg.get(path)
        assert status == 502  # one said 404, one failed: not a 404
        assert faults.count("status500") == expected_count
    # The upstream that answered 404 is remembered on its own and not asked again.
    assert faults.count("notfound") == 1


async def test_one_server_asked_with_two_credentials_is_two_upstreams_for_its_misses(
    start_symgate: SymgateFactory, faults: FaultUpstream
) -> None:
    """The same server with two tokens (credentials in the URL, or headers) is shown as one
    URL: by that one name, the 404 of the token it knows was taken for the other's too, which
    was refused, and answered as a remembered miss."""
    where = faults.url_for("auth").removeprefix("http://")
    refused = fast_upstream(f"http://old:token@{where}", retries=0)
    known = fast_upstream(f"http://new:token@{where}", retries=0,
                          headers={"Authorization": "Bearer sesame"})
    sg = await start_symgate([refused, known])
    path = "/buildid/" + "ab" * 20 + "/debuginfo"
    for asked in (2, 3):  # then only the refused one is asked: the other's 404 is remembered
        status, _, body = await sg.get(path)
        assert status == 502 and b"answered 401" in body, body
        assert faults.count("auth") == asked
    names = {dict(labels)["upstream"] for (name, labels) in await sg.metrics()
             if name == "symgate_upstream_breaker_state"}
    assert len(names) == 2, names


async def test_elfutils_client_does_not_cache_a_transient_failure(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """The real debuginfod-find: after symgate's upstream recovers, the next call succeeds."""
    sg = await start_symgate([fast_upstream(faults.url_for("gate"), retries=0)])
    client_cache = tmp_path / "client"
    first = await asyncio.to_thread(debuginfod_find, sg.url, client_cache, "debuginfo",
                                    elfs.prog.build_id)
    assert first.returncode != 0
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="upstream_error") == 1
    faults.gate_open = True
    second = await asyncio.to_thread(debuginfod_find, sg.url, client_cache, "debuginfo",
                                     elfs.prog.build_id)
    assert second.returncode == 0, second.stderr
    assert Path(second.stdout.strip()).read_bytes() == elfs.prog.debug.read_bytes()
