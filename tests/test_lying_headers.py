"""Header values are read totally: whatever a client or an upstream puts in a header, symgate
answers (2xx or 4xx), stores nothing it could not store, and keeps serving.

The upstream here is a raw socket server, because HTTP libraries refuse to send the bytes a
broken or hostile server does send: control characters and non-UTF-8 in header values.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from proxy.headers import decimal, printable
from tests.elfs import ElfSet
from tests.faults import FaultUpstream, RawUpstream
from tests.harness import SymgateFactory


@pytest.mark.parametrize(("raw", "value"), [
    ("0", 0), (" 42 ", 42), ("1" * 19, int("1" * 19)), ("9" * 5000, 10**19),
    ("²", None), ("-1", None), ("", None), ("1e3", None), ("١٢", None), (None, None),
])
def test_decimal_is_total(raw: str | None, value: int | None) -> None:
    assert decimal(raw) == value


@pytest.mark.parametrize(("raw", "ok"), [
    ("prog.debug", True), ("a b/ü.c", True), ("a\x01b", False), ("a\x7fb", False),
    ("a\udcffb", False), ("x" * 5000, False), ("a\nb", False), ("a\x9b2Jb", False),
    ("a\x85b", False), ("a\u202egubed.exe", False), ("a\u2066b\u2069", False),
    ("a\u200fb", False), ("a\u061cb", False), ("a\u00a0b", True), ("اسم.debug", True),
    ("a\u2028b", False), ("a\u2029b", False),
])
def test_printable_refuses_what_cannot_be_stored_or_sent(raw: str, ok: bool) -> None:
    assert (printable(raw, 4096) == raw) is ok


@pytest.mark.parametrize("lines", [
    [b"X-DEBUGINFOD-FILE: a\x01b.debug"],
    [b"X-DEBUGINFOD-FILE: a\x7fb.debug"],
    [b"X-DEBUGINFOD-FILE: \xff\xfe.debug", b"X-DEBUGINFOD-ARCHIVE: \xc3("],
    [b"X-DEBUGINFOD-SIZE: \xc2\xb2"],  # "²"
    [b"X-DEBUGINFOD-SIZE: " + b"9" * 5000],
    [b"Last-Modified: \x01garbage"],
    # What would make a terminal or a log show another name: C1 CSI (ESC [ in one byte), NEL,
    # a right-to-left override ("prog.exe.debug" shown for "prog\u202egubed.exe"), an isolate,
    # a right-to-left mark, the Arabic letter mark; each as UTF-8, as aiohttp decodes it.
    [b"X-DEBUGINFOD-FILE: a\xc2\x9b2Jb.debug", b"X-DEBUGINFOD-ARCHIVE: a\xc2\x85b.rpm"],
    [b"X-DEBUGINFOD-FILE: prog\xe2\x80\xaegubed.exe"],
    [b"X-DEBUGINFOD-FILE: a\xe2\x81\xa6b\xe2\x81\xa9.debug"],
    [b"X-DEBUGINFOD-FILE: a\xe2\x80\x8fb.debug"],
    [b"X-DEBUGINFOD-FILE: a\xd8\x9cb.debug"],
    [b"X-DEBUGINFOD-FILE: a\xe2\x80\xa8b.debug", b"X-DEBUGINFOD-ARCHIVE: a\xe2\x80\xa9b.rpm"],
], ids=["ctrl", "del", "non-utf8", "superscript-size", "huge-size", "bad-date", "c1",
        "bidi-override", "bidi-isolate", "rlm", "alm", "line-separators"])
async def test_an_upstreams_unstorable_headers_cost_nothing_but_themselves(
    start_symgate: SymgateFactory, raw_upstream: RawUpstream, elfs: ElfSet,
    lines: list[bytes],
) -> None:
    raw_upstream.header_lines = lines
    sg = await start_symgate([raw_upstream.url])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    want = elfs.prog.debug.read_bytes()
    for _ in range(3):
        status, headers, body = await sg.get(path)
        if status == 200:
            assert body == want
            shown = headers["X-DEBUGINFOD-FILE"] + headers.get("X-DEBUGINFOD-ARCHIVE", "")
            assert shown.isprintable(), shown
        else:  # a size past any limit: refused before its body is read
            assert lines[0].startswith(b"X-DEBUGINFOD-SIZE") and status == 406
        head_status, _ = await sg.head(path)
        assert head_status == status
    if status == 200:
        assert raw_upstream.requests == 1  # cached once, with a row, and served from it
        assert await sg.metric("symgate_cache_entries") == 1


async def test_an_upstream_that_breaks_http_is_named_in_a_line_not_quoted_at_length(
    start_symgate: SymgateFactory, elfs: ElfSet, caplog: pytest.LogCaptureFixture
) -> None:
    """A Content-Length shorter than the body it comes with (the rest, before the connection
    closes, is no response). aiohttp's parser error quotes what it read after: a whole read
    of the file, 100 KB and more of escaped binary, which was the reason a client's 502
    body, the access log's error field and the status page's recent misses carried."""
    body = elfs.big.debug.read_bytes()[: 1 << 20]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\nConnection: close\r\n\r\n"
                     + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        sg = await start_symgate([url])
        status, _, answer = await sg.get(f"/buildid/{elfs.big.build_id}/debuginfo")
        assert status == 502 and len(answer) < 1024, (status, len(answer))
        assert b"\\x7fELF" not in answer and b"\\x00" not in answer
        _, _, page = await sg.get("/")
        assert b"\\x00\\x00" not in page
        assert all(len(r.getMessage()) < 2048 for r in caplog.records)
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("value", ["²", "9" * 5000, "-1", "", "0x10"])
async def test_a_clients_maxsize_header_always_gets_an_answer(
    start_symgate: SymgateFactory, value: str
) -> None:
    sg = await start_symgate([])
    status, _, _ = await sg.get("/buildid/" + "ab" * 20 + "/debuginfo",
                                headers={"X-DEBUGINFOD-MAXSIZE": value})
    assert status in (400, 404), status
    assert (await sg.get("/healthz"))[0] == 200


class OverlongUpstream:
    """Announces, in X-DEBUGINFOD-SIZE, `announced` bytes of a body it sends whole: the first
    `first` bytes, then the rest once the test says so."""

    def __init__(self, body: bytes, announced: int, first: int) -> None:
        self.body, self.announced, self.first = body, announced, first
        self.go_on = asyncio.Event()
        self.requests = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.requests += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-DEBUGINFOD-SIZE: %d\r\n"
                     b"Connection: close\r\n\r\n" % (len(self.body), self.announced)
                     + self.body[:self.first])
        await writer.drain()
        await self.go_on.wait()
        writer.write(self.body[self.first:])
        await writer.drain()
        writer.close()


async def test_a_body_longer_than_announced_never_reaches_a_client_whole(
    start_symgate: SymgateFactory, elfs: ElfSet
) -> None:
    """The announced size is what a client is promised (Content-Length) and what tells the
    last byte, held back until the file is verified: bytes past it fail the download before
    any client is sent them, so no client gets a complete-looking body of the announced size
    (the file's head) that the cache then rejects."""
    body = elfs.big.debug.read_bytes()
    up = OverlongUpstream(body, announced=len(body) // 2, first=1 << 20)
    server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        sg = await start_symgate([url])
        path = f"/buildid/{elfs.big.build_id}/debuginfo"
        got, cut = 0, False
        async with aiohttp.ClientSession() as session, session.get(sg.url + path) as r:
            assert r.status == 200 and r.content_length == len(body) // 2
            # The response has started, streamed from the first megabyte, before the rest.
            got += len(await r.content.readany())
            up.go_on.set()
            try:
                async for chunk in r.content.iter_chunked(65536):
                    got += len(chunk)
            except aiohttp.ClientPayloadError:
                cut = True
        assert cut and 0 < got < len(body) // 2, (got, cut)
        assert await sg.metric("symgate_verification_failures_total", kind="debuginfo",
                               reason="truncated", upstream=url) == 1
        await sg.settled()
        assert await sg.metric("symgate_cache_entries") == 0
        assert (await sg.get("/healthz"))[0] == 200
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(("sent", "said"), [
    ("Tue, 15 Nov 1994 08:12:31 GMT", "Tue, 15 Nov 1994 08:12:31 GMT"),
    ("Tuesday, 15-Nov-94 08:12:31 GMT", "Tue, 15 Nov 1994 08:12:31 GMT"),  # RFC 850's form
    ("Fri, 31 Dec 9999 23:59:59 GMT", None),  # a time no file keeps (ext4 said 2446)
    ("Mon, 01 Jan 1900 00:00:00 GMT", None),  # before 1970 (ext4 said 1901)
    ("yesterday", None)])
async def test_a_miss_says_the_last_modified_its_hits_will_say(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, sent: str,
    said: str | None
) -> None:
    """A miss passed the upstream's Last-Modified on as it came; the hits after it give the
    cached file's time, which the filesystem clamps or which was never set."""
    faults.last_modified = sent
    sg = await start_symgate([faults.url_for("ok")])
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    status, miss, _ = await sg.get(path)
    assert status == 200 and miss.get("Last-Modified") == said
    status, hit, _ = await sg.get(path)
    assert status == 200
    if said is not None:
        assert hit["Last-Modified"] == said
