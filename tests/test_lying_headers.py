"""Header values are read totally: whatever a client or an upstream puts in a header, symgate
answers (2xx or 4xx), stores nothing it could not store, and keeps serving.

The upstream here is a raw socket server, because HTTP libraries refuse to send the bytes a
broken or hostile server does send: control characters and non-UTF-8 in header values.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from proxy.headers import decimal, printable
from tests.elfs import ElfSet
from tests.harness import SymgateFactory


@pytest.mark.parametrize(("raw", "value"), [
    ("0", 0), (" 42 ", 42), ("1" * 19, int("1" * 19)), ("9" * 5000, 10**19),
    ("²", None), ("-1", None), ("", None), ("1e3", None), ("١٢", None), (None, None),
])
def test_decimal_is_total(raw: str | None, value: int | None) -> None:
    assert decimal(raw) == value


@pytest.mark.parametrize(("raw", "ok"), [
    ("prog.debug", True), ("a b/ü.c", True), ("a\x01b", False), ("a\x7fb", False),
    ("a\udcffb", False), ("x" * 5000, False), ("a\nb", False),
])
def test_printable_refuses_what_cannot_be_stored_or_sent(raw: str, ok: bool) -> None:
    assert (printable(raw, 4096) == raw) is ok


class RawUpstream:
    """Answers every GET with the artifact's bytes and the header lines it is given."""

    def __init__(self, body: bytes, header_lines: list[bytes]) -> None:
        self.body = body
        self.header_lines = header_lines
        self.requests = 0
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.requests += 1
        head = [b"HTTP/1.1 200 OK", b"Content-Length: %d" % len(self.body),
                b"Connection: close", *self.header_lines]
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + self.body)
        await writer.drain()
        writer.close()


@pytest.fixture
async def raw_upstream(elfs: ElfSet) -> AsyncIterator[RawUpstream]:
    up = RawUpstream(elfs.prog.debug.read_bytes(), [])
    server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    up.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    yield up
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("lines", [
    [b"X-DEBUGINFOD-FILE: a\x01b.debug"],
    [b"X-DEBUGINFOD-FILE: a\x7fb.debug"],
    [b"X-DEBUGINFOD-FILE: \xff\xfe.debug", b"X-DEBUGINFOD-ARCHIVE: \xc3("],
    [b"X-DEBUGINFOD-SIZE: \xc2\xb2"],  # "²"
    [b"X-DEBUGINFOD-SIZE: " + b"9" * 5000],
    [b"Last-Modified: \x01garbage"],
], ids=["ctrl", "del", "non-utf8", "superscript-size", "huge-size", "bad-date"])
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
            assert all(c.isprintable() for c in headers["X-DEBUGINFOD-FILE"])
        else:  # a size past any limit: refused before its body is read
            assert lines[0].startswith(b"X-DEBUGINFOD-SIZE") and status == 406
        head_status, _ = await sg.head(path)
        assert head_status == status
    if status == 200:
        assert raw_upstream.requests == 1  # cached once, with a row, and served from it
        assert await sg.metric("symgate_cache_entries") == 1


@pytest.mark.parametrize("value", ["²", "9" * 5000, "-1", "", "0x10"])
async def test_a_clients_maxsize_header_always_gets_an_answer(
    start_symgate: SymgateFactory, value: str
) -> None:
    sg = await start_symgate([])
    status, _, _ = await sg.get("/buildid/" + "ab" * 20 + "/debuginfo",
                                headers={"X-DEBUGINFOD-MAXSIZE": value})
    assert status in (400, 404), status
    assert (await sg.get("/healthz"))[0] == 200
