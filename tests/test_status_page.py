"""The status page at `/`, rendered by a real browser (Debian's headless Chromium)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from proxy.metrics import ProxyMetrics, SymbolizeMetrics
from proxy.web.status_page import RecentMisses, render
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import SymgateFactory, fast_upstream
from tests.processes import run_in_thread

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# As this machine's notes advise: no sandbox as root, and nothing that reaches the network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


async def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if CHROMIUM is None:
        pytest.fail("chromium is not installed (apt-get install chromium)")
    return await run_in_thread(
        [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args], timeout=120)


async def test_status_page_in_a_browser(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    sg = await start_symgate([faults.url_for("ok"),
                              fast_upstream(faults.url_for("status500"), retries=0)])
    for _ in range(3):  # one miss, then two hits: 2 of 3 requests answered from the cache
        assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    assert (await sg.get("/buildid/0123abcd/debuginfo"))[0] == 502  # one upstream failing
    status, headers, _ = await sg.get("/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    dom = await chromium(tmp_path, "--dump-dom", sg.url + "/")
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    assert "version 0.1.0" in page
    assert '<b id="hit-ratio">50.0%</b>' in page  # 2 hits of 4 requests
    assert faults.url_for("ok") in page and faults.url_for("status500") in page
    assert "0123abcd/debuginfo" in page and "answered 500" in page  # the recent miss
    shot = tmp_path / "status.png"
    result = await chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,800",
                            sg.url + "/")
    assert result.returncode == 0 and shot.exists(), result.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1200, 800) and len(png) > 20_000  # a rendered page, not blank
    keep = Path(__file__).resolve().parent.parent / "bench" / "results"
    keep.mkdir(exist_ok=True)
    shutil.copy(shot, keep / "status-page.png")  # for people to look at; not committed


async def test_status_page_escapes_what_clients_send(
    start_symgate: SymgateFactory, faults: FaultUpstream
) -> None:
    sg = await start_symgate([faults.url_for("notfound")])
    await sg.get("/buildid/00aa/source/<script>alert(1)</script>.c")
    _, _, body = await sg.get("/")
    assert b"<script>alert" not in body and b"&lt;script&gt;" in body



class _Collections:
    """A collector that counts how often the registry is collected."""

    def __init__(self) -> None:
        self.count = 0

    def collect(self) -> list[Metric]:
        self.count += 1
        return []


def test_the_status_page_collects_the_metrics_once() -> None:
    """With serve --workers N a collection reads and merges every worker's metric files. The
    page collected the registry once per figure it shows, some eighty times a view (0.1 to
    0.2 s of a serving process's event loop per view of a public page); /metrics once."""
    registry = CollectorRegistry()
    collections = _Collections()
    registry.register(collections)  # type: ignore[arg-type]
    metrics = ProxyMetrics(registry)
    SymbolizeMetrics(registry)
    metrics.count_buildid("debuginfo", "hit")
    metrics.count_buildid("executable", "miss")
    metrics.add_upstream("http://upstream.example/", "http://upstream.example/")
    page = render(registry=registry, upstreams=["http://upstream.example/"],
                  started=time.time(), recent=RecentMisses(), max_bytes=1 << 30)
    assert collections.count == 1
    assert '<b id="hit-ratio">50.0%</b>' in page
