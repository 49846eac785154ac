"""Hits answered before aiohttp parses them (proxy/web/fast_hits.py), against a real
`symgate serve` over a real elfutils debuginfod, with a raw-socket client: the same bytes as
aiohttp's answer, and every request that needs more than a plain hit still gets aiohttp's."""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import socket
import struct
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import ServerConfig
from tests.elfs import ElfSet
from tests.harness import Debuginfod, eventually
from tests.processes import descriptors_on, start_serve, stop_serve

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

HEADER_TIMEOUT_S = 1
N_UNREAD = 1500  # requests sent unread: more answers than the sockets' buffers hold


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]  # in order, Date left out
    body: bytes
    version: str = "HTTP/1.1"  # of the status line

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)


@dataclass
class Server:
    base: str
    proc: asyncio.subprocess.Process
    config: Path
    output: list[bytes]  # what it printed so far: its access lines among them
    reading: asyncio.Future[None]  # done once it has exited and all it printed is read

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])

    async def metric(self, name: str, **labels: str) -> float:
        async with aiohttp.ClientSession() as s, s.get(self.base + "/metrics") as r:
            text = await r.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return 0.0

    async def quick(self) -> float:
        return await self.metric("symgate_quick_hits_total")

    async def quick_misses(self) -> float:
        return await self.metric("symgate_quick_misses_total")


@contextlib.asynccontextmanager
async def running(tmp_path: Path, database_url: str, upstream: str, extra: str = "",
                  server_extra: str = "", header_timeout_s: float = HEADER_TIMEOUT_S
                  ) -> AsyncIterator[Server]:
    """`extra`: tables after [negative]; `server_extra`: more of [server]."""
    base, proc = await start_serve(
        tmp_path, tmp_path / "data", database_url, upstream, access_log=True,
        # Remembered misses trusted from memory for the whole test, not a second: a quick
        # 404 is the one memory alone can tell, and a slow runner must not make it SQL's.
        extra=f"header_timeout_s = {header_timeout_s}\n{server_extra}[negative]\n"
              f"memo_s = 600\n{extra}")
    output: list[bytes] = []

    async def drain() -> None:
        # Read all along: a server whose output pipe is full blocks on its next log line.
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            output.append(line)

    reading = asyncio.ensure_future(drain())
    yield Server(base, proc, next(tmp_path.glob("symgate-*.toml")), output, reading)
    await stop_serve([proc])
    await reading


@pytest.fixture
async def server(tmp_path: Path, database_url: str, debuginfod: Debuginfod
                 ) -> AsyncIterator[Server]:
    async with running(tmp_path, database_url, debuginfod.url) as srv:
        yield srv


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(tmp_path_factory: pytest.TempPathFactory, debuginfod: Debuginfod
                 ) -> AsyncIterator[Server]:
    """One server for the many heads of the parametrized checks below, which each send a few
    requests and read the counters' deltas: a server each cost them 2 s, most of what this
    module took. Its tests run in the module's event loop (ON_SHARED), the server's."""
    tmp = tmp_path_factory.mktemp("shared")
    async with running(tmp, f"sqlite+aiosqlite:///{tmp / 'symgate.sqlite'}",
                       debuginfod.url) as srv:
        yield srv


ON_SHARED = pytest.mark.asyncio(loop_scope="module")


class Conn:
    """One kept-alive connection, written to and read from by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, srv: Server) -> Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", srv.port))

    async def send(self, raw: bytes) -> None:
        self.writer.write(raw)
        await self.writer.drain()

    async def answer(self, head_only: bool = False) -> Answer:
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = [tuple(line.split(": ", 1)) for line in lines[1:] if line]
        size = int(next((v for k, v in headers if k.lower() == "content-length"), "0"))
        body = b"" if head_only or status in (204, 304) else \
            await asyncio.wait_for(self.reader.readexactly(size), 10)
        return Answer(status, [(k, v) for k, v in headers if k != "Date"], body,
                      lines[0].split()[0])

    async def closed(self, within: float) -> bool:
        try:
            return await asyncio.wait_for(self.reader.read(1), within) == b""
        except TimeoutError:
            return False

    def close(self) -> None:
        self.writer.close()


def get(path: str, *extra: str, method: str = "GET", version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: symgate", "User-Agent: fast-test/1",
             "Accept: */*", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def hot(srv: Server, path: str) -> None:
    """Fetched (a miss), then hit once through aiohttp, which keeps its answer in memory."""
    conn = await Conn.open(srv)
    for _ in range(2):
        await conn.send(get(path))
        assert (await conn.answer()).status == 200
    conn.close()


async def busy_for_three_timeouts(server: Server, conn: Conn, path: str, want: bytes) -> None:
    """A quick hit every 0.3 s for three header timeouts, each answered, none cut off."""
    before = await server.quick()
    rounds = int(3 * HEADER_TIMEOUT_S / 0.3)
    for _ in range(rounds):
        await conn.send(get(path))
        assert (await conn.answer()).body == want
        await asyncio.sleep(0.3)
    assert await server.quick() == before + rounds


async def test_a_hot_hit_is_answered_as_aiohttp_answers_it(
    server: Server, elfs: ElfSet
) -> None:
    for kind, elf in (("debuginfo", elfs.prog), ("executable", elfs.prog),
                      ("debuginfo", elfs.other)):
        path = f"/buildid/{elf.build_id}/{kind}"
        await hot(server, path)
        conn = await Conn.open(server)
        before = await server.quick()
        await conn.send(get(path))
        quick = await conn.answer()
        await conn.send(get(path, method="HEAD"))
        quick_head = await conn.answer(head_only=True)
        assert await server.quick() == before + 2
        # The same requests with a header the quick path leaves to aiohttp (one that changes
        # nothing in a hit's answer): aiohttp's own answers.
        slow = Conn(*await asyncio.open_connection("127.0.0.1", server.port))
        await slow.send(get(path, "Cache-Control: no-cache"))
        usual = await slow.answer()
        await slow.send(get(path, "Cache-Control: no-cache", method="HEAD"))
        usual_head = await slow.answer(head_only=True)
        assert await server.quick() == before + 2
        want = (elf.debug if kind == "debuginfo" else elf.executable).read_bytes()
        assert quick.status == usual.status == 200
        assert quick.body == usual.body == want
        assert quick.headers == usual.headers
        assert quick_head.headers == usual_head.headers == usual.headers
        conn.close()
        slow.close()
    # Counted as hits like any, and logged with the same line.
    hits = await server.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                               outcome="hit")
    assert hits >= 8


async def test_an_access_line_is_the_same_either_way(server: Server, elfs: ElfSet) -> None:
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    quick, usual = await access_lines_quick_then_usual(server, path)
    assert quick == usual
    assert "outcome=hit" in quick and '"fast-test/1"' in quick


async def access_lines_quick_then_usual(server: Server, path: str) -> tuple[str, str]:
    """The access lines of `path` asked plainly (answered quickly), then with a header that
    leaves it to aiohttp, without their time stamps and durations; the server stopped to flush
    them."""
    before = await server.quick() + await server.quick_misses()
    conn = await Conn.open(server)
    await conn.send(get(path))
    await conn.answer()
    await conn.send(get(path, "Cache-Control: no-cache"))  # aiohttp's from here on
    await conn.answer()
    conn.close()
    assert await server.quick() + await server.quick_misses() == before + 1
    await stop_serve([server.proc])  # its access lines are flushed as it stops
    await server.reading
    out = b"".join(server.output).decode()
    lines = [re.sub(r"^\S+ \S+ ", "", line) for line in out.splitlines()
             if "symgate.access" in line and path in line]
    quick, usual = (re.sub(r" \d\.\d{3}s ", " ", line) for line in lines[-2:])
    return quick, usual


@pytest.mark.parametrize("extra, status, size", [
    (("Range: bytes=0-9",), 206, 10),
    (("X-DEBUGINFOD-MAXSIZE: 10",), 406, None),
    (("X-Scope-OrgID: team-a",), 200, None),
    (("Via: 1.1 other-cache",), 200, None),
    (("X-Forwarded-For: 10.0.0.1",), 200, None),
    (("Connection: close",), 200, None),
    (("Content-Length: 0",), 200, None),
    (("Authorization: Bearer nobody",), 200, None),
    (("Host symgate",), 400, None),  # a header line without its colon
])
@ON_SHARED
async def test_requests_that_need_more_than_a_plain_hit_get_aiohttps_answer(
    shared: Server, elfs: ElfSet, extra: tuple[str, ...], status: int, size: int | None
) -> None:
    server = shared
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    before = await server.quick()
    conn = await Conn.open(server)
    await conn.send(get(path, *extra))
    got = await conn.answer()
    assert got.status == status
    if size is not None:
        assert len(got.body) == size
    assert await server.quick() == before
    if "Connection: close" in extra:
        assert await conn.closed(5)
    conn.close()


async def test_a_maxsize_the_file_fits_is_answered_quickly(server: Server, elfs: ElfSet
                                                          ) -> None:
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    before = await server.quick()
    conn = await Conn.open(server)
    await conn.send(get(path, f"X-DEBUGINFOD-MAXSIZE: {elfs.prog.debug.stat().st_size}"))
    assert (await conn.answer()).body == elfs.prog.debug.read_bytes()
    assert await server.quick() == before + 1
    conn.close()


async def test_http_1_0_and_pipelined_and_split_heads_go_to_aiohttp(
    server: Server, elfs: ElfSet
) -> None:
    a, b = (f"/buildid/{e.build_id}/debuginfo" for e in (elfs.prog, elfs.other))
    await hot(server, a)
    await hot(server, b)
    before = await server.quick()
    conn = await Conn.open(server)
    await conn.send(get(a) + get(b))  # two requests in one write: answered in turn
    assert (await conn.answer()).body == elfs.prog.debug.read_bytes()
    assert (await conn.answer()).body == elfs.other.debug.read_bytes()
    conn.close()
    conn = await Conn.open(server)
    raw = get(a)
    await conn.send(raw[:20])
    await asyncio.sleep(0.05)
    await conn.send(raw[20:])
    assert (await conn.answer()).body == elfs.prog.debug.read_bytes()
    conn.close()
    conn = await Conn.open(server)
    await conn.send(get(a, version="1.0"))
    assert (await conn.answer()).status == 200
    conn.close()
    assert await server.quick() == before


async def test_http_1_0_kept_alive_is_answered_quickly_as_aiohttp_answers_it(
    server: Server, elfs: ElfSet
) -> None:
    """ab -k's requests: HTTP/1.0 with Connection: keep-alive, answered in HTTP/1.0 with the
    connection kept, as aiohttp answers them; the connection serves a next request."""
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    before = await server.quick()
    conn, slow = await Conn.open(server), await Conn.open(server)
    for method in ("GET", "HEAD", "GET"):
        head_only = method == "HEAD"
        await conn.send(get(path, "Connection: Keep-Alive", method=method, version="1.0"))
        quick = await conn.answer(head_only)
        await slow.send(get(path, "Connection: Keep-Alive", "Cache-Control: no-cache",
                            method=method, version="1.0"))
        usual = await slow.answer(head_only)
        assert quick == usual
        assert quick.version == "HTTP/1.0" and quick.header("Connection") == "keep-alive"
        assert quick.body == (b"" if head_only else elfs.prog.debug.read_bytes())
    assert await server.quick() == before + 3
    conn.close()
    slow.close()


MISSING = "/buildid/" + "5a" * 20 + "/debuginfo"  # no upstream has it


async def remembered(srv: Server, path: str) -> None:
    """Asked once through aiohttp: the upstream's 404, remembered."""
    conn = await Conn.open(srv)
    await conn.send(get(path))
    assert (await conn.answer()).status == 404
    conn.close()


async def test_a_remembered_miss_is_answered_quickly_as_aiohttp_answers_it(
    server: Server
) -> None:
    await remembered(server, MISSING)
    before = await server.quick_misses()
    negative = await server.metric("symgate_requests_total", endpoint="buildid",
                                   kind="debuginfo", outcome="negative_hit")
    conn, slow = await Conn.open(server), await Conn.open(server)
    for version, extra in (("1.1", ()), ("1.0", ("Connection: keep-alive",))):
        for method in ("GET", "HEAD"):
            head_only = method == "HEAD"
            await conn.send(get(MISSING, *extra, method=method, version=version))
            quick = await conn.answer(head_only)
            await slow.send(get(MISSING, *extra, "Cache-Control: no-cache", method=method,
                                version=version))
            usual = await slow.answer(head_only)
            assert quick == usual
            assert quick.status == 404 and quick.version == f"HTTP/{version}"
            assert quick.body == (b"" if head_only else b"not found (remembered miss)\n")
    assert await server.quick_misses() == before + 4
    assert await server.metric("symgate_requests_total", endpoint="buildid",
                               kind="debuginfo", outcome="negative_hit") == negative + 8
    # On the status page's recent misses, as aiohttp's are: 1 + 4 + 4 lines of the key.
    async with aiohttp.ClientSession() as s, s.get(server.base + "/") as r:
        page = await r.text()
    assert page.count(MISSING.removeprefix("/buildid/")) == 9
    conn.close()
    slow.close()


async def test_a_remembered_miss_logs_the_same_access_line_either_way(server: Server
                                                                      ) -> None:
    await remembered(server, MISSING)
    quick, usual = await access_lines_quick_then_usual(server, MISSING)
    assert quick == usual
    assert " 404 " in quick and "outcome=negative_hit" in quick


@pytest.mark.parametrize("extra", [("X-Scope-OrgID: team-a",), ("Via: 1.1 other-cache",),
                                   ("X-Forwarded-For: 10.0.0.1",), ("Connection: close",)],
                         ids=["tenant", "via", "forwarded", "close"])
@ON_SHARED
async def test_a_miss_that_needs_more_than_memory_gets_aiohttps_answer(
    shared: Server, extra: tuple[str, ...]
) -> None:
    """A tenant's request, or one that came through other caches, may be another request
    (its own sources, a hop limit): aiohttp's. As is a miss nobody asked for yet."""
    server = shared
    await remembered(server, MISSING)
    before = await server.quick_misses()
    conn = await Conn.open(server)
    await conn.send(get(MISSING, *extra))
    assert (await conn.answer()).status == 404
    conn.close()
    conn = await Conn.open(server)
    await conn.send(get(f"/buildid/{secrets.token_hex(20)}/debuginfo", method="HEAD"))
    assert (await conn.answer(head_only=True)).status == 404
    conn.close()
    assert await server.quick_misses() == before


async def test_a_connection_handed_to_aiohttp_stays_in_order(server: Server, elfs: ElfSet
                                                            ) -> None:
    """Quick answers, then a request aiohttp must answer, then plain hits again, some sent
    before the answers before them were read: every answer in the order asked."""
    a, b = (f"/buildid/{e.build_id}/debuginfo" for e in (elfs.prog, elfs.other))
    await hot(server, a)
    await hot(server, b)
    conn = await Conn.open(server)
    before = await server.quick()
    await conn.send(get(a))
    assert (await conn.answer()).body == elfs.prog.debug.read_bytes()
    await conn.send(get(b, "Range: bytes=1-4"))
    await conn.send(get(a))  # while aiohttp may still be answering the range
    await conn.send(get(b))
    assert (await conn.answer()).body == elfs.other.debug.read_bytes()[1:5]
    assert (await conn.answer()).body == elfs.prog.debug.read_bytes()
    assert (await conn.answer()).body == elfs.other.debug.read_bytes()
    await asyncio.sleep(0.05)  # aiohttp waits for the next request: quick again
    await conn.send(get(a))
    assert (await conn.answer()).body == elfs.prog.debug.read_bytes()
    assert await server.quick() >= before + 2
    conn.close()


async def test_a_connection_whose_first_request_was_a_miss_gets_quick_hits_after(
    server: Server, elfs: ElfSet
) -> None:
    """As a profiler's pooled connection: its first request a miss, its next a hit that
    makes the file hot, both aiohttp's; the hits after them are quick, and aiohttp's
    keep-alive timer moves on with them (three header timeouts of quick hits, not cut)."""
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    want = elfs.prog.debug.read_bytes()
    conn = await Conn.open(server)
    for _ in range(2):
        await conn.send(get(path))
        assert (await conn.answer()).body == want
        await asyncio.sleep(0.05)
    await busy_for_three_timeouts(server, conn, path, want)
    conn.close()


async def test_a_request_with_a_body_leaves_the_connection_to_aiohttp(
    server: Server, elfs: ElfSet
) -> None:
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    before = await server.quick()
    conn = await Conn.open(server)
    await conn.send(b"POST /symbolize HTTP/1.1\r\nHost: symgate\r\nContent-Type: "
                    b"application/octet-stream\r\nContent-Length: 5\r\n\r\nhello")
    assert 400 <= (await conn.answer()).status < 500
    await asyncio.sleep(0.05)
    for _ in range(3):
        await conn.send(get(path))
        assert (await conn.answer()).body == elfs.prog.debug.read_bytes()
    assert await server.quick() == before
    conn.close()


async def read_to_end(conn: Conn) -> bytes:
    """All the server sends until it closes the connection."""
    got = b""
    while chunk := await asyncio.wait_for(conn.reader.read(1 << 20), 10):
        got += chunk
    return got


@pytest.mark.parametrize("body", ["content-length", "chunked"])
@ON_SHARED
async def test_a_body_after_quick_answers_is_never_read_as_a_request(
    shared: Server, elfs: ElfSet, body: str
) -> None:
    """A connection that had a quick answer, then a GET with a body that is a plain request
    head, sent in a write of its own (as a smuggling client or a front proxy that frames the
    body otherwise would): the body is the GET's, never a request answered quickly. Each
    request is answered once, in order, and nothing more."""
    server = shared
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    await remembered(server, MISSING)
    inner = get(MISSING)  # a quick 404, were it read as a request
    # The head alone in a read of its own, as the body's other pieces.
    framing, pieces = (f"Content-Length: {len(inner)}", [inner]) if body == "content-length" \
        else ("Transfer-Encoding: chunked", [b"%x\r\n" % len(inner), inner, b"\r\n0\r\n\r\n"])
    before = await server.quick() + await server.quick_misses()
    conn = await Conn.open(server)
    await conn.send(get(path))
    assert (await conn.answer()).status == 200
    await conn.send(get(path, framing))
    for piece in pieces:
        await asyncio.sleep(0.1)
        await conn.send(piece)
    await asyncio.sleep(0.1)
    await conn.send(get("/healthz", "Connection: close"))
    rest = await read_to_end(conn)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", rest)
    assert statuses == [b"200", b"200"], rest[:2000]  # the GET's, then /healthz's
    assert await server.quick() + await server.quick_misses() == before + 1
    conn.close()


async def test_a_client_that_stops_reading_gets_every_answer_in_order(
    server: Server, elfs: ElfSet
) -> None:
    """Requests sent one by one and not read: the quick path stops writing once the socket's
    buffer is full, aiohttp takes the connection and reads no further until its answers go
    out; once the client reads, every answer comes, in order, and others are served meanwhile."""
    a, b = (f"/buildid/{e.build_id}/debuginfo" for e in (elfs.prog, elfs.other))
    await hot(server, a)
    await hot(server, b)
    want = {a: elfs.prog.debug.read_bytes(), b: elfs.other.debug.read_bytes()}
    conn = await Conn.open(server)
    before = await server.quick()
    asked = [a if i % 3 else b for i in range(N_UNREAD)]
    for path in asked:
        conn.writer.write(get(path))
        await asyncio.sleep(0.0005)  # one request a write, as a client that waits for nothing
    other = await Conn.open(server)  # the server still answers others
    await other.send(get(a))
    assert (await other.answer()).body == want[a]
    other.close()
    handed_over = await server.quick() - before - 1
    for i, path in enumerate(asked):
        got = await conn.answer()
        same = got.body == want[path]  # not asserted as such: pytest's diff of two 20 KB
        assert same, (i, path, got.status, len(got.body))  # bodies would take minutes
    conn.close()
    assert handed_over < len(asked)  # the rest went to aiohttp once the socket was full


async def test_many_clients_at_once(tmp_path: Path, database_url: str, debuginfod: Debuginfod,
                                    elfs: ElfSet) -> None:
    """40 clients, each 20 requests in turn, started together or staggered, over HTTP/1.1 and
    1.0: hits and remembered misses interleaved, and a big file sent by the connection now
    and then, every answer right and every one quick. The default header timeout: with the
    others' second, a loaded machine that kept a client from its next request that long
    had its connection closed as idle (an EOF in CI)."""
    async with running(tmp_path, database_url, debuginfod.url,
                       header_timeout_s=ServerConfig().header_timeout_s) as server:
        await _many_clients(server, elfs)


async def _many_clients(server: Server, elfs: ElfSet) -> None:
    a = f"/buildid/{elfs.prog.build_id}/debuginfo"
    big = f"/buildid/{elfs.big.build_id}/debuginfo"
    await hot(server, a)
    await hot(server, big)
    await remembered(server, MISSING)
    before = await server.quick() + await server.quick_misses()
    body, big_body = elfs.prog.debug.read_bytes(), elfs.big.debug.read_bytes()

    async def client(n: int) -> None:
        await asyncio.sleep(0.01 * (n % 4))
        version, extra = ("1.0", ("Connection: keep-alive",)) if n % 2 else ("1.1", ())
        conn = await Conn.open(server)
        for i in range(20):
            path, status, want = (a, 200, body) if (n + i) % 3 else \
                (MISSING, 404, b"not found (remembered miss)\n")
            if n % 4 == 0 and i in (1, 10):
                path, status, want = big, 200, big_body
            await conn.send(get(path, *extra, version=version))
            got = await conn.answer()
            assert (got.status, got.body, got.version) == (status, want, f"HTTP/{version}")
        conn.close()

    await asyncio.gather(*(client(n) for n in range(40)))
    assert await server.quick() + await server.quick_misses() == before + 800


async def test_an_idle_quick_connection_is_closed_after_the_header_timeout(
    server: Server, elfs: ElfSet
) -> None:
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    before = await server.quick()
    conn = await Conn.open(server)
    await conn.send(get(path))
    await conn.answer()
    assert await server.quick() == before + 1
    assert await conn.closed(HEADER_TIMEOUT_S + 3)
    # A head that trickles in after quick answers is timed as a first head is.
    conn = await Conn.open(server)
    await conn.send(get(path))
    await conn.answer()
    await conn.send(get(path)[:10])
    assert await conn.closed(HEADER_TIMEOUT_S + 3)


async def test_a_purged_file_is_not_answered_from_memory(
    server: Server, elfs: ElfSet, debuginfod: Debuginfod
) -> None:
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    subprocess.run(["symgate", "cache", "purge", elfs.prog.build_id, "--config",
                    str(server.config)], check=True, capture_output=True)

    async def fetched_again() -> bool:
        conn = await Conn.open(server)
        await conn.send(get(path))
        got = await conn.answer()
        conn.close()
        assert got.body == elfs.prog.debug.read_bytes()
        return await server.metric("symgate_requests_total", endpoint="buildid",
                                   kind="debuginfo", outcome="miss") >= 2

    await eventually(fetched_again)


async def test_a_busy_quick_connection_outlives_the_keep_alive_timeout(
    server: Server, elfs: ElfSet
) -> None:
    """Requests answered quickly, one every 0.3 s for three header timeouts: the connection
    stays open (aiohttp's keep-alive timer, which runs from a connection's start, would have
    closed it after one, never having seen these requests)."""
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    conn = await Conn.open(server)
    await busy_for_three_timeouts(server, conn, path, elfs.prog.debug.read_bytes())
    conn.close()


async def test_a_server_stopping_closes_its_quick_connections(
    server: Server, elfs: ElfSet
) -> None:
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    conn = await Conn.open(server)
    await conn.send(get(path))
    await conn.answer()
    server.proc.terminate()
    assert await conn.closed(5)
    assert await asyncio.wait_for(server.proc.wait(), 10) == 0


@pytest.mark.parametrize("fields", [
    b"",  # HTTP/1.1 without Host
    b"Host: a\r\nHost: b\r\n",
    b"Host: x\r\nUser-Agent: a\nX-Scope-OrgID: team-a\r\n",  # a bare LF hides a header
    b"Host: x\r\nUser-Agent: a\nContent-Length: 5\r\n",
    b"Host: x\r\nUser-Agent: a\rb\r\n",
    b"Host: x\r\nUser-Agent: a\x00b\r\n",
    b"Host: x\r\nX-DEBUGINFOD-MAXSIZE: \x0b99999999\x0b\r\n",
    b"Host: x\r\nUser-Agent: " + b"a" * 9000 + b"\r\n",
    b"Host: x\r\nUser-Agent : a\r\n",  # whitespace before the colon
    # Blanks then a control: a pattern that can split the blanks two ways tries every split.
    b"Host:" + b" " * 8000 + b"\x01\r\n",
], ids=["no-host", "two-hosts", "lf-tenant", "lf-length", "cr", "nul", "vt-maxsize",
        "long-line", "space-before-colon", "blanks-then-control"])
@ON_SHARED
async def test_a_head_aiohttp_refuses_is_not_answered_quickly(
    shared: Server, elfs: ElfSet, fields: bytes
) -> None:
    """The quick path split fields on CRLF and checked nothing else: heads that aiohttp's
    parser refuses with a 400 got a quick 200 (a hostile campaign's find), which a front proxy
    that reads a bare LF as a line's end would see with a tenant's header or a body."""
    server = shared
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    line = f"GET {path} HTTP/1.1\r\n".encode()
    before = await server.quick()
    statuses = []
    for head in (line + fields + b"\r\n", line + fields + b"X-Foo: 1\r\n\r\n"):
        conn = await Conn.open(server)
        await conn.send(head)
        statuses.append((await conn.answer()).status)
        conn.close()
    assert statuses[0] == statuses[1], statuses  # the quick path's answer is aiohttp's
    assert await server.quick() == before


async def test_a_client_cannot_forge_access_lines(server: Server, elfs: ElfSet) -> None:
    """A newline in a User-Agent (through the quick path, before it checked lines) or in a
    path (percent-decoded by aiohttp) ended the text access line and began a forged one."""
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    await hot(server, path)
    forged = "2026-01-01 00:00:00,000 INFO symgate.access: 10.6.6.6 FORGED"
    conn = await Conn.open(server)
    await conn.send(get(path).replace(b"User-Agent: fast-test/1",
                                      b"User-Agent: a\n" + forged.encode()))
    assert (await conn.answer()).status == 400
    conn.close()
    conn = await Conn.open(server)
    await conn.send(get("/buildid/%0A" + forged.replace(" ", "%20") + "/debuginfo")
                    .replace(b"fast-test/1", b'say "hi" \\o/'))
    assert (await conn.answer()).status == 400
    conn.close()
    await stop_serve([server.proc])
    await server.reading
    lines = b"".join(server.output).decode().splitlines()
    assert not [line for line in lines if line.startswith("2026-01-01")]
    access = [line for line in lines if line.split(" ", 4)[3:4] == ["symgate.access:"]]
    escaped = [line for line in access if "\\n2026-01-01" in line]
    assert len(escaped) == 1 and '"say \\"hi\\" \\\\o/"' in escaped[0], access


TOKEN = "token-of-the-nameless-tenant"


@pytest.fixture
async def locked(tmp_path: Path, database_url: str, debuginfod: Debuginfod
                 ) -> AsyncIterator[Server]:
    """A server whose requests that name no tenant need a bearer token: [tenants.""] has
    tokens, and aiohttp's path answers such a request without one 401 (web.tenancy)."""
    async with running(tmp_path, database_url, debuginfod.url,
                       f'[tenants.""]\ntokens = ["{TOKEN}"]\n') as srv:
        yield srv


async def test_a_request_that_needs_a_token_is_not_answered_quickly(
    locked: Server, elfs: ElfSet
) -> None:
    """A hot hit and a remembered miss, asked with the token (aiohttp's), then without it:
    aiohttp's 401 both times, not the file or the 404 from memory."""
    bearer = f"Authorization: Bearer {TOKEN}"
    hit = f"/buildid/{elfs.prog.build_id}/debuginfo"
    conn = await Conn.open(locked)
    for path, status in ((hit, 200), (hit, 200), (MISSING, 404), (MISSING, 404)):
        await conn.send(get(path, bearer))
        assert (await conn.answer()).status == status
    conn.close()
    for version, extra in (("1.1", ()), ("1.0", ("Connection: keep-alive",))):
        for path in (hit, MISSING):
            conn = await Conn.open(locked)
            await conn.send(get(path, *extra, version=version))
            got = await conn.answer()
            conn.close()
            assert got.status == 401, (path, version, got.status)
    assert await locked.quick() == await locked.quick_misses() == 0


async def test_a_big_hit_is_answered_quickly_as_aiohttp_answers_it(
    server: Server, elfs: ElfSet
) -> None:
    """A file too big to keep in memory: its head written quickly, then the file with
    sendfile, the same bytes as aiohttp's answer; the connection serves on after it."""
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    want = elfs.big.debug.read_bytes()
    await hot(server, path)
    before = await server.quick()
    sent_before = await server.metric("symgate_served_bytes_total", source="cache")
    conn = await Conn.open(server)
    await conn.send(get(path))
    quick = await conn.answer()
    await conn.send(get(path, method="HEAD"))
    quick_head = await conn.answer(head_only=True)
    await conn.send(get(path))  # and again, on the same connection
    again = await conn.answer()
    assert await server.quick() == before + 3
    slow = await Conn.open(server)
    await slow.send(get(path, "Cache-Control: no-cache"))
    usual = await slow.answer()
    assert await server.quick() == before + 3
    assert quick.status == usual.status == again.status == 200
    assert quick.body == usual.body == again.body == want
    assert quick.headers == usual.headers == quick_head.headers
    sent = await server.metric("symgate_served_bytes_total", source="cache") - sent_before
    assert sent == 3 * len(want)
    conn.close()
    slow.close()


async def test_the_first_hit_after_a_download_is_answered_quickly(
    server: Server, elfs: ElfSet
) -> None:
    """No aiohttp hit needed first: a new connection's first request for a file just
    downloaded reads its headers on the quick path, and a big file's connection keeps getting
    quick answers (one that aiohttp had would never get a big file's again)."""
    for elf in (elfs.big, elfs.prog):
        path = f"/buildid/{elf.build_id}/debuginfo"
        want = elf.debug.read_bytes()
        entries = await server.metric("symgate_cache_entries")
        fetch = await Conn.open(server)
        await fetch.send(get(path))
        assert (await fetch.answer()).body == want  # a miss, streamed as it downloads
        fetch.close()

        async def committed(entries: float = entries) -> bool:  # after the last byte
            return await server.metric("symgate_cache_entries") == entries + 1

        await eventually(committed)
        before = await server.quick()
        conn = await Conn.open(server)
        quick = []
        for method in ("GET", "HEAD", "GET"):
            await conn.send(get(path, method=method))
            quick.append(await conn.answer(head_only=method == "HEAD"))
        assert await server.quick() == before + 3
        slow = await Conn.open(server)
        await slow.send(get(path, "Cache-Control: no-cache"))
        usual = await slow.answer()
        assert quick[0].body == quick[2].body == usual.body == want
        assert quick[0].headers == quick[1].headers == usual.headers
        conn.close()
        slow.close()


async def test_a_big_hits_access_line_is_the_same_either_way(
    server: Server, elfs: ElfSet
) -> None:
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    await hot(server, path)
    quick, usual = await access_lines_quick_then_usual(server, path)
    assert quick == usual
    assert f" 200 {elfs.big.debug.stat().st_size} " in quick and "outcome=hit" in quick


async def test_a_request_sent_while_a_big_file_goes_out_is_answered_after_it(
    server: Server, elfs: ElfSet
) -> None:
    """Nothing more is read from the connection while the file is sent: a request sent
    meanwhile is answered once it is out, in order."""
    big, small = (f"/buildid/{e.build_id}/debuginfo" for e in (elfs.big, elfs.prog))
    for path in (big, small):
        await hot(server, path)
    before = await server.quick()
    conn = await Conn.open(server)
    await conn.send(get(big))
    head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    first = await conn.reader.readexactly(1 << 20)  # the file is under way
    await conn.send(get(small))
    size = elfs.big.debug.stat().st_size
    rest = await asyncio.wait_for(conn.reader.readexactly(size - len(first)), 30)
    assert head.startswith(b"HTTP/1.1 200 ") and first + rest == elfs.big.debug.read_bytes()
    after = await conn.answer()
    assert after.status == 200 and after.body == elfs.prog.debug.read_bytes()
    assert await server.quick() == before + 2
    conn.close()


async def test_a_client_that_leaves_in_the_middle_of_a_big_file_is_logged_with_what_went_out(
    server: Server, elfs: ElfSet
) -> None:
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    size = elfs.big.debug.stat().st_size
    await hot(server, path)
    sent_before = await server.metric("symgate_served_bytes_total", source="cache")
    for _ in range(3):
        conn = await Conn.open(server)
        await conn.send(get(path))
        await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
        await conn.reader.readexactly(1 << 20)
        conn.writer.transport.abort()  # a reset, the rest unread
    # Each counted as far as it went: more than what was read, less than the file.
    async def counted() -> bool:
        sent = await server.metric("symgate_served_bytes_total", source="cache") - sent_before
        return sent >= 3 << 20 and await server.quick() >= 3
    await eventually(counted)
    sent = await server.metric("symgate_served_bytes_total", source="cache") - sent_before
    assert sent < 3 * size
    # The server serves on: the whole file again, quickly.
    conn = await Conn.open(server)
    await conn.send(get(path))
    assert (await conn.answer()).body == elfs.big.debug.read_bytes()
    conn.close()
    await stop_serve([server.proc])
    await server.reading
    out = b"".join(server.output).decode()
    cut = [line for line in out.splitlines() if "symgate.access" in line and path in line
           and f" 200 {size} " not in line]
    assert len(cut) == 3 and all(re.search(r" 200 \d+ ", line) for line in cut), cut
    assert "Traceback" not in out


async def test_a_server_stopping_lets_a_big_file_under_way_go_out_whole(
    server: Server, elfs: ElfSet
) -> None:
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    want = elfs.big.debug.read_bytes()
    await hot(server, path)
    conn = await Conn.open(server)
    await conn.send(get(path))
    await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    first = await conn.reader.readexactly(1 << 20)
    server.proc.terminate()  # within its grace: the rest goes out, then the connection closes
    await asyncio.sleep(0.3)
    rest = await asyncio.wait_for(conn.reader.readexactly(len(want) - len(first)), 30)
    assert first + rest == want
    assert await conn.closed(5)
    assert await asyncio.wait_for(server.proc.wait(), 10) == 0


async def handed_to_aiohttp(server: Server, elfs: ElfSet) -> Conn:
    """A connection aiohttp has had: its first request one the quick path leaves to it."""
    conn = await Conn.open(server)
    await conn.send(get(f"/buildid/{elfs.prog.build_id}/debuginfo", "Cache-Control: no-cache"))
    assert (await conn.answer()).status == 200
    return conn


async def test_aiohttps_connection_gets_a_big_file_quickly_and_its_keep_alive_after(
    server: Server, elfs: ElfSet
) -> None:
    """A pooled connection aiohttp has had gets a big hit quickly too: aiohttp's keep-alive
    timer, which does not see the send, is held while the file goes out to a client that
    reads it slower than the timeout, then set going again: a next request is answered, and
    the idle connection is closed after a timeout, as aiohttp closes its own."""
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    want = elfs.big.debug.read_bytes()
    await hot(server, path)
    conn = await handed_to_aiohttp(server, elfs)
    before = await server.quick()
    await conn.send(get(path))
    head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    first = await conn.reader.readexactly(1 << 20)
    await asyncio.sleep(2.5 * HEADER_TIMEOUT_S)  # the rest waits in the server's socket
    rest = await asyncio.wait_for(conn.reader.readexactly(len(want) - len(first)), 30)
    assert head.startswith(b"HTTP/1.1 200 ") and first + rest == want
    assert await server.quick() == before + 1
    await asyncio.sleep(HEADER_TIMEOUT_S / 2)
    await conn.send(get(path, method="HEAD"))
    assert (await conn.answer(head_only=True)).status == 200
    assert await server.quick() == before + 2
    assert await conn.closed(HEADER_TIMEOUT_S * 4)


async def test_a_server_stopping_lets_a_big_file_on_aiohttps_connection_go_out_whole(
    server: Server, elfs: ElfSet
) -> None:
    """aiohttp would close the connection at once (idle, to it): the guard lets the file go
    out within the grace, then closes it."""
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    want = elfs.big.debug.read_bytes()
    await hot(server, path)
    conn = await handed_to_aiohttp(server, elfs)
    await conn.send(get(path))
    await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    first = await conn.reader.readexactly(1 << 20)
    server.proc.terminate()
    await asyncio.sleep(0.3)
    rest = await asyncio.wait_for(conn.reader.readexactly(len(want) - len(first)), 30)
    assert first + rest == want
    assert await conn.closed(5)
    assert await asyncio.wait_for(server.proc.wait(), 10) == 0


@pytest.mark.parametrize("handed", [False, True], ids=["quick", "aiohttps"])
async def test_a_server_stopping_lets_a_big_file_go_out_whole_past_a_request_sent_meanwhile(
    server: Server, elfs: ElfSet, handed: bool
) -> None:
    """A request sent while the file goes out waits unread in the socket (reading is paused
    for the send). The server stops: the file still goes out whole, then the connection ends,
    never reset for the unread request with the file's tail still in its buffers."""
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    want = elfs.big.debug.read_bytes()
    await hot(server, path)
    conn = await (handed_to_aiohttp(server, elfs) if handed else Conn.open(server))
    await conn.send(get(path))
    await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    first = await conn.reader.readexactly(1 << 20)
    await conn.send(get(f"/buildid/{elfs.prog.build_id}/debuginfo"))
    server.proc.terminate()
    await asyncio.sleep(0.3)
    rest = await asyncio.wait_for(conn.reader.readexactly(len(want) - len(first)), 30)
    assert first + rest == want
    assert await conn.closed(5)
    conn.close()
    assert await asyncio.wait_for(server.proc.wait(), 10) == 0


def _cached_file(tmp_path: Path, size: int) -> Path:
    """The cache's file of this size, in the data dir of `running`."""
    return next(p for p in (tmp_path / "data").rglob("*")
                if "objects" in p.parts and p.is_file() and p.stat().st_size == size)


async def test_clients_that_reset_as_their_big_file_starts_leave_nothing_held(
    server: Server, elfs: ElfSet, tmp_path: Path
) -> None:
    """A client that resets right after its request: the head's write may fail at once, the
    send then never starting. Each counted hit still lets go of its file and its lease, and
    has its access line."""
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    size = elfs.big.debug.stat().st_size
    await hot(server, path)
    cached = _cached_file(tmp_path, size)
    before = await server.quick()
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.sendall(get(path))
        sock.close()  # a reset
    async def let_go() -> bool:
        return descriptors_on({server.proc.pid}, cached) == 0
    await eventually(let_go)
    quick = await server.quick() - before
    await stop_serve([server.proc])
    await server.reading
    out = b"".join(server.output).decode()
    lines = [line for line in out.splitlines() if "symgate.access" in line and path in line
             and '"fast-test/1"' in line]
    assert quick > 0 and len(lines) == 2 + quick  # hot()'s two, then one for each quick one
    assert "Traceback" not in out


@pytest.fixture
async def short_grace(tmp_path: Path, database_url: str, debuginfod: Debuginfod
                      ) -> AsyncIterator[Server]:
    async with running(tmp_path, database_url, debuginfod.url,
                       server_extra="shutdown_grace_s = 1.0\n") as srv:
        yield srv


async def test_a_big_file_cut_at_the_end_of_the_grace_is_logged_with_what_went_out(
    short_grace: Server, elfs: ElfSet
) -> None:
    server = short_grace
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    await hot(server, path)
    conn = await Conn.open(server)
    await conn.send(get(path))
    await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    await conn.reader.readexactly(1 << 20)  # then reads no more: the send waits
    server.proc.terminate()
    assert await asyncio.wait_for(server.proc.wait(), 10) == 0
    conn.close()
    await server.reading
    out = b"".join(server.output).decode()
    last = [line for line in out.splitlines() if "symgate.access" in line and path in line][-1]
    sent = int(re.search(r" 200 (\d+) ", last)[1])  # type: ignore[index]
    assert 1 << 20 <= sent < elfs.big.debug.stat().st_size, last
    assert "Traceback" not in out


@pytest.mark.parametrize("extra, seen", [((), True), (("Cache-Control: no-cache",), True),
                                         ((), False), (("Range: bytes=0-",), False)],
                         ids=["quick", "aiohttp", "first-hit", "range"])
async def test_a_cached_file_cut_short_from_outside_is_fetched_again(
    server: Server, elfs: ElfSet, tmp_path: Path, extra: tuple[str, ...], seen: bool
) -> None:
    """The index says 24 MB, the disk holds 1 MiB (an operator's mistake, a bad disk): the
    file is found not to be the one its entry (and the headers read from it) describe, and is
    fetched anew; never sent as a short body that ends well, under either the entry's
    Content-Length or the damaged file's own, whether a hit on it was answered before (its
    headers in memory) or not."""
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    want = elfs.big.debug.read_bytes()
    if seen:
        await hot(server, path)
    else:
        entries = await server.metric("symgate_cache_entries")
        fetch = await Conn.open(server)
        await fetch.send(get(path))
        assert (await fetch.answer()).body == want  # a download: no headers kept
        fetch.close()

        async def committed() -> bool:
            return await server.metric("symgate_cache_entries") == entries + 1

        await eventually(committed)
    cached = _cached_file(tmp_path, len(want))
    with cached.open("r+b") as f:
        f.truncate(1 << 20)
    conn = await Conn.open(server)
    await conn.send(get(path, *extra))
    got = await conn.answer()
    assert got.status in (200, 206) and got.body == want
    conn.close()
    await stop_serve([server.proc])
    await server.reading
    out = b"".join(server.output).decode()
    assert out.count("is not the file its index entry describes") == 1, out[-2000:]


@pytest.mark.parametrize("extra", [(), ("Cache-Control: no-cache",), ("Range: bytes=0-",),
                                   ("Range: bytes=100-",), ('If-None-Match: "other"',)],
                         ids=["quick", "aiohttp", "range", "range-from", "conditional"])
async def test_a_cached_file_cut_short_while_it_goes_out_ends_its_connection(
    server: Server, elfs: ElfSet, tmp_path: Path, extra: tuple[str, ...]
) -> None:
    """The file shrinks on disk (an operator, a bad disk) while its response waits on a
    client that reads slowly: the response is cut, and its connection, on every path that
    sends a file (a range or a conditional request's FileResponse among them); never a short
    body that ends well, whose connection then answers the next request into what the
    client reads as the rest of the file. Cut with a reset, as errors.cut_off cuts a
    download: ended with a FIN, the short body is a partial file to libcurl, which elfutils'
    client keeps as a miss for ten minutes, for a file the next request fetches anew."""
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    want = elfs.big.debug.read_bytes()
    await hot(server, path)
    cached = _cached_file(tmp_path, len(want))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the send waits on it
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    conn = Conn(*await asyncio.open_connection(sock=sock, limit=4096))
    await conn.send(get(path, *extra))
    head = await asyncio.wait_for(conn.reader.readuntil(b"\r\n\r\n"), 10)
    length = int(re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)[1])  # type: ignore[index]
    assert head.split(b" ", 2)[1] in (b"200", b"206") and length > len(want) // 2
    with cached.open("r+b") as f:  # far more than the sockets' buffers hold is still to go
        f.truncate(1 << 20)
    # A short body that ends well leaves its connection open (until it idles out:
    # server.header_timeout_s), then closed with a FIN; nothing is sent on it here, since a
    # request written to a connection the server closed is answered with a reset by the
    # kernel, whatever the server's close was.
    rest = b""
    reset = False
    try:
        while chunk := await asyncio.wait_for(conn.reader.read(1 << 20), 30):
            rest += chunk
    except ConnectionResetError:
        reset = True
    start = len(want) - length  # of the range asked (bytes=N-), or 0
    assert len(rest) < length and rest == want[start:start + len(rest)]
    conn.close()
    assert reset, "the cut body ended with a FIN"
    again = await Conn.open(server)  # found damaged, and fetched anew
    await again.send(get(path))
    assert (await again.answer()).body == want
    again.close()

