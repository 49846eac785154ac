"""Access and event logs of `symgate serve`, as JSON lines and as text."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import free_port
from tests.processes import wait_until_serving


async def _serve_and_ask(tmp_path: Path, log_format: str, upstream: str,
                         paths: list[str]) -> list[str]:
    port = free_port()
    config = tmp_path / "symgate.toml"
    config.write_text(f'[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{tmp_path / "d"}"\n'
                      f'log_format = "{log_format}"\n[[upstreams]]\nurl = "{upstream}"\n')
    proc = await asyncio.create_subprocess_exec(
        "symgate", "serve", "--config", str(config), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "HOME": str(tmp_path)})
    base = f"http://127.0.0.1:{port}"
    await wait_until_serving(base, proc)
    async with aiohttp.ClientSession() as s:
        for path in paths:
            async with s.get(base + path, headers={"User-Agent": "log-test/1"}) as r:
                await r.read()
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout is not None
    out = (await proc.stdout.read()).decode()
    assert await proc.wait() == 0
    return out.splitlines()


@pytest.fixture
def asks(elfs: ElfSet) -> list[str]:
    return [f"/buildid/{elfs.prog.build_id}/debuginfo",  # miss
            f"/buildid/{elfs.prog.build_id}/debuginfo",  # hit
            "/buildid/00aa00aa/debuginfo",  # not found
            "/buildid/zz/debuginfo"]  # bad request


async def test_json_lines_carry_outcome_upstream_bytes_and_duration(
    faults: FaultUpstream, elfs: ElfSet, tmp_path: Path, asks: list[str]
) -> None:
    lines = await _serve_and_ask(tmp_path, "json", faults.url_for("ok"), asks)
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(records) == len([ln for ln in lines if ln.strip()]), \
        [ln for ln in lines if not ln.startswith("{")]
    access = [r["access"] for r in records if "access" in r and
              r["access"]["path"].startswith("/buildid/")]
    assert [(a["outcome"], a["status"]) for a in access] == [
        ("miss", 200), ("hit", 200), ("not_found", 404), ("rejected", 400)]
    size = elfs.prog.debug.stat().st_size
    for a in access[:2]:
        assert a["upstream"] == faults.url_for("ok") and a["bytes"] == size
        assert a["kind"] == "debuginfo" and a["duration_s"] >= 0
        assert a["user_agent"] == "log-test/1"
    assert "invalid build ID" in access[3]["error"]
    events = [r for r in records if "message" in r]
    assert any("cache index loaded" in r["message"] for r in events)
    assert all({"ts", "level", "logger"} <= r.keys() for r in records)


async def test_text_lines_name_outcome_and_upstream(
    faults: FaultUpstream, tmp_path: Path, asks: list[str]
) -> None:
    lines = await _serve_and_ask(tmp_path, "text", faults.url_for("ok"), asks)
    access = [ln for ln in lines if "symgate.access" in ln and "/buildid/" in ln]
    assert len(access) == 4
    assert f"outcome=miss upstream={faults.url_for('ok')}" in access[0]
    assert "outcome=hit" in access[1] and "outcome=not_found" in access[2]


async def test_text_lines_of_failures_say_why(
    faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    # A 502 in the default (text) log must say which upstream failed and how, as the JSON
    # line's "error" does: an operator reading it has nothing else to go on.
    upstream = faults.url_for("status500")
    lines = await _serve_and_ask(tmp_path, "text", upstream,
                                 [f"/buildid/{elfs.prog.build_id}/debuginfo",
                                  "/buildid/zz/debuginfo"])
    access = [ln for ln in lines if "symgate.access" in ln and "/buildid/" in ln]
    assert len(access) == 2
    assert f'outcome=upstream_error error="{upstream}: answered 500"' in access[0], access
    assert 'outcome=rejected error="invalid build ID' in access[1], access
