"""The CLI's clients pointed at a --server that is no symgate, or a broken one: each ends within
its --timeout with one line on stderr naming the server, a status of 1 and no traceback, and
writes no output as if it were good."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from symbolize.pprof.profile_pb2 import Profile
from tests.lying_server import MODES, SLOW, lying_server
from tests.processes import run_in_thread
from tests.profiles import make_profile

pytestmark = pytest.mark.one_database  # no symgate runs here: tests/conftest.py


def _one_line(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1, result
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _one_sampled_mapping() -> bytes:
    """A profile of one library with an address in it: a mapping nothing was sampled in is
    not looked up (no_locations), and would ask the server nothing."""
    p = Profile()
    p.string_table.extend(["", "/usr/lib/libx.so", "ab" * 20])
    p.mapping.add(id=1, memory_start=0x1000, memory_limit=0x2000, filename=1, build_id=2)
    p.location.add(id=1, mapping_id=1, address=0x1100)
    return p.SerializeToString()


@pytest.mark.parametrize("mode", MODES)
async def test_symbolize_against_a_lying_server(tmp_path: Path, mode: str) -> None:
    """urllib wrote a login page (200, or after following a redirect, to which it sent the
    bearer token as a GET without the profile) as the output; a body that was no profile too;
    a trickle held it past --timeout for ever; a reset mid-body was a traceback."""
    source = tmp_path / "p.pb"
    source.write_bytes(make_profile([]).SerializeToString())
    out = tmp_path / "o.pb"
    (tmp_path / "token").write_text("a-token-long-enough-1234\n")
    async with lying_server() as server:
        result = await run_in_thread(
            ["symgate", "symbolize", str(source), "-o", str(out), "--server",
             f"{server.url}/{mode}", "--token-file", str(tmp_path / "token"),
             "--timeout", "3" if mode in SLOW else "60"], timeout=60)
        asked = list(server.asked)
    line = _one_line(result, f"{server.url}/{mode}")
    assert not out.exists(), line
    assert [(m, p) for m, p, _ in asked] == [("POST", f"/{mode}/symbolize")], asked
    if mode in SLOW:
        assert "--timeout 3 s" in line
    if mode in ("301", "302"):
        assert f"{server.url}/html/login" in line and "not followed" in line
    if mode == "429-retry-after":
        assert "Retry-After: 120" in line


async def test_symbolize_given_a_url_without_a_scheme(tmp_path: Path) -> None:
    """urllib's ValueError ("unknown url type") was a traceback."""
    source = tmp_path / "p.pb"
    source.write_bytes(make_profile([]).SerializeToString())
    result = await run_in_thread(["symgate", "symbolize", str(source), "-o",
                                  str(tmp_path / "o"), "--server", "127.0.0.1:8002"])
    _one_line(result, "127.0.0.1:8002", "not an http")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["prefetch", "upload", "inspect"])
@pytest.mark.parametrize(("server", "why"), [
    ("127.0.0.1:8002", "not an http:// or https:// URL"),
    ("ftp://127.0.0.1/", "not an http:// or https:// URL"),
    ("http://[::1", "not a URL (Invalid IPv6 URL)"),
    ("http://127.0.0.1:80020", "not a URL (Port out of range"),
])
async def test_a_server_url_no_request_can_go_to_is_said_once_before_any_work(
    tmp_path: Path, command: str, server: str, why: str
) -> None:
    """prefetch and upload reported aiohttp's bare error class for every artifact
    ("debuginfo error: NonHttpUrlClientError"), inspect a failed check for every mapping
    after judging the whole profile, where symbolize said what was wrong with the URL."""
    (tmp_path / "p.pb").write_bytes(_one_sampled_mapping())
    (tmp_path / "none.toml").write_text("upstreams = []\n")
    elf = tmp_path / "true"
    elf.write_bytes(Path("/bin/true").read_bytes())
    args = {"prefetch": ["ab" * 20],
            "upload": [str(elf)],
            "inspect": [str(tmp_path / "p.pb"), "--config", str(tmp_path / "none.toml")]}
    result = await run_in_thread(
        ["symgate", command, *args[command], "--server", server], timeout=60,
        env={**os.environ, "SYMGATE_TOKEN": "a-token-long-enough-1234"})
    assert _one_line(result, f"--server {server}: {why}")
    assert result.stdout == ""  # no summary or table: nothing was tried


@pytest.mark.parametrize("mode", ["html", "json", "no-content-type", "302", "401", "429",
                                  "500", "reset", "trickle", "silent"])
async def test_prefetch_against_a_lying_server(mode: str) -> None:
    """A page that answers 200 to anything (or a redirect to one) was counted cached, every
    artifact, and the exit status 0; a failure was said on stdout alone, without the server."""
    async with lying_server() as server:
        result = await run_in_thread(
            ["symgate", "prefetch", "ab" * 20, "--server", f"{server.url}/{mode}",
             "--timeout", "3" if mode in SLOW else "60"], timeout=60)
    line = _one_line(result, f"{server.url}/{mode}")
    assert "0 cached" in result.stdout, result.stdout
    if mode in ("html", "json", "no-content-type", "302"):
        assert "200 but no ELF file" in line


@pytest.mark.parametrize("mode", ["html", "json", "no-content-type", "302", "404", "413",
                                  "429-retry-after", "500", "reset", "silent"])
async def test_upload_against_a_lying_server(tmp_path: Path, mode: str) -> None:
    """A 200 to anything made every file "already there" (nothing sent, exit 0); an HTML
    error page went into the report as many lines; a redirect was followed with the body
    already spent; a server that never answered held it five minutes a request."""
    elf = tmp_path / "true"
    elf.write_bytes(Path("/bin/true").read_bytes())
    async with lying_server() as server:
        result = await run_in_thread(
            ["symgate", "upload", str(elf), "--server", f"{server.url}/{mode}",
             "--timeout", "3" if mode in SLOW else "60"], timeout=60,
            env={**os.environ, "SYMGATE_TOKEN": "a-token-long-enough-1234"})
        asked = list(server.asked)
    line = _one_line(result, f"{server.url}/{mode}", "1 of 1 artifacts not uploaded")
    assert "0 uploaded, 0 already there, 1 failed" in result.stdout, result.stdout
    assert len(result.stdout.splitlines()) == 2, result.stdout  # the summary, one failure
    assert all(path.startswith(f"/{mode}/") for _, path, _ in asked), asked
    if mode in SLOW:
        assert "--timeout 3 s" in line
    if mode == "302":
        assert "not followed" in result.stdout


@pytest.mark.parametrize("mode", ["html", "json", "302", "401", "429-retry-after", "500",
                                  "reset", "silent"])
async def test_inspect_against_a_lying_server(tmp_path: Path, mode: str) -> None:
    """A page that answers 200 to anything, or a redirect to one, was "debug info available
    from symgate cache: /symbolize will fill this mapping in", exit status 0; a server that
    failed every check was exit status 0 too, said in a table cell alone."""
    (tmp_path / "p.pb").write_bytes(_one_sampled_mapping())
    (tmp_path / "none.toml").write_text("upstreams = []\n")
    async with lying_server() as server:
        result = await run_in_thread(
            ["symgate", "inspect", str(tmp_path / "p.pb"), "--config", str(tmp_path / "none.toml"),
             "--server", f"{server.url}/{mode}", "--timeout", "3"], timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1, result
    assert "available" not in result.stdout, result.stdout
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"{server.url}/{mode}" in lines[0], result.stderr


@pytest.mark.parametrize("answer", [b"SSH-2.0-OpenSSH_9.2p1\r\n", b""])
async def test_every_client_against_a_server_that_is_not_http(
    tmp_path: Path, answer: bytes
) -> None:
    """Another protocol's banner, or a close as soon as the request came: urllib's
    BadStatusLine and RemoteDisconnected were not all OSErrors, and symbolize --server
    ended in a traceback."""
    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await reader.read(1)
        writer.close()

    server = await asyncio.start_server(not_http, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    (tmp_path / "p.pb").write_bytes(_one_sampled_mapping())
    (tmp_path / "none.toml").write_text("upstreams = []\n")
    elf = tmp_path / "true"
    elf.write_bytes(Path("/bin/true").read_bytes())
    commands = [["symbolize", str(tmp_path / "p.pb"), "-o", str(tmp_path / "o")],
                ["inspect", str(tmp_path / "p.pb"), "--config", str(tmp_path / "none.toml")],
                ["prefetch", "ab" * 20], ["upload", str(elf)]]
    try:
        for command in commands:
            result = await run_in_thread(
                ["symgate", *command, "--server", url, "--timeout", "30"], timeout=60,
                env={**os.environ, "SYMGATE_TOKEN": "a-token-long-enough-1234"})
            _one_line(result, url)
    finally:
        server.close()
        await server.wait_closed()
    assert not (tmp_path / "o").exists()
