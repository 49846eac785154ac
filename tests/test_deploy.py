"""The container image without Docker (no engine runs here): its Dockerfile, its entrypoint on
the image's defaults, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import aiohttp
import pytest

from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, free_port
from tests.processes import wait_until_serving

ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"


def test_dockerfile_lints_clean_with_hadolint() -> None:
    result = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_shell_scripts_pass_shellcheck() -> None:
    result = subprocess.run(["shellcheck", str(ENTRYPOINT), str(ROOT / ".ci" / "run")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_builds_a_small_non_root_image_with_a_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) == 2  # multi-stage: no compiler in the image
    user = re.search(r"^USER (\S+)", text, re.M)
    assert user and user.group(1) not in ("0", "root")
    assert re.search(r'^VOLUME \["/data"\]', text, re.M)
    assert re.search(r"^EXPOSE 8002$", text, re.M)
    assert re.search(r'CMD \["symgate-entrypoint", "healthcheck"\]', text)
    assert re.search(r'^ENTRYPOINT \["symgate-entrypoint"\]', text, re.M)
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), f"Dockerfile copies {path}, which is not in the repo"


def _env(tmp_path: Path, port: int, upstreams: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "SYMGATE_LISTEN": f"127.0.0.1:{port}",
            "SYMGATE_DATA_DIR": str(tmp_path / "data"), "DEBUGINFOD_URLS": upstreams,
            "HOME": str(tmp_path), **extra}


async def _start(env: dict[str, str], *args: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        str(ENTRYPOINT), *args, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    await wait_until_serving(f"http://{env['SYMGATE_LISTEN']}", proc)
    return proc


async def _healthcheck(env: dict[str, str]) -> int:
    proc = await asyncio.create_subprocess_exec(str(ENTRYPOINT), "healthcheck", env=env)
    return await proc.wait()


async def test_entrypoint_serves_on_the_image_defaults(
    debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    env = _env(tmp_path, free_port(), debuginfod.url)
    proc = await _start(env)
    try:
        assert await _healthcheck(env) == 0  # the image's HEALTHCHECK command
        async with aiohttp.ClientSession() as s, s.get(
                f"http://{env['SYMGATE_LISTEN']}/buildid/{elfs.prog.build_id}/debuginfo") as r:
            assert r.status == 200 and await r.read() == elfs.prog.debug.read_bytes()
        assert (tmp_path / "data" / "symgate.sqlite").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert await _healthcheck(env) == 1  # and it tells when the server is gone


@pytest.mark.parametrize("host", ["[::]", "[::1]"])
async def test_the_healthcheck_finds_a_server_listening_on_ipv6(
    debuginfod: Debuginfod, tmp_path: Path, host: str
) -> None:
    """SYMGATE_LISTEN=[::]:8002 (an IPv6 site) binds IPv6 only: the HEALTHCHECK asked
    127.0.0.1, found nothing, and the container was marked unhealthy (and restarted, where
    an orchestrator acts on that) while it served."""
    env = {**_env(tmp_path, free_port(), debuginfod.url),
           "SYMGATE_LISTEN": f"{host}:{free_port()}"}
    proc = await _start(env, "serve", "--workers", "1")
    try:
        assert await _healthcheck(env) == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert await _healthcheck(env) == 1


async def test_admin_commands_through_the_entrypoint_see_the_servers_data(
    debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    # README: "Other commands run through the same entrypoint: docker run ... symgate cache
    # stats". They must read the server's data dir (SYMGATE_DATA_DIR), not the user's home.
    config = tmp_path / "symgate.toml"
    config.write_text("[cache]\nmax_bytes = \"1GiB\"\n")
    env = _env(tmp_path, free_port(), debuginfod.url, SYMGATE_CONFIG=str(config))
    proc = await _start(env)
    try:
        async with aiohttp.ClientSession() as s, s.get(
                f"http://{env['SYMGATE_LISTEN']}/buildid/{elfs.prog.build_id}/debuginfo") as r:
            assert r.status == 200
            await r.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    result = subprocess.run([str(ENTRYPOINT), "cache", "stats", "--json"], capture_output=True,
                            text=True, env=env)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert (stats["entries"], stats["max_bytes"]) == (1, 1 << 30)  # its cache, its config
    assert not (tmp_path / ".local").exists()


def test_entrypoint_passes_other_commands_to_symgate(tmp_path: Path) -> None:
    result = subprocess.run([str(ENTRYPOINT), "--version"], capture_output=True, text=True,
                            env=_env(tmp_path, 1, ""))
    assert result.returncode == 0 and result.stdout.startswith("symgate ")


@pytest.mark.parametrize("grace_s", [30.0, 0.5], ids=["within-grace", "past-grace"])
async def test_sigterm_finishes_responses_under_way_and_leaves_no_temp_files(
    faults: FaultUpstream, elfs: ElfSet, tmp_path: Path, grace_s: float
) -> None:
    faults.chunk_size, faults.chunk_delay = 1024 * 1024, 0.1  # the 24 MiB file takes ~2.5 s
    config = tmp_path / "symgate.toml"
    config.write_text(f"[server]\nshutdown_grace_s = {grace_s}\naccess_log = false\n")
    env = _env(tmp_path, free_port(), faults.url_for("slow-body"), SYMGATE_CONFIG=str(config))
    proc = await _start(env)
    url = f"http://{env['SYMGATE_LISTEN']}/buildid/{elfs.big.build_id}/debuginfo"
    got = 0
    complete = False
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        try:
            async for chunk in r.content.iter_chunked(1 << 16):
                if not got:
                    proc.send_signal(signal.SIGTERM)  # mid-download
                got += len(chunk)
            complete = True
        except aiohttp.ClientPayloadError:
            pass
    assert await asyncio.wait_for(proc.wait(), 60) == 0
    size = elfs.big.debug.stat().st_size
    if grace_s > 5:
        assert complete and got == size  # finished within the grace period
    else:
        assert not complete and got < size  # cut off, never a short body that looks whole
    tmp_dir = tmp_path / "data" / "cache" / "tmp"
    assert not any(tmp_dir.iterdir()), list(tmp_dir.iterdir())
    with pytest.raises(aiohttp.ClientConnectionError):
        async with aiohttp.ClientSession() as s, s.get(url):
            pass


def test_serve_refuses_a_bad_config_with_the_key_named(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nshutdown_grace = 3\n")
    result = subprocess.run([str(ENTRYPOINT), "serve"], capture_output=True, text=True,
                            env=_env(tmp_path, free_port(), "", SYMGATE_CONFIG=str(config)))
    assert result.returncode == 78  # EX_CONFIG: a restart would fail the same way
    assert f"{config}: server.shutdown_grace: unknown key" in result.stderr
