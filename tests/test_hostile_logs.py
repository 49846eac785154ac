"""A site's one way out is attacked through its logs too. What a client or an upstream chooses
(a path, a User-Agent, an upstream's headers) reaches the access and event lines and the status
page; a line must stay one printable line (text) or valid JSON, and short; and a log reader
that stops reading must cost lines, never the service. Real `symgate serve` processes, whose
stdout and stderr are a real pipe."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from tests.elfs import ElfSet
from tests.faults import FaultUpstream, RawUpstream
from tests.processes import Start, stop_serve

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

# Docker's log drivers cut a line at 16 KiB and journald at 48 KiB (LineMax): the rest of a
# longer one becomes a record of its own, whose text the client chose.
MAX_LINE = 16 * 1024
FORMATS = ["text", "json"]


class Output:
    """A server's stdout and stderr (one pipe), read as they come once read() is called."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.data = bytearray()
        self._reading: asyncio.Task[None] | None = None

    def read(self) -> None:
        self._reading = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := await self.proc.stdout.read(65536):
            self.data.extend(chunk)

    async def lines(self) -> list[str]:
        """The server stopped (SIGTERM), and every line it wrote."""
        if self._reading is None:
            self.read()
        await stop_serve([self.proc])
        assert self._reading is not None
        await asyncio.wait_for(self._reading, 30)
        return self.data.decode().splitlines()  # strictly UTF-8: anything else is a fault


async def _raw_get(base: str, target: bytes, *headers: bytes) -> bytes:
    """A GET with bytes no HTTP client library sends (non-UTF-8 in a header); its status."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n"
                 + b"".join(h + b"\r\n" for h in headers) + b"Connection: close\r\n\r\n")
    answer = await reader.read()
    writer.close()
    return answer.split(b"\r\n", 1)[0]


async def _logged(serve: Start, upstream: str, log_format: str,
                  asks: Callable[[str], Awaitable[None]]) -> list[str]:
    """The lines of a server (access log on) that was asked what `asks` asks."""
    base, proc = await serve(upstream, extra=f'log_format = "{log_format}"\n', access_log=True)
    out = Output(proc)
    out.read()
    await asks(base)
    return await out.lines()


def _assert_well_formed(lines: list[str], log_format: str) -> None:
    """Each line short, and one printable line of text or one object of valid JSON (I-JSON,
    RFC 7493: no lone surrogate, which strict parsers such as serde_json refuse)."""
    assert lines
    for line in lines:
        assert len(line.encode()) <= MAX_LINE, f"{len(line.encode())} bytes: {line[:300]}"
        if log_format == "json":
            record = json.loads(line)
            json.dumps(record, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate
        else:
            assert line.isprintable(), repr(line[:2000])
    assert not any("Traceback" in line for line in lines), "\n".join(lines)[-4000:]


# An upstream's header value with an ANSI escape (clear the screen), bytes that are not
# UTF-8, and length: what a hostile or broken server sends.
HOSTILE_VALUE = b"\x1b[2J\x9b31m\xff\xfe" + b"x" * 3000


@pytest.mark.parametrize("log_format", FORMATS)
async def test_an_upstreams_unprintable_content_encoding_is_a_502_with_a_clean_reason(
    serve: Start, raw_upstream: RawUpstream, elfs: ElfSet, log_format: str
) -> None:
    """The Content-Encoding an upstream named went raw into the failure's reason: the 502
    became a 500 (its body could not be encoded), with a traceback a request, and the status
    page at / answered 500 for as long as the miss was among its recent ones."""
    raw_upstream.header_lines = [b"Content-Encoding: " + HOSTILE_VALUE]
    got: dict[str, tuple[int, bytes]] = {}

    async def asks(base: str) -> None:
        async with aiohttp.ClientSession() as s:
            for path in (f"/buildid/{elfs.prog.build_id}/debuginfo", "/"):
                async with s.get(base + path) as r:
                    got[path] = r.status, await r.read()

    lines = await _logged(serve, raw_upstream.url, log_format, asks)
    status, body = got[f"/buildid/{elfs.prog.build_id}/debuginfo"]
    assert status == 502 and b"Content-Encoding" in body and len(body) < 1024, (status, body)
    assert b"\x1b" not in body
    status, page = got["/"]
    assert status == 200 and b"Content-Encoding" in page and b"\x1b" not in page
    _assert_well_formed(lines, log_format)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_log_reader_that_stops_reading_costs_lines_not_service(
    serve: Start, faults: FaultUpstream, workers: int
) -> None:
    """A pipe nobody reads (a stalled journald or log shipper, a `| less` left open) filled,
    and the next write of the access log blocked the event loop: the server answered nothing
    more until someone read. Lines are held up to a bound, then dropped and counted."""
    from proxy.web.logs import HELD_BYTES

    base, proc = await serve(faults.url_for("ok"), workers=workers, access_log=True)
    out = Output(proc)  # not read until the flood is over
    path = "/healthz/" + "x" * 1000  # a 404, and a line of about 1.2 KB
    asked = 0

    async def ask(s: aiohttp.ClientSession) -> None:
        nonlocal asked
        async with s.get(base + path) as r:
            assert r.status == 404
            await r.read()
        asked += 1

    # Lines enough to fill the pipe (64 KiB) and what each process holds, half as many again.
    rounds = (HELD_BYTES * workers + 64 * 1024) * 3 // 2 // 1200 // 16
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            for _ in range(rounds):
                await asyncio.gather(*(ask(s) for _ in range(16)))
            async with s.get(base + "/metrics") as r:
                metrics = await r.text()
    finally:
        out.read()
    lines = await out.lines()
    logged = sum(1 for line in lines if path in line)
    said = [int(m.group(1)) for line in lines
            if (m := re.search(r"(\d+) log lines dropped", line))]
    dropped = re.search(r"^symgate_log_lines_dropped_total (\S+)$", metrics, re.M)
    assert said and logged + sum(said) >= asked, (asked, logged, said)
    assert dropped and float(dropped.group(1)) > 0


@pytest.mark.parametrize("log_format", FORMATS)
async def test_a_user_agent_that_is_not_utf8_keeps_json_lines_valid(
    serve: Start, faults: FaultUpstream, log_format: str
) -> None:
    """aiohttp hands a header's bytes that are not UTF-8 on as lone surrogates, which
    json.dumps wrote as "\\udcff": JSON that serde_json (Vector) and other strict parsers
    refuse, so a client chose which access lines a log pipeline lost."""
    async def asks(base: str) -> None:
        assert await _raw_get(base, b"/healthz", b'User-Agent: ua \xff\xfe\xc3( "q" \\') \
            == b"HTTP/1.1 200 OK"

    lines = await _logged(serve, faults.url_for("ok"), log_format, asks)
    _assert_well_formed(lines, log_format)
    assert any("/healthz" in line and "ua " in line for line in lines)

@pytest.mark.parametrize("log_format", FORMATS)
async def test_an_access_line_is_short_whatever_the_request(
    serve: Start, faults: FaultUpstream, log_format: str
) -> None:
    """An 8 KB User-Agent of bytes that are not UTF-8 was a 48 KB line (each byte written
    as \\udcff), a path of control characters four times its length: past what log drivers
    keep as one record, and a client's bytes multiplied on the disk."""
    async def asks(base: str) -> None:
        target = b"/buildid/zz" + b"%01" * 2700 + b"/debuginfo"
        assert await _raw_get(base, target, b"User-Agent: " + b"\xff" * 8000) \
            == b"HTTP/1.1 400 Bad Request"

    lines = await _logged(serve, faults.url_for("ok"), log_format, asks)
    _assert_well_formed(lines, log_format)
    access = [line for line in lines if "/buildid/zz" in line]
    assert len(access) == 1 and len(access[0]) < 12 * 1024, len(access[0])

@pytest.mark.parametrize("log_format", FORMATS)
async def test_event_lines_escape_what_a_client_put_in_a_source_path(
    serve: Start, faults: FaultUpstream, elfs: ElfSet, log_format: str
) -> None:
    """A source path may hold any character but NUL: NEL, CSI (an ANSI escape to a
    terminal that reads C1 controls) and U+2028 (a line break to many log viewers) went raw
    into the warning that names the key of an upstream's HTML answer; a newline and ESC too,
    since a file may be named with them."""
    path = f"/buildid/{elfs.prog.build_id}/source/a%C2%85%C2%9B31m%E2%80%A8%0A%1B[31mb.c"

    async def asks(base: str) -> None:
        async with aiohttp.ClientSession() as s, s.get(base + path) as r:
            assert r.status == 502

    lines = await _logged(serve, faults.url_for("html"), log_format, asks)
    _assert_well_formed(lines, log_format)
    assert any("not an artifact" in line for line in lines), lines


async def test_the_status_page_shows_a_bounded_part_of_what_clients_asked_for(
    serve: Start, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """The page at / is public, and its recent misses name what clients asked for: 25 source
    paths of 4 KB each made a 100 KB page of a client's text (and a reason that could not be
    encoded, a page that answered 500)."""
    base, proc = await serve(faults.url_for("notfound"))
    out = Output(proc)
    out.read()
    async with aiohttp.ClientSession() as s:
        for i in range(30):
            path = f"/buildid/{elfs.prog.build_id}/source/{i}" + "a" * 4000
            async with s.get(base + path) as r:
                assert r.status == 404
        async with s.get(base + "/") as r:
            assert r.status == 200
            page = await r.text()
    await out.lines()
    shown = re.findall(r"<td><code>([^<]*)</code></td><td>not_found</td>", page)
    assert len(shown) == 25 and len(page) < 32 * 1024, (len(shown), len(page))
    assert all(code.startswith(elfs.prog.build_id) for code in shown)
