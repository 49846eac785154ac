"""The debuginfod protocol through symgate, in front of a real elfutils debuginfod."""

from __future__ import annotations

import asyncio
import email.utils
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from yarl import URL

from proxy.keys import ArtifactKey, Kind
from proxy.web.state import STATE
from symbolize.elf import build_id_of_file
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import (
    Debuginfod,
    SymgateFactory,
    eventually,
    free_port,
    running_debuginfod,
)
from tests.processes import debuginfod_find

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


async def test_debuginfod_find_gets_the_same_bytes_as_from_upstream(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    sg = await start_symgate([debuginfod.url])
    prog = elfs.prog
    for attempt in ("cold", "warm"):
        for what, expected in (("debuginfo", prog.debug), ("executable", prog.executable)):
            cache = tmp_path / f"client-{attempt}-{what}"
            direct = await asyncio.to_thread(
                debuginfod_find, debuginfod.url, tmp_path / f"direct-{attempt}-{what}", what,
                prog.build_id)
            via = await asyncio.to_thread(debuginfod_find, sg.url, cache, what, prog.build_id)
            assert via.returncode == 0, via.stderr
            assert Path(via.stdout.strip()).read_bytes() == expected.read_bytes()
            assert Path(via.stdout.strip()).read_bytes() == Path(direct.stdout.strip()).read_bytes()
    source = str(prog.sources[1])  # util.c, as DWARF names it
    via = await asyncio.to_thread(debuginfod_find, sg.url, tmp_path / "src", "source",
                                  prog.build_id, source)
    assert via.returncode == 0, via.stderr
    assert Path(via.stdout.strip()).read_bytes() == prog.sources[1].read_bytes()
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="hit") == 1
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="miss") == 1


async def test_head_answers_with_upstream_headers_though_upstream_refuses_head(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    async with aiohttp.ClientSession() as s:
        async with s.head(debuginfod.url + path) as r:
            assert r.status == 400  # elfutils 0.188 cannot answer HEAD: symgate must
        async with s.get(debuginfod.url + path) as r:
            upstream = r.headers
            await r.read()
    for attempt in ("cold", "warm"):
        status, headers = await sg.head(path)
        assert status == 200, attempt
        for name in ("Content-Length", "X-DEBUGINFOD-SIZE", "X-DEBUGINFOD-FILE", "Content-Type"):
            assert headers[name] == upstream[name], (attempt, name)
        assert int(headers["Content-Length"]) == elfs.prog.debug.stat().st_size


async def test_head_on_a_hit_says_what_get_says_and_conditionals_still_hold(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    status, got, body = await sg.get(path)  # cached now
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    status, got, _ = await sg.get(path)  # a hit, as FileResponse sends it
    status, head = await sg.head(path)
    assert status == 200
    same = {k.lower(): v for k, v in got.items() if k.lower() not in ("date",)}
    assert {k.lower(): v for k, v in head.items() if k.lower() != "date"} == same
    # A conditional HEAD is still answered as the file's state says.
    status, _ = await sg.head(path, headers={"If-None-Match": got["Etag"]})
    assert status == 304
    status, partial = await sg.head(path, headers={"Range": "bytes=0-9"})
    assert status == 206 and partial["Content-Length"] == "10"
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="hit") == 4


async def test_a_small_hit_sent_from_memory_is_what_sendfile_sends(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    from proxy.web.hot_files import SMALL_FILE_BYTES

    sg = await start_symgate([debuginfod.url])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert elfs.prog.debug.stat().st_size <= SMALL_FILE_BYTES
    assert (await sg.get(path))[0] == 200  # cached now
    status, small, body = await sg.get(path)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    # A conditional GET that does not match goes through FileResponse: the reference.
    status, reference, body = await sg.get(path, headers={"If-None-Match": '"other"'})
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert ({k.lower(): v for k, v in small.items() if k.lower() != "date"}
            == {k.lower(): v for k, v in reference.items() if k.lower() != "date"})
    assert await sg.metric("symgate_served_bytes_total", source="cache") == 2 * len(body)


async def test_section_is_passed_through(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url])
    path = f"/buildid/{elfs.prog.build_id}/section/.debug_line"
    async with aiohttp.ClientSession() as s, s.get(debuginfod.url + path) as r:
        expected = await r.read()
    status, _headers, body = await sg.get(path)
    assert status == 200 and body == expected and len(body) > 0
    status, _, body = await sg.get(path)
    assert status == 200 and body == expected


@pytest.mark.parametrize("bad", ["zz", "abc", "0" * 130, "12345g", "a"])
async def test_malformed_build_ids_are_400_and_never_go_upstream(
    start_symgate: SymgateFactory, faults: FaultUpstream, bad: str
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    for kind in ("debuginfo", "executable", "source/usr/src/a.c", "section/.debug_info"):
        status, _, body = await sg.get(f"/buildid/{bad}/{kind}")
        assert status == 400, (kind, body)
        assert body.startswith(b"invalid build ID")
        status, _ = await sg.head(f"/buildid/{bad}/{kind}")
        assert status == 400
    assert faults.count("ok") == 0
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="invalid",
                           outcome="rejected") == 0  # kind is known; only the ID was bad
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="rejected") == 2


async def test_build_id_case_is_normalised(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id.upper()}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200
    assert faults.count("ok") == 1  # one artifact, whatever the case it was asked in


@pytest.mark.parametrize("path", [
    "/source/../../../../etc/passwd",
    "/source/%2e%2e/%2e%2e/etc/passwd",
    "/source/usr/../../../etc/passwd",
])
async def test_source_paths_cannot_climb_out(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, path: str
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    async with aiohttp.ClientSession() as s:
        url = aiohttp.client.URL(f"{sg.url}/buildid/{elfs.prog.build_id}{path}", encoded=True)
        async with s.get(url) as r:
            assert r.status in (400, 404)
            assert b"root:" not in await r.read()
    # Whatever reached the upstream stayed under its /buildid/ID/source tree.
    for seen in faults.paths:
        assert seen.startswith(f"/ok/buildid/{elfs.prog.build_id}/source/"), seen
        assert ".." not in seen and "%2e" not in seen.lower(), seen


async def test_a_source_path_with_a_final_slash_is_no_file_as_for_elfutils(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """"util.c/" names a directory: elfutils' debuginfod answers 404, and resolves "." and
    "..". symgate dropped the final slash and served util.c's bytes for it."""
    sg = await start_symgate([debuginfod.url])
    source = str(elfs.prog.sources[1])
    folder, name = source.rsplit("/", 1)
    async with aiohttp.ClientSession() as s:
        for path in (source, source + "/", source + "//", f"{folder}/./{name}/",
                     source + "/.", f"{folder}/../{folder.rsplit('/', 1)[1]}/{name}"):
            answers = []
            for server in (debuginfod.url, sg.url):
                url = URL(f"{server}/buildid/{elfs.prog.build_id}/source{path}", encoded=True)
                async with s.get(url) as r:
                    answers.append((r.status, await r.read() if r.status == 200 else b""))
            assert answers[1] == answers[0], path


async def test_a_base_url_with_a_final_slash_is_served_as_without(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """Pyroscope joins its debuginfod_url and "/buildid/ID/debuginfo" as they are: configured
    as `http://symgate:8002/`, it asks for //buildid/ID/debuginfo. symgate answered aiohttp's
    404 to every such request, which Pyroscope keeps as "not found" for 7 days."""
    sg = await start_symgate([debuginfod.url])
    prog = elfs.prog
    async with aiohttp.ClientSession() as s:
        for what in ("debuginfo", "executable", f"source{prog.sources[1]}",
                     "section/.debug_line", "debuginfo/"):
            _, one, body = await sg.get(f"/buildid/{prog.build_id}/{what}")
            url = URL(f"{sg.url}//buildid/{prog.build_id}/{what}", encoded=True)
            async with s.get(url) as r:
                assert (r.status, await r.read()) == (200, body), what
                assert r.headers["X-DEBUGINFOD-SIZE"] == one["X-DEBUGINFOD-SIZE"], what
            async with s.head(url) as r:
                assert r.status == 200 and r.headers["Content-Length"] == str(len(body)), what
        absent = URL(f"{sg.url}//buildid/{'00' * 20}/debuginfo", encoded=True)
        async with s.get(absent) as r:
            assert r.status == 404  # a real miss still is one


@pytest.mark.parametrize("path", [
    "/buildid//debuginfo", "/buildid/{id}", "/buildid/{id}//debuginfo", "/buildid/",
    "/buildid", "/buildid/{id}/debuginfo/more", "//buildid//debuginfo",
])
async def test_a_malformed_buildid_path_is_a_400_not_a_404_clients_remember(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, path: str
) -> None:
    """aiohttp's own 404 answered them: a miss that elfutils' client keeps for 10 minutes
    and Pyroscope's for 7 days, for a request that names no artifact."""
    sg = await start_symgate([faults.url_for("ok")])
    url = URL(sg.url + path.format(id=elfs.prog.build_id), encoded=True)
    for method in ("GET", "HEAD"):
        async with sg.session.request(method, url) as r:
            assert r.status == 400, (method, r.status)
    assert faults.count("ok") == 0


async def test_relative_and_nul_byte_source_paths_are_400(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    # (A tab or a newline a file may have: test_a_source_whose_name_has_a_control_character_...)
    for nul in ("%00", "%00/x"):
        status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/source/a{nul}b.c")
        assert status == 400 and b"NUL byte" in body, nul
    status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/symbols")
    assert status == 400
    assert faults.count("ok") == 0


# A directory named café on a Latin-1 file system: its name is not UTF-8.
_LATIN1_DIR = b"caf\xe9"


@pytest.fixture
def latin1_source(tmp_path: Path) -> Iterator[tuple[Debuginfod, str, bytes, bytes]]:
    """A real elfutils debuginfod serving a program built from a source whose path is not
    UTF-8: (the server, the build ID, the path as DWARF names it, the source's bytes)."""
    root = tmp_path / "tree"
    src_dir = root / os.fsdecode(_LATIN1_DIR)
    src_dir.mkdir(parents=True)
    source = src_dir / "m.c"
    text = b"int twice(int x) { return 2 * x; }\nint main(int c, char **v) { return twice(c); }\n"
    source.write_bytes(text)
    exe = root / "prog"
    subprocess.run(["gcc", "-g", "-O0", "-Wl,--build-id", "-o", str(exe), str(source)],
                   check=True)
    build_id = build_id_of_file(exe)
    assert build_id is not None
    binary = shutil.which("debuginfod")
    assert binary is not None, "apt-get install debuginfod"
    port = free_port()
    with (tmp_path / "debuginfod.log").open("wb") as log:
        proc = subprocess.Popen([binary, "-p", str(port), "-d", str(tmp_path / "db.sqlite"),
                                 "-F", str(root), "-t", "0", "-g", "0"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        yield (Debuginfod(f"http://127.0.0.1:{port}", proc), build_id,
               os.fsencode(source), text)
    finally:
        proc.terminate()
        proc.wait(10)


async def _status(url: str) -> int:
    try:
        async with aiohttp.ClientSession() as s, s.get(URL(url, encoded=True)) as r:
            await r.read()
            return r.status
    except aiohttp.ClientError:
        return 0


async def test_a_source_whose_path_is_not_utf8_is_served_as_elfutils_serves_it(
    start_symgate: SymgateFactory, latin1_source: tuple[Debuginfod, str, bytes, bytes],
    tmp_path: Path,
) -> None:
    upstream, build_id, path, text = latin1_source
    encoded = path.replace(_LATIN1_DIR, b"caf%E9").decode()
    await eventually(lambda: _ok(f"{upstream.url}/buildid/{build_id}/source{encoded}"))
    sg = await start_symgate([upstream.url])
    # elfutils' own client, asked for the path as DWARF names it, through symgate.
    env = {**os.environ, "DEBUGINFOD_URLS": sg.url,
           "DEBUGINFOD_CACHE_PATH": str(tmp_path / "client")}
    got = await asyncio.to_thread(subprocess.run, [b"debuginfod-find", b"source",
                                                   build_id.encode(), path],
                                  env=env, capture_output=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert Path(os.fsdecode(got.stdout.strip())).read_bytes() == text
    # Asked again: a hit, whichever case the client encodes the byte in.
    async with sg.session.get(URL(f"{sg.url}/buildid/{build_id}/source"
                                  f"{encoded.replace('%E9', '%e9')}", encoded=True)) as r:
        assert r.status == 200 and await r.read() == text
        assert r.headers["X-DEBUGINFOD-FILE"] == "m.c"
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="source",
                           outcome="hit") == 1
    # The characters `%E9` are another path, which the upstream has not.
    literal = encoded.replace("%E9", "%25E9")
    assert await _status(f"{sg.url}/buildid/{build_id}/source{literal}") == 404
    # The SQL row reads back as the same key: a restarted server, its upstream gone, still
    # serves the file from its cache.
    await sg.stop()
    upstream.process.terminate()
    upstream.process.wait(10)
    again = await start_symgate([upstream.url], data_dir=sg.config.server.data_dir)
    assert await _status(f"{again.url}/buildid/{build_id}/source{encoded}") == 200


async def test_a_source_whose_path_is_not_utf8_is_served_to_an_absolute_form_request(
    start_symgate: SymgateFactory, latin1_source: tuple[Debuginfod, str, bytes, bytes],
) -> None:
    """A request's target may name the scheme and host too (RFC 9112 3.2.2, which a server
    must take): the source path is the same, not the characters `%E9` of another file."""
    upstream, build_id, path, text = latin1_source
    encoded = path.replace(_LATIN1_DIR, b"caf%E9").decode()
    await eventually(lambda: _ok(f"{upstream.url}/buildid/{build_id}/source{encoded}"))
    sg = await start_symgate([upstream.url])
    where = URL(sg.url)
    reader, writer = await asyncio.open_connection(where.host, where.port)
    writer.write(f"GET {sg.url}/buildid/{build_id}/source{encoded} HTTP/1.1\r\n"
                 f"Host: {where.host}\r\nConnection: close\r\n\r\n".encode())
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert answer.endswith(b"\r\n\r\n" + text)


async def _ok(url: str) -> bool:
    return await _status(url) == 200


async def test_a_source_whose_name_has_a_control_character_is_served_as_elfutils_serves_it(
    start_symgate: SymgateFactory, tmp_path: Path
) -> None:
    """A file may be named with a tab or a line break, and gcc records it so: elfutils' client
    asks for `/src/t%09ab.c` and its debuginfod serves it; symgate answered 400 (a miss the
    client keeps for ten minutes). Such a path is kept in SQL percent-encoded, as one that is
    not UTF-8 is, and named in X-DEBUGINFOD-FILE so, a header being printable text."""
    root = tmp_path / "tree"
    root.mkdir()
    texts = {root / "t\tab.c": b"int twice(int x) { return 2 * x; }\n",
             root / "new\nline.c": b"int twice(int);\n"
                                   b"int main(int c, char **v) { return twice(c); }\n"}
    for source, text in texts.items():
        source.write_bytes(text)
    exe = root / "prog"
    subprocess.run(["gcc", "-g", "-O0", "-Wl,--build-id", "-o", str(exe), *map(str, texts)],
                   check=True)
    build_id = build_id_of_file(exe)
    assert build_id is not None
    with running_debuginfod(root, tmp_path) as upstream:
        tab = f"/buildid/{build_id}/source{root}/t%09ab.c"
        await eventually(lambda: _ok(upstream.url + tab))
        sg = await start_symgate([upstream.url])
        for source, text in texts.items():
            for server in (upstream.url, sg.url):
                env = {**os.environ, "DEBUGINFOD_URLS": server,
                       "DEBUGINFOD_CACHE_PATH": str(tmp_path / f"client{server[-5:]}")}
                got = await asyncio.to_thread(
                    subprocess.run, [b"debuginfod-find", b"source", build_id.encode(),
                                     bytes(source)], env=env, capture_output=True, timeout=60)
                assert got.returncode == 0, (server, source, got.stderr)
                assert Path(os.fsdecode(got.stdout.strip())).read_bytes() == text
        status, headers, body = await sg.get(tab)  # a hit now
        assert (status, body, headers["X-DEBUGINFOD-FILE"]) == (200, texts[root / "t\tab.c"],
                                                                  "t%09ab.c")
        assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="source",
                               outcome="hit") == 1
        # The SQL row reads back as the same key: restarted, its upstream gone, it serves it.
        await sg.stop()
    again = await start_symgate([upstream.url], data_dir=sg.config.server.data_dir)
    assert await _status(again.url + tab) == 200


async def test_range_requests_on_cached_artifacts(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await sg.get(path)
    status, headers, body = await sg.get(path, headers={"Range": "bytes=16-47"})
    assert status == 206
    assert body == elfs.prog.debug.read_bytes()[16:48]
    assert headers["Content-Range"] == f"bytes 16-47/{elfs.prog.debug.stat().st_size}"
    # Header names are case-insensitive: a lower-case one (curl -H sends it as typed; aiohttp's
    # client would capitalise it) asks for a range all the same, hot file or not.
    host, port = sg.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        for name in ("range", "RANGE"):
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{name}: bytes=16-47\r\n\r\n"
                         .encode())
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            assert head.startswith("HTTP/1.1 206"), (name, head)
            length = int(head.lower().split("content-length: ")[1].split("\r\n")[0])
            assert await reader.readexactly(length) == elfs.prog.debug.read_bytes()[16:48]
    finally:
        writer.close()
    # A range unit the server does not know is ignored (RFC 9110 14.2: MUST), and so are
    # several ranges (MAY; a 416 would tell the client it asked for bytes the file lacks):
    # the whole file.
    for asked in ("items=0-1", "bytes=0-1,5-6", "bytes=0-1, 16-47"):
        status, headers, body = await sg.get(path, headers={"Range": asked})
        assert status == 200 and body == elfs.prog.debug.read_bytes(), (asked, status)
        assert "Content-Range" not in headers


async def test_if_range_that_names_another_file_gets_the_whole_file(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A client resuming a download sends the validator of what it has in If-Range: the
    range only if that is still the file, else the whole file (RFC 9110 13.1.5), never the
    rest of another file to splice onto its first part. aiohttp reads If-Range as a date only,
    and served the range for any entity tag."""
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    whole = elfs.prog.debug.read_bytes()
    await sg.get(path)
    await sg.settled()
    _, headers = await sg.head(path)
    etag, modified = headers["Etag"], headers["Last-Modified"]
    for validator in (etag, modified):
        status, got, body = await sg.get(path, headers={"Range": "bytes=16-47",
                                                        "If-Range": validator})
        assert status == 206 and body == whole[16:48], validator
    # A date names the file only when it is its Last-Modified exactly: a later one is the
    # date of another file (this one, replaced by an older: a purge and a fetch anew from an
    # upstream that dates it earlier). FileResponse took any date at or after the file's.
    later = email.utils.formatdate(email.utils.parsedate_to_datetime(modified).timestamp() + 1,
                                   usegmt=True)
    for validator in ('"0-0"', f"W/{etag}", "Thu, 01 Jan 1970 00:00:00 GMT", "junk", later,
                      "Fri, 31 Dec 2100 23:59:59 GMT"):
        status, got, body = await sg.get(path, headers={"Range": "bytes=16-47",
                                                        "If-Range": validator})
        assert status == 200 and body == whole, (validator, status)
        assert "Content-Range" not in got


async def test_its_own_last_modified_is_no_change_to_a_file_upstream_gave_no_date(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """An upstream that sends no Last-Modified (as an upload has none): the file's date is
    when it was cached, and a client that sends back the Last-Modified it was told finds the
    file unchanged. It was kept to the nanosecond and told to the second, so the file looked
    changed a fraction of a second after that date: 200 for a 304, 412 for a 200, and the
    whole file for a range."""
    assert faults.last_modified is None
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    whole = elfs.prog.debug.read_bytes()
    await sg.get(path)
    await sg.settled()
    for _ in range(2):  # a hot file's headers, then FileResponse's
        _, headers = await sg.head(path)
    said = headers["Last-Modified"]
    status, _, body = await sg.get(path, headers={"If-Modified-Since": said})
    assert status == 304 and body == b""
    status, _, body = await sg.get(path, headers={"If-Unmodified-Since": said})
    assert status == 200 and body == whole
    status, _, body = await sg.get(path, headers={"If-Range": said, "Range": "bytes=16-47"})
    assert status == 206 and body == whole[16:48]
    # One date whatever path answers. From memory it was rounded down (100 s for 100.5 s),
    # FileResponse's (a range's answer) up, 101 s; a client resuming a download with
    # If-Range and the date its range's answer told got the whole file again.
    cached = sg.runner.app[STATE].service.cache.peek_any(
        ("",), ArtifactKey(elfs.prog.build_id, Kind.DEBUGINFO))
    assert cached is not None
    mtime = os.stat(cached.path).st_mtime
    assert mtime != int(mtime)  # the case: a time within a second (odds of one in 10^9)
    status, ranged, body = await sg.get(path, headers={"Range": "bytes=0-15"})
    assert status == 206 and body == whole[:16] and ranged["Last-Modified"] == said
    status, _, body = await sg.get(path, headers={"Range": "bytes=16-31",
                                                  "If-Range": ranged["Last-Modified"]})
    assert status == 206 and body == whole[16:32]


async def test_maxsize_is_406_cold_and_warm(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    size = elfs.prog.debug.stat().st_size
    for _ in range(2):
        status, _, _ = await sg.get(path, headers={"X-DEBUGINFOD-MAXSIZE": str(size - 1)})
        assert status == 406
    status, _, body = await sg.get(path, headers={"X-DEBUGINFOD-MAXSIZE": str(size)})
    assert status == 200 and len(body) == size
    status, _, _ = await sg.get(path, headers={"X-DEBUGINFOD-MAXSIZE": "lots"})
    assert status == 400


async def test_maxsize_is_406_cold_for_a_file_whose_upstream_said_no_size(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """The limit was judged by the size the upstream said alone: one that said none (chunked)
    had every file sent past the client's limit, 200 and whole. It is judged by the bytes
    now, before the status line: a small file's whole, a big one's once past the limit."""
    sg = await start_symgate([faults.url_for("chunked")])
    for elf in (elfs.prog, elfs.big):
        path = f"/buildid/{elf.build_id}/debuginfo"
        size = elf.debug.stat().st_size
        status, _, _ = await sg.get(path, headers={"X-DEBUGINFOD-MAXSIZE": str(size - 1)})
        assert status == 406
        await sg.settled()
    path = f"/buildid/{elfs.other.build_id}/debuginfo"
    size = elfs.other.debug.stat().st_size
    status, _, body = await sg.get(path, headers={"X-DEBUGINFOD-MAXSIZE": str(size)})
    assert status == 200 and body == elfs.other.debug.read_bytes()


async def test_metrics_and_healthz(start_symgate: SymgateFactory, faults: FaultUpstream) -> None:
    sg = await start_symgate([faults.url_for("ok")])
    status, headers, body = await sg.get("/healthz")
    assert status == 200 and body == b"ok\n"
    status, headers, body = await sg.get("/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    for name in (b"symgate_requests_total", b"symgate_cache_size_bytes",
                 b"symgate_inflight_fetches", b"symgate_upstream_breaker_state"):
        assert name in body


async def test_a_maxsize_of_zero_is_no_limit_as_for_elfutils(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    zero = {"X-DEBUGINFOD-MAXSIZE": "0"}
    async with aiohttp.ClientSession() as s, s.get(debuginfod.url + path, headers=zero) as r:
        assert r.status == 200  # the peer's reading
    for _ in range(2):  # cold, then a hit (answered on the quick path)
        status, _, body = await sg.get(path, headers=zero)
        assert status == 200 and body == elfs.prog.debug.read_bytes()
