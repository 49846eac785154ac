"""`symgate prefetch` warms a running symgate: its cache, then its symbol tables."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from symbolize.pprof.profile_pb2 import Profile
from tests.elfs import ElfSet
from tests.harness import Debuginfod, SymgateFactory, eventually
from tests.processes import run_in_thread


async def run(*args: str) -> subprocess.CompletedProcess[str]:
    return await run_in_thread(["symgate", "prefetch", *args], timeout=120)


async def test_prefetch_from_arguments_a_file_and_a_profile(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    sg = await start_symgate([debuginfod.url])
    ids = tmp_path / "ids.txt"
    ids.write_text(f"# from the release pipeline\n{elfs.other.build_id}\n{'ab' * 20}  # gone\n")
    prof = Profile()
    prof.string_table.extend(["", "/usr/bin/nopie", elfs.nopie.build_id.upper()])
    prof.mapping.add(id=1, filename=1, build_id=2)
    (tmp_path / "p.pb.gz").write_bytes(gzip.compress(prof.SerializeToString()))
    # A build ID after an option is one too (argparse had refused it, unrecognized).
    result = await run(elfs.prog.build_id, "--file", str(ids), "--profile",
                       str(tmp_path / "p.pb.gz"), "--server", sg.url, "not-a-build-id",
                       "--kind", "debuginfo", "--json")
    assert result.returncode == 0, result.stderr
    assert "skipping 'not-a-build-id'" in result.stderr
    summary = json.loads(result.stdout)
    assert summary["results"] == {
        elfs.prog.build_id: {"debuginfo": "200"}, elfs.other.build_id: {"debuginfo": "200"},
        "ab" * 20: {"debuginfo": "404"}, elfs.nopie.build_id: {"debuginfo": "200"}}

    async def cached() -> bool:  # each committed once its last byte went (off its path)
        return await sg.metric("symgate_cache_entries") == 3

    await eventually(cached)

    async def tables_built() -> bool:  # the symbol tables follow the cached debug files
        return await sg.metric("symgate_symtab_builds_total", result="ok") == 3

    await eventually(tables_built)
    text = await run(elfs.prog.build_id, "--server", sg.url)  # warm already: both kinds
    assert text.returncode == 0
    assert "1 build IDs, 2 artifacts: 2 cached, 0 not found upstream, 0 failed" in text.stdout


async def test_prefetch_reports_an_unreachable_server(tmp_path: Path, elfs: ElfSet) -> None:
    result = await run(elfs.prog.build_id, "--server", "http://127.0.0.1:9")
    assert result.returncode == 1 and "2 failed" in result.stdout
    # What to act on, not aiohttp's class name ("error: ClientConnectorError") per artifact.
    assert "debuginfo error: cannot connect: connection refused" in result.stdout, \
        result.stdout
    assert "ClientConnectorError" not in result.stdout + result.stderr
    assert (await run("--server", "http://127.0.0.1:9")).returncode == 2  # nothing to do


async def test_prefetch_counts_the_bytes_of_the_files_it_cached_only(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    # "N bytes" is what was warmed: a 404's "not found" body is none of it.
    sg = await start_symgate([debuginfod.url])
    result = await run(elfs.prog.build_id, "ab" * 20, "cd" * 20, "--server", sg.url,
                       "--kind", "debuginfo", "--json")
    summary = json.loads(result.stdout)
    assert summary["results"]["ab" * 20] == {"debuginfo": "404"}
    assert summary["bytes"] == elfs.prog.debug.stat().st_size


async def test_a_concurrency_of_none_is_refused_not_waited_on_for_ever(
    tmp_path: Path, elfs: ElfSet
) -> None:
    """--concurrency 0 made a semaphore no request ever passed: prefetch (and upload) waited
    for ever, printing nothing; a negative one was a traceback."""
    (tmp_path / "f.debug").write_bytes(elfs.prog.debug.read_bytes())
    for value in ("0", "-1", "many"):
        result = await run(elfs.prog.build_id, "--server", "http://127.0.0.1:9",
                           "--concurrency", value)
        assert result.returncode == 2, result
        assert "--concurrency: not a whole number of at least 1" in result.stderr
        assert "Traceback" not in result.stderr
        upload = await run_in_thread(
            ["symgate", "upload", str(tmp_path / "f.debug"), "--server", "http://127.0.0.1:9",
             "--concurrency", value], env={**os.environ, "SYMGATE_TOKEN": "t" * 16},
            timeout=60)
        assert upload.returncode == 2, upload
        assert "--concurrency: not a whole number of at least 1" in upload.stderr


async def test_a_file_of_build_ids_that_is_not_text_is_named_without_a_traceback(
    tmp_path: Path, elfs: ElfSet
) -> None:
    """--file given a binary (the program instead of the list of its IDs) was a
    UnicodeDecodeError traceback that named no file."""
    result = await run("--file", str(elfs.prog.executable), "--server", "http://127.0.0.1:9")
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr, result.stderr
    assert f"symgate: {elfs.prog.executable}: not a text file of build IDs" in result.stderr


async def test_an_upstream_that_never_answers_is_given_up_on_after_the_timeout(
    elfs: ElfSet
) -> None:
    """A server that accepts and never answers held prefetch for ever (five minutes a
    request, --concurrency at a time, however many build IDs)."""
    held: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.readuntil(b"\r\n\r\n")

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        started = time.monotonic()
        result = await run_in_thread(["symgate", "prefetch", elfs.prog.build_id, "ab" * 20,
                                      "--server", url, "--timeout", "2", "--json"], timeout=60)
        took = time.monotonic() - started
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
    assert result.returncode == 1, result
    assert took < 30
    assert "symgate: prefetch stopped after --timeout 2 s: 4 artifacts not done" in \
        result.stderr
    assert "Traceback" not in result.stderr
    assert json.loads(result.stdout)["results"] == {
        b: {"debuginfo": "error: timed out", "executable": "error: timed out"}
        for b in (elfs.prog.build_id, "ab" * 20)}


@pytest.mark.parametrize(("answer", "reason"), [
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "a malformed answer: Bad status line"),
    (b"", "the server closed the connection before answering"),
    (b"HTTP/1.1 302 Found\r\nLocation: /again\r\nContent-Length: 0\r\n\r\n",
     "too many redirects"),
], ids=["not-http", "closed", "redirect-loop"])
async def test_a_server_that_answers_no_file_is_one_failure_however_many_artifacts(
    elfs: ElfSet, answer: bytes, reason: str
) -> None:
    """A --server that is not HTTP (another service's port) failed each artifact with aiohttp's
    text, which ends with the request's URL: each a failure of its own in the summary, one
    per artifact, cut at 200 characters mid-URL. A redirect loop's text did too."""
    async def answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:  # each request of the connection, until the client closes it
                await reader.readuntil(b"\r\n\r\n")
                writer.write(answer)
                await writer.drain()
                if not answer.startswith(b"HTTP/"):
                    break
        writer.close()

    server = await asyncio.start_server(answering, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        result = await run(elfs.prog.build_id, "ab" * 20, "--server", url, "--kind",
                           "debuginfo")
    finally:
        server.close()
        await server.wait_closed()
    assert result.returncode == 1, result
    assert f"2 of 2 artifacts failed (2 error: {reason}" in result.stderr, result.stderr
    assert "url=" not in result.stdout + result.stderr
