"""`symgate symbolize` gives the same frames as llvm-symbolizer from a local debug directory
and through a symgate server, and refuses a file that is not a profile, writing nothing; its
-o FILE is written whole or left as it was."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.config import TenantConfig
from symbolize.pprof.profile_pb2 import ValueType
from symbolize.pprof.profile_raw_pb2 import RawProfile
from tests.elfs import ElfSet, build_id_tree
from tests.harness import Debuginfod, SymgateFactory
from tests.processes import run_in_thread
from tests.profiles import code_addresses, frames_of, llvm_symbolize, make_profile, place
from tests.symbolize_helpers import BASES, parse, same_frames, symbolize_config

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


async def test_cli_symbolizes_offline_and_through_a_server(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    placed = place(elfs.prog, BASES["prog"])
    vaddrs = code_addresses(elfs.prog)
    source = tmp_path / "in.pb.gz"
    source.write_bytes(gzip.compress(make_profile([(placed, vaddrs)]).SerializeToString()))
    tree = build_id_tree(tmp_path / "debug", elfs.prog.build_id, elfs.prog.debug,
                         elfs.prog.executable)
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    outputs = {}
    for mode, flags in (("offline", ["--debug-dir", str(tree)]), ("server", ["--server", sg.url])):
        out = tmp_path / f"{mode}.pb.gz"
        result = await run_in_thread(
            ["symgate", "symbolize", str(source), "-o", str(out), *flags], timeout=120)
        assert result.returncode == 0, result.stderr
        assert re.search(r"(?i)mappings[ -]symbolized: 1", result.stderr), result.stderr
        outputs[mode] = parse(out.read_bytes())
    expected = llvm_symbolize(elfs.prog.debug, vaddrs)
    for mode, profile in outputs.items():
        by_address = {loc.address: loc for loc in profile.location}
        for vaddr, frames in expected.items():
            assert same_frames(frames_of(profile, by_address[placed.runtime(vaddr)]), frames), mode


def test_cli_rejects_a_file_that_is_not_a_profile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pprof"
    bad.write_bytes(b"\x1f\x8b\x08\x00truncated")
    result = subprocess.run(["symgate", "symbolize", str(bad), "-o", str(tmp_path / "o"),
                             "--debug-dir", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1 and "gzip" in result.stderr
    assert not (tmp_path / "o").exists()


def test_cli_rejects_a_profile_with_a_corrupt_sample(tmp_path: Path) -> None:
    """Its samples are passed on unread: the CLI wrote an unreadable file and said nothing."""
    bad = tmp_path / "bad.pprof"
    bad.write_bytes(RawProfile(string_table=[""], sample_type=[ValueType()],
                               sample=[b"\x0a\x05\x01"]).SerializeToString())
    result = subprocess.run(["symgate", "symbolize", str(bad), "-o", str(tmp_path / "o"),
                             "--debug-dir", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 1, result
    assert "not a pprof profile: sample 0 is not a valid Sample" in result.stderr
    assert not (tmp_path / "o").exists()


async def test_cli_sends_a_tenants_token_and_asks_for_fallback_names(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    """A tenant configured with tokens is named by its bearer token, which --server could not
    send (every such tenant got a 401); --fallback names what stays unsymbolized, offline and
    through a server alike."""
    token = "a-token-long-enough-1234"
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(),
                             tenants={"a": TenantConfig(tokens=(token,))})
    gone = replace(place(elfs.prog, BASES["prog"]), build_id="ab" * 20)  # found nowhere
    source = tmp_path / "in.pb.gz"
    source.write_bytes(gzip.compress(make_profile([(gone, [0x1100])]).SerializeToString()))
    (tmp_path / "token").write_text(token + "\n")
    cli = ["symgate", "symbolize", str(source)]
    refused = await run_in_thread([*cli, "-o", str(tmp_path / "x"), "--server", sg.url,
                                   "--tenant", "a"], timeout=120)
    assert refused.returncode == 1 and "answered 401" in refused.stderr
    names = {}
    for mode, flags in (("offline", ["--debug-dir", str(tmp_path / "none")]),
                        ("server", ["--server", sg.url, "--token-file", str(tmp_path / "token")])):
        out = tmp_path / f"{mode}.pb.gz"
        done = await run_in_thread([*cli, "-o", str(out), *flags, "--fallback", "module-offset"],
                                   timeout=120)
        assert done.returncode == 0, done.stderr
        profile = parse(out.read_bytes())
        names[mode] = {f.function for loc in profile.location for f in frames_of(profile, loc)}
    assert names["offline"] == names["server"] == {f"{elfs.prog.executable.name}+0x1100"}


async def test_cli_reports_a_server_that_answers_bytes_that_are_not_text(
    tmp_path: Path
) -> None:
    """An error whose body is not UTF-8 (something else than a symgate at --server) ended in
    a UnicodeDecodeError traceback instead of the status it answered."""
    from aiohttp import web

    from tests.harness import serve_loopback

    async def garbage(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=502, body=b"\xff\xfe\x00 not text",
                            content_type="application/octet-stream")

    app = web.Application()
    app.router.add_route("*", "/{rest:.*}", garbage)
    runner, url = await serve_loopback(app)
    (tmp_path / "p.pb").write_bytes(make_profile([]).SerializeToString())
    try:
        result = await run_in_thread(["symgate", "symbolize", str(tmp_path / "p.pb"), "-o",
                                      str(tmp_path / "o.pb"), "--server", url], timeout=60)
    finally:
        await runner.cleanup()
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1
    assert f"{url} answered 502: " in result.stderr and "not text" in result.stderr


# The file-size limit (RLIMIT_FSIZE), set in the process that then becomes the command: a write
# past it fails with EFBIG, as one on a full disk fails with ENOSPC (Python ignores SIGXFSZ).
LIMITED = ("import os, resource, sys; "
           "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1]))); "
           "os.execvp(sys.argv[2], sys.argv[2:])")


def test_cli_output_is_written_whole_or_left_as_it_was(tmp_path: Path, elfs: ElfSet) -> None:
    """-o FILE was truncated before the first byte was written: a write that failed on the way
    left a cut profile where an earlier one had been. Now the earlier one stays, no temp file
    is left beside it, and what is written is what a plain open would have made: the same
    bytes as to a stream (/dev/stdout), the umask's mode, a replaced file's own mode."""
    source = tmp_path / "in.pb.gz"
    source.write_bytes(gzip.compress(make_profile(
        [(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog))]).SerializeToString()))
    work = tmp_path / "out"
    work.mkdir()

    def symbolize(out: Path, *, limit: int | None = None, umask: int = 0o022
                  ) -> subprocess.CompletedProcess[bytes]:
        command = ["symgate", "symbolize", str(source), "--debug-dir", str(tmp_path / "none"),
                   "-o", str(out)]
        if limit is not None:
            command = [sys.executable, "-c", LIMITED, str(limit), *command]
        return subprocess.run(command, capture_output=True, umask=umask, timeout=120)

    streamed = symbolize(Path("/dev/stdout"))
    assert streamed.returncode == 0, streamed.stderr
    made = symbolize(work / "new.pb.gz", umask=0o027)
    assert made.returncode == 0, made.stderr
    assert (work / "new.pb.gz").read_bytes() == streamed.stdout
    assert (work / "new.pb.gz").stat().st_mode & 0o777 == 0o640

    earlier = work / "earlier.pb.gz"
    earlier.write_bytes(b"an earlier profile")
    earlier.chmod(0o604)
    assert len(streamed.stdout) > 2 * len(b"an earlier profile")
    cut = symbolize(earlier, limit=len(streamed.stdout) // 2)
    assert cut.returncode == 1
    assert cut.stderr.decode() == f"symgate: cannot write {earlier}: File too large\n"
    assert earlier.read_bytes() == b"an earlier profile"
    (work / "a-dir").mkdir()
    onto_a_directory = symbolize(work / "a-dir")
    assert onto_a_directory.returncode == 1
    assert onto_a_directory.stderr.decode() == (f"symgate: cannot write {work / 'a-dir'}: it is "
                                                "a directory\n")
    assert sorted(os.listdir(work)) == ["a-dir", "earlier.pb.gz", "new.pb.gz"]

    replaced = symbolize(earlier, umask=0o077)
    assert replaced.returncode == 0, replaced.stderr
    assert earlier.read_bytes() == streamed.stdout
    assert earlier.stat().st_mode & 0o777 == 0o604
    assert sorted(os.listdir(work)) == ["a-dir", "earlier.pb.gz", "new.pb.gz"]


def test_cli_output_may_have_any_name_the_file_system_takes(tmp_path: Path, elfs: ElfSet
                                                           ) -> None:
    """The temp file beside FILE kept 200 characters of FILE's name, which NAME_MAX (255)
    counts in bytes: a name of 120 Cyrillic letters and .pb.gz (246 bytes, which open(2)
    takes) made a temp name of 264 bytes, and -o FILE failed with 'File name too long'."""
    source = tmp_path / "in.pb.gz"
    source.write_bytes(gzip.compress(make_profile(
        [(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog))]).SerializeToString()))
    work = tmp_path / "out"
    work.mkdir()
    out = work / ("\u0436" * 120 + ".pb.gz")
    assert len(os.fsencode(out.name)) == 246
    for _ in range(2):  # made, then replaced
        result = subprocess.run(["symgate", "symbolize", str(source), "--debug-dir",
                                 str(tmp_path / "none"), "-o", str(out)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert parse(out.read_bytes()).location
        assert os.listdir(work) == [out.name]


def test_cli_output_into_a_directory_that_takes_no_new_file(tmp_path: Path, elfs: ElfSet
                                                            ) -> None:
    """A FILE that may be written in a directory that takes no new file (immutable here; not
    writable to the user, as a file an administrator made for it in theirs): the temp file
    beside it could not be made, and -o FILE failed with 'Operation not permitted', where it
    had been written. It is written into, as a plain open does."""
    source = tmp_path / "in.pb.gz"
    source.write_bytes(gzip.compress(make_profile(
        [(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog))]).SerializeToString()))
    work = tmp_path / "out"
    work.mkdir()
    out = work / "out.pb.gz"
    out.write_bytes(b"an earlier profile")
    done = subprocess.run(["chattr", "+i", str(work)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make a directory immutable here: {done.stderr.strip()}")
    try:
        result = subprocess.run(["symgate", "symbolize", str(source), "--debug-dir",
                                 str(tmp_path / "none"), "-o", str(out)],
                                capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["chattr", "-i", str(work)], check=True)
    assert result.returncode == 0, result.stderr
    assert parse(out.read_bytes()).location
    assert os.listdir(work) == [out.name]


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the file another owner: root's to do")
def test_cli_output_stays_the_file_it_is(tmp_path: Path, elfs: ElfSet) -> None:
    """-o FILE replaced FILE by rename: a hard link to it kept the old profile, and a file of
    another owner (a user's, written by root) became root's. It is written into now, as by
    a shell's >; --atomic replaces it, with its mode, owner and group."""
    source = tmp_path / "in.pb.gz"
    source.write_bytes(gzip.compress(make_profile(
        [(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog))]).SerializeToString()))
    out, link = tmp_path / "out.pb.gz", tmp_path / "link.pb.gz"
    out.write_bytes(b"an earlier profile, longer than none" * 1000)
    os.link(out, link)
    os.chown(out, 65534, 65534)
    out.chmod(0o640)
    before = out.stat()

    def symbolize(*flags: str) -> None:
        result = subprocess.run(["symgate", "symbolize", str(source), "--debug-dir",
                                 str(tmp_path / "none"), "-o", str(out), *flags],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr

    symbolize()
    after = out.stat()
    assert (after.st_ino, after.st_nlink, after.st_uid, after.st_gid, after.st_mode) \
        == (before.st_ino, 2, 65534, 65534, before.st_mode)
    assert parse(link.read_bytes()).location and link.read_bytes() == out.read_bytes()
    link.write_bytes(b"the linked profile")
    symbolize("--atomic")
    after = out.stat()
    assert after.st_ino != before.st_ino and after.st_nlink == 1
    assert (after.st_uid, after.st_gid, after.st_mode) == (65534, 65534, before.st_mode)
    assert parse(out.read_bytes()).location and link.read_bytes() == b"the linked profile"
    assert sorted(os.listdir(tmp_path)) == ["in.pb.gz", "link.pb.gz", "out.pb.gz"]
