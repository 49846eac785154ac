"""The debuginfod API as elfutils grew it since 0.188: /metadata merged with the upstreams'
answers, IMA signatures kept with their files, the client's User-Agent relayed, and a trailing
slash answered as elfutils answers it. Against a real elfutils debuginfod and client, and a
small upstream of our own for what 0.188 cannot send (signatures, /metadata answers)."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from proxy.config import UpstreamConfig
from tests.elfs import ElfSet
from tests.harness import (
    Debuginfod,
    SymgateFactory,
    eventually,
    fast_upstream,
    running_debuginfod,
    serve_loopback,
    serves,
)
from tests.processes import debuginfod_find

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

SIGNATURE = "030204" + "ab" * 40  # the hex of an IMA v2 signature, as RPM headers carry it
MAX_REDIRECTS = 20  # the most an upstream's max_redirects may be
# File names that str.isprintable() refuses but symgate's printable() lets through (a
# no-break space, a soft hyphen, an emoji's zero width joiner), and one both refuse (U+2028,
# a line break to many log viewers).
ODD_NAMES = ("no\u00a0break.debug", "soft\u00adhyphen.debug", "joined\u200dname.debug",
             "line\u2028break.debug")


class ModernUpstream:
    """What a newer debuginfod (0.192+) answers: signed files and /metadata. The first path
    segment picks the behaviour of /metadata: ok, notjson, hang, junk (bad entries), ..."""

    def __init__(self, elfs: ElfSet) -> None:
        self.elfs = elfs
        self.user_agents: list[str] = []
        self.metadata_queries: list[dict[str, str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{mode}/metadata", self.metadata)
        app.router.add_get("/{mode}/buildid/{build_id}/{kind}", self.artifact)
        self._runner, self.url = await serve_loopback(app)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def artifact(self, request: web.Request) -> web.Response:
        self.user_agents.append(request.headers.get("User-Agent", ""))
        prog = self.elfs.prog
        if request.match_info["build_id"] != prog.build_id:
            return web.Response(status=404, text="not found")
        path = prog.debug if request.match_info["kind"] == "debuginfo" else prog.executable
        return web.Response(body=path.read_bytes(), headers={
            "Content-Type": "application/octet-stream", "X-DEBUGINFOD-FILE": path.name,
            "X-DEBUGINFOD-IMASIGNATURE": SIGNATURE})

    async def metadata(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        self.metadata_queries.append(dict(request.query))
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "slow-hops":  # each hop's headers half a second late, the last an answer
            hop = int(request.query.get("hop", "0"))
            await asyncio.sleep(0.5)
            if hop < MAX_REDIRECTS:
                raise web.HTTPFound(request.rel_url.update_query(hop=hop + 1))
        if mode == "huge":  # past what symgate reads of an answer
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"results": [' + b" " * (1 << 20))
            for _ in range(17):
                await response.write(b" " * (1 << 20))
            await response.write(b'], "complete": true}')
            return response
        if mode == "trickle":  # a byte within every read timeout, never the end
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            await response.prepare(request)
            await response.write(b'{"results": [')
            while True:
                await asyncio.sleep(0.2)
                await response.write(b" ")
        if mode == "notjson":
            return web.Response(text="<html>maintenance</html>", content_type="text/html")
        if mode == "odd-names":  # a file of each ODD_NAMES name, as a local directory has
            return web.json_response({"complete": True, "results": [
                {"type": "debuginfo", "buildid": f"{i + 1:040x}", "file": f"/usr/lib/{name}"}
                for i, name in enumerate(ODD_NAMES)]})
        if mode == "many":  # an answer big enough to be parsed off the loop
            return web.json_response({"complete": True, "results": [
                {"type": "executable", "buildid": f"{i:040x}", "file": f"/usr/lib/many/{i}.so"}
                for i in range(3000)]})
        results: list[object] = [{"type": "executable", "buildid": self.elfs.other.build_id,
                                  "file": "/usr/bin/other"}]
        if mode == "junk":
            results += ["a string", {"type": "debuginfo", "buildid": "zz", "file": "x"},
                        {"type": "debuginfo", "buildid": self.elfs.big.build_id}]
        return web.json_response({"results": results, "complete": True})


@pytest.fixture
async def modern(elfs: ElfSet) -> AsyncIterator[ModernUpstream]:
    upstream = ModernUpstream(elfs)
    await upstream.start()
    yield upstream
    await upstream.stop()


@pytest.fixture
def verbose_debuginfod(elfs: ElfSet, tmp_path: Path) -> Iterator[tuple[Debuginfod, Path]]:
    """A real elfutils debuginfod whose log shows each request's User-Agent."""
    with running_debuginfod(elfs.upstream_dir, tmp_path, "-t", "0", "-g", "0", "-v") as d:
        yield d, tmp_path / "debuginfod.log"


async def test_client_user_agent_reaches_a_real_upstream_with_symgate_appended(
    start_symgate: SymgateFactory, verbose_debuginfod: tuple[Debuginfod, Path], elfs: ElfSet,
    tmp_path: Path,
) -> None:
    upstream, log = verbose_debuginfod
    prog = elfs.prog
    await eventually(lambda: serves(f"{upstream.url}/buildid/{prog.build_id}/debuginfo"))
    sg = await start_symgate([upstream.url])
    got = await asyncio.to_thread(debuginfod_find, sg.url, tmp_path / "c", "executable",
                                  prog.build_id)
    assert got.returncode == 0, got.stderr
    # elfutils logs the User-Agent with its spaces removed.
    lines = [ln for ln in log.read_text().splitlines()
             if f"/buildid/{prog.build_id}/executable" in ln and "UA:" in ln]
    relayed = [ln.split("UA:", 1)[1].split(" XFF:", 1)[0] for ln in lines]
    assert any(ua.startswith("elfutils/") and ua.endswith("symgate/0.1.0") for ua in relayed), \
        lines


async def test_a_trailing_slash_is_answered_as_elfutils_answers_it(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url])
    prog = elfs.prog
    async with aiohttp.ClientSession() as s:
        for kind, expected in (("debuginfo", prog.debug), ("executable", prog.executable)):
            path = f"/buildid/{prog.build_id}/{kind}/"
            async with s.get(debuginfod.url + path) as r:
                theirs = r.status, await r.read()
            status, _, body = await sg.get(path)
            assert (status, body) == theirs == (200, expected.read_bytes())
            status, _, body = await sg.get(path)  # and as a hit
            assert (status, body) == (200, expected.read_bytes())
            head_status, head = await sg.head(path)
            assert head_status == 200 and head["X-DEBUGINFOD-SIZE"] == str(len(body))
        status, _, _ = await sg.get(f"/buildid/{prog.build_id}/nonsense/")
        assert status == 400


async def test_the_ima_signature_is_passed_through_and_kept_with_the_file(
    start_symgate: SymgateFactory, modern: ModernUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    sg = await start_symgate([f"{modern.url}/ok"], data_dir=data)
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    status, headers, _ = await sg.get(path)  # streamed from upstream
    assert status == 200 and headers["X-DEBUGINFOD-IMASIGNATURE"] == SIGNATURE
    await sg.settled()
    status, headers, body = await sg.get(path)  # a hit
    assert status == 200 and headers["X-DEBUGINFOD-IMASIGNATURE"] == SIGNATURE
    assert body == elfs.prog.debug.read_bytes()
    status, headers = await sg.head(path)
    assert status == 200 and headers["X-DEBUGINFOD-IMASIGNATURE"] == SIGNATURE
    await sg.stop()
    # Kept in SQL: a new server on the same data dir answers the hit with it, asking nobody.
    asked = len(modern.user_agents)
    again = await start_symgate([f"{modern.url}/ok"], data_dir=data)
    status, headers, _ = await again.get(path)
    assert status == 200 and headers["X-DEBUGINFOD-IMASIGNATURE"] == SIGNATURE
    assert len(modern.user_agents) == asked
    # The client's User-Agent with symgate's appended; without one, symgate's alone.
    client_ua = f"Python/3.{sys.version_info.minor} aiohttp/{aiohttp.__version__}"
    assert modern.user_agents == [f"{client_ua} symgate/0.1.0"]
    status, _, _ = await again.get(f"/buildid/{elfs.prog.build_id}/executable",
                                   skip_auto_headers=["User-Agent"])
    assert status == 200 and modern.user_agents[-1] == "symgate/0.1.0"


async def _metadata(url: str, **query: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metadata", params=query) as r:
        text = await r.text()
        return r.status, json.loads(text) if r.status == 200 else {"text": text}


async def test_metadata_lists_what_symgate_holds_and_says_an_old_upstream_made_it_incomplete(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url])
    prog = elfs.prog
    for kind in ("debuginfo", "executable"):
        assert (await sg.get(f"/buildid/{prog.build_id}/{kind}"))[0] == 200
    await sg.settled()
    errors = await sg.metric("symgate_upstream_requests_total", upstream=debuginfod.url,
                             result="upstream_error")
    status, doc = await _metadata(sg.url, key="buildid", value=prog.build_id.upper())
    assert status == 200
    # elfutils 0.188 answers /metadata with 503: its part is missing, and the answer says so.
    assert doc["complete"] is False
    # A server too old to know the path, not one failing: its 503 says "unrecognized". As an
    # error, every metadata query showed a healthy upstream failing.
    assert await sg.metric("symgate_upstream_requests_total", upstream=debuginfod.url,
                           result="not_found") == 1
    assert await sg.metric("symgate_upstream_requests_total", upstream=debuginfod.url,
                           result="upstream_error") == errors
    assert sorted((r["type"], r["file"]) for r in doc["results"]) == [  # type: ignore[attr-defined]
        ("debuginfo", "prog.debug"), ("executable", "prog")]
    status, doc = await _metadata(sg.url, key="glob", value="/usr/bin/pro?")
    assert [(r["type"], r["buildid"]) for r in doc["results"]] == [  # type: ignore[attr-defined]
        ("executable", prog.build_id)]
    status, doc = await _metadata(sg.url, key="file", value="/opt/app/prog.debug")
    assert [r["type"] for r in doc["results"]] == ["debuginfo"]  # type: ignore[attr-defined]
    status, doc = await _metadata(sg.url, key="file", value="prog.de")
    assert doc["results"] == []


async def test_metadata_merges_a_modern_upstreams_answer(
    start_symgate: SymgateFactory, modern: ModernUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([f"{modern.url}/ok"])
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/executable"))[0] == 200
    await sg.settled()
    up = f"{modern.url}/ok"
    before = await sg.metric("symgate_upstream_requests_total", upstream=up, result="ok")
    status, doc = await _metadata(sg.url, key="glob", value="*")
    assert status == 200 and doc["complete"] is True
    assert sorted((r["buildid"], r["file"]) for r in doc["results"]) == sorted([  # type: ignore[attr-defined]
        (elfs.prog.build_id, elfs.prog.executable.name),
        (elfs.other.build_id, "/usr/bin/other")])
    assert modern.metadata_queries[-1] == {"key": "glob", "value": "*"}
    # What left the site: the query too, not the file requests alone.
    assert await sg.metric("symgate_upstream_requests_total", upstream=up,
                           result="ok") == before + 1


async def test_metadata_merges_an_upstreams_answer_of_thousands(
    start_symgate: SymgateFactory, modern: ModernUpstream
) -> None:
    sg = await start_symgate([f"{modern.url}/many"])
    status, doc = await _metadata(sg.url, key="glob", value="/usr/lib/many/*")
    assert status == 200 and doc["complete"] is True
    assert sorted(r["buildid"] for r in doc["results"]) == [  # type: ignore[attr-defined]
        f"{i:040x}" for i in range(3000)]


@pytest.mark.parametrize("mode", ["notjson", "junk", "hang", "huge", "trickle"])
async def test_metadata_from_a_broken_upstream_is_incomplete_never_an_error(
    start_symgate: SymgateFactory, modern: ModernUpstream, elfs: ElfSet, mode: str
) -> None:
    sg = await start_symgate([fast_upstream(f"{modern.url}/{mode}", total_timeout_s=3)])
    status, doc = await asyncio.wait_for(_metadata(sg.url, key="glob", value="*"), 10)
    assert status == 200 and doc["complete"] is False
    expected = [elfs.other.build_id] if mode == "junk" else []  # only its one good entry
    assert [r["buildid"] for r in doc["results"]] == expected  # type: ignore[attr-defined]
    if mode == "hang":  # no headers within first_byte_timeout_s
        assert await sg.metric("symgate_upstream_requests_total",
                               upstream=f"{modern.url}/{mode}", result="timeout") == 1


async def test_an_upstreams_file_names_are_judged_as_a_local_directorys_are(
    start_symgate: SymgateFactory, modern: ModernUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """One judgement of what a name may be (proxy.headers.printable, which a cached file's
    X-DEBUGINFOD-FILE gets too): an upstream's entries were judged by str.isprintable(),
    which also dropped names a local directory's files are listed by."""
    tree = tmp_path / "debug"
    tree.mkdir()
    elves = (elfs.prog, elfs.other, elfs.nopie, elfs.shlib)
    for elf, name in zip(elves, ODD_NAMES, strict=True):
        shutil.copy(elf.debug, tree / name)
    sg = await start_symgate([UpstreamConfig(path=tree, rescan_s=0),
                              fast_upstream(f"{modern.url}/odd-names")])
    status, doc = await _metadata(sg.url, key="glob", value="*.debug")
    assert status == 200
    kept = [name for name in ODD_NAMES if "\u2028" not in name]
    assert sorted(r["file"] for r in doc["results"]) == sorted(  # type: ignore[attr-defined]
        [str(tree / name) for name in kept] + [f"/usr/lib/{name}" for name in kept])
    assert doc["complete"] is False  # the U+2028 name left out, of each


@pytest.mark.parametrize("mode", ["hang", "slow-hops"])
async def test_an_upstreams_whole_metadata_exchange_ends_at_its_total_timeout(
    start_symgate: SymgateFactory, modern: ModernUpstream, mode: str
) -> None:
    """Connect, headers and body, through every redirect: each hop had a total_timeout_s of
    its own, so an upstream that sent each hop's headers half a bound late held the client's
    query for 21 halves (max_redirects 20), and made it complete. The wait for the headers
    (first_byte_timeout_s) and between body bytes are far longer here."""
    sg = await start_symgate([fast_upstream(
        f"{modern.url}/{mode}", total_timeout_s=1, first_byte_timeout_s=120, read_timeout_s=120,
        max_redirects=MAX_REDIRECTS)])
    status, doc = await asyncio.wait_for(_metadata(sg.url, key="glob", value="*"), 60)
    assert status == 200 and doc == {"results": [], "complete": False}
    assert await sg.metric("symgate_requests_total", endpoint="metadata", kind="glob",
                           outcome="incomplete") == 1


@pytest.mark.parametrize("query", [
    {}, {"key": "glob"}, {"value": "x"}, {"key": "name", "value": "x"},
    {"key": "buildid", "value": "zz"}, {"key": "file", "value": "a\x01b"},
    {"key": "glob", "value": "x" * 5000},
])
async def test_malformed_metadata_queries_are_400_and_never_go_upstream(
    start_symgate: SymgateFactory, modern: ModernUpstream, query: dict[str, str]
) -> None:
    sg = await start_symgate([f"{modern.url}/ok"])
    status, _ = await _metadata(sg.url, **query)
    assert status == 400
    async with aiohttp.ClientSession() as s, \
            s.get(sg.url + "/metadata?key=glob&key=file&value=x") as r:
        assert r.status == 400
    assert modern.metadata_queries == []


async def test_globs_a_client_sends_are_not_kept_by_the_process(
    start_symgate: SymgateFactory, modern: ModernUpstream, elfs: ElfSet
) -> None:
    """fnmatch keeps every pattern it compiles in a cache of 32,768 entries: a 4 KiB glob
    compiles to ~125 KB, so clients sending distinct globs grew a serving process by up to
    4 GB (3,000 of them: 116 -> 490 MB), each compile on the event loop."""
    import fnmatch

    sg = await start_symgate([f"{modern.url}/ok"])
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/executable"))[0] == 200
    await sg.settled()  # a row to match, so the glob is compiled
    kept = fnmatch._compile_pattern.cache_info().currsize  # type: ignore[attr-defined]
    for i in range(20):
        status, doc = await _metadata(sg.url, key="glob", value="*" + "r*" * 1300 + f"{i}")
        assert status == 200 and doc["results"] == [
            {"type": "executable", "buildid": elfs.other.build_id, "file": "/usr/bin/other"}]
    status, doc = await _metadata(sg.url, key="glob", value="/usr/bin/p[!x]o*")
    assert sorted(r["file"] for r in doc["results"]) == [  # type: ignore[attr-defined]
        "/usr/bin/other", elfs.prog.executable.name]
    assert fnmatch._compile_pattern.cache_info().currsize == kept  # type: ignore[attr-defined]
