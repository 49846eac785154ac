"""`symgate inspect`: the troubleshooting table, checked against real upstreams and a server."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from yarl import URL

from symbolize.pprof.profile_pb2 import Profile
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, SymgateFactory
from tests.processes import run_in_thread
from tests.test_env_proxy import ForwardProxy

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py

UNKNOWN = "feedface" * 5


def profile(elfs: ElfSet) -> bytes:
    p = Profile()
    p.string_table.extend(["", "/usr/bin/prog", elfs.prog.build_id, "[vdso]", "/usr/bin/app",
                           "/usr/lib/libdone.so", elfs.other.build_id, "/opt/mystery", UNKNOWN,
                           "[kernel.kallsyms]"])
    p.mapping.add(id=1, memory_start=0x555500001000, memory_limit=0x555500002000,
                  filename=1, build_id=2)
    p.mapping.add(id=2, memory_start=0x7FFF00000000, memory_limit=0x7FFF00002000, filename=3)
    p.mapping.add(id=3, memory_start=0x400000, memory_limit=0x401000, filename=4)
    p.mapping.add(id=4, memory_start=0x7F0000000000, memory_limit=0x7F0000010000, filename=5,
                  build_id=6, has_functions=True)
    p.mapping.add(id=5, memory_start=0x7F1000000000, memory_limit=0x7F1000010000, filename=7,
                  build_id=8)
    p.mapping.add(id=6, memory_start=0xFFFFFFFF81000000, memory_limit=0xFFFFFFFF82000000,
                  filename=9, build_id=6)
    # A library the process had mapped, but nothing sampled in it: no location lies in it.
    p.mapping.add(id=7, memory_start=0x7F2000000000, memory_limit=0x7F2000010000, filename=5,
                  build_id=6)
    for m in p.mapping[:6]:
        p.location.add(id=m.id, mapping_id=m.id, address=m.memory_start + 0x10)
    return gzip.compress(p.SerializeToString())


async def inspect(tmp_path: Path, upstreams: list[str], server: str, *flags: str
                  ) -> subprocess.CompletedProcess[str]:
    source = tmp_path / "profile.pb.gz"
    config = tmp_path / "inspect.toml"
    config.write_text("".join(f'[[upstreams]]\nurl = "{u}"\n' for u in upstreams))
    return await run_in_thread(["symgate", "inspect", str(source), "--config", str(config),
                                "--server", server, "--timeout", "1", *flags], timeout=60)


async def test_inspect_explains_every_mapping(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream,
    elfs: ElfSet, tmp_path: Path
) -> None:
    sg = await start_symgate([debuginfod.url])
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200  # now cached
    (tmp_path / "profile.pb.gz").write_bytes(profile(elfs))
    result = await inspect(tmp_path, [debuginfod.url], sg.url, "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["mapping_id"]: r for r in json.loads(result.stdout)}
    size = elfs.prog.debug.stat().st_size
    assert [(c["where"], c["status"], c["size"]) for c in rows[1]["checks"]] == [
        (debuginfod.url, "200", size), ("symgate cache", "200", size)]
    assert rows[1]["would_symbolize"] and "debug info available" in rows[1]["verdict"]
    assert rows[2]["build_id"] is None and "[vdso] is not a file" in rows[2]["verdict"]
    assert "no build ID" in rows[3]["verdict"] and not rows[3]["would_symbolize"]
    assert "HasFunctions is already true" in rows[4]["verdict"]
    assert [c["status"] for c in rows[5]["checks"]] == ["404", "504"]  # 504: not cached
    assert "not on any upstream" in rows[5]["verdict"]
    # /symbolize leaves the kernel alone: not asked anywhere, though an upstream has its ID.
    assert not rows[6]["would_symbolize"] and not rows[6]["checks"]
    assert "the kernel's or a module's code" in rows[6]["verdict"]
    # Nor a mapping no location lies in, as the server does not (rewrite.sampled), though an
    # upstream has its ID: it was "debug info available: /symbolize will fill this mapping in".
    assert not rows[7]["would_symbolize"] and not rows[7]["checks"]
    assert "no location of the profile lies in it" in rows[7]["verdict"]
    # Nothing was fetched by the cache check (only-if-cached).
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="not_cached") == 1
    assert await sg.metric("symgate_cache_entries") == 1


async def test_inspect_asks_the_sources_in_the_order_the_server_does(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    """Local directories and servers, mixed, are asked in the order listed: the table's
    columns and the verdict follow it. The directories came first whatever the order, and
    the verdict named one as the source when the server fetched from the upstream before
    it."""
    sg = await start_symgate([debuginfod.url])
    local = tmp_path / "dir"
    local.mkdir()
    shutil.copy(elfs.prog.debug, local / "prog.debug")
    (tmp_path / "profile.pb.gz").write_bytes(profile(elfs))
    config = tmp_path / "mixed.toml"
    config.write_text(f'[[upstreams]]\nurl = "{debuginfod.url}"\n'
                      f'[[upstreams]]\npath = "{local}"\n')
    result = await run_in_thread(["symgate", "inspect", str(tmp_path / "profile.pb.gz"),
                                  "--config", str(config), "--server", sg.url, "--json"],
                                 timeout=60)
    assert result.returncode == 0, result.stderr
    row = next(r for r in json.loads(result.stdout) if r["mapping_id"] == 1)
    assert [(c["where"], c["status"]) for c in row["checks"]] == [
        (debuginfod.url, "200"), (f"dir:{local}", "200"), ("symgate cache", "504")]
    assert f"debug info available from {debuginfod.url}" in row["verdict"]


async def test_inspect_names_an_unreachable_upstream_in_a_table(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream,
    elfs: ElfSet, tmp_path: Path
) -> None:
    faults.first_byte_delay = 5
    sg = await start_symgate([debuginfod.url])
    (tmp_path / "profile.pb.gz").write_bytes(profile(elfs))
    slow = faults.url_for("slow-first-byte")
    result = await inspect(tmp_path, [debuginfod.url, slow], sg.url)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    header = out.splitlines()[0].split()
    assert header[:6] == ["ID", "FILE", "RANGE", "BUILD", "ID", "HAS_FUNCTIONS"]
    assert f"[2] {slow}" in out and "[3] symgate cache" in out
    line5 = next(ln for ln in out.splitlines() if ln.startswith("5 "))
    assert UNKNOWN in line5 and "timeout" in line5
    assert f"upstream unreachable: {slow} (timeout)" in out
    assert "0x555500001000-0x555500002000" in out


def test_inspect_rejects_a_file_that_is_not_a_profile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pb"
    bad.write_bytes(b"definitely not protobuf")
    result = subprocess.run(["symgate", "inspect", str(bad)], capture_output=True, text=True)
    assert result.returncode == 1 and "not a pprof profile" in result.stderr


def test_inspect_of_an_unlisted_tenant_where_the_server_refuses_it_says_so(
    elfs: ElfSet, tmp_path: Path
) -> None:
    """Where [tenants.""] has tokens, the server answers a tenant it does not list 401
    (cf3524d): judged by the global upstreams, as it was, its profile read as served."""
    source = tmp_path / "profile.pb.gz"
    source.write_bytes(profile(elfs))
    config = tmp_path / "closed.toml"
    config.write_text('[tenants.""]\ntokens = ["a-token-long-enough-1234"]\n')
    result = subprocess.run(["symgate", "inspect", str(source), "--config", str(config),
                             "--tenant", "acme"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "DEBUGINFOD_URLS": "http://127.0.0.1:9/"})
    assert result.returncode == 1 and not result.stdout, result
    assert "tenant 'acme' is not in the configuration" in result.stderr
    assert "the server answers this tenant's requests 401" in result.stderr


async def _inspect_through(tmp_path: Path, elfs: ElfSet, url: str, headers: dict[str, str]
                           ) -> dict[int, dict[str, Any]]:
    """`symgate inspect --json` of the fixtures' profile, asking the upstream at `url` with
    `headers` (as its config gives them): its rows by mapping id."""
    (tmp_path / "profile.pb.gz").write_bytes(profile(elfs))
    config = tmp_path / "inspect.toml"
    table = ", ".join(f'{name} = "{value}"' for name, value in headers.items())
    config.write_text(f'[[upstreams]]\nurl = "{url}/"\nheaders = {{ {table} }}\n')
    result = await run_in_thread(["symgate", "inspect", str(tmp_path / "profile.pb.gz"),
                                  "--config", str(config), "--json"], timeout=60)
    assert result.returncode == 0, result.stderr
    return {r["mapping_id"]: r for r in json.loads(result.stdout)}


async def test_inspect_asks_an_upstream_with_its_configured_headers(
    elfs: ElfSet, tmp_path: Path
) -> None:
    # A private upstream that wants its token, given in the config as the server sends it.
    from aiohttp import web

    from tests.harness import serve_loopback

    token = "Bearer a-private-upstream-token"

    async def private(request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != token:
            return web.Response(status=401)
        return web.Response(body=elfs.prog.debug.read_bytes(),
                            content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/buildid/{rest:.*}", private)
    runner, url = await serve_loopback(app)
    try:
        rows = await _inspect_through(tmp_path, elfs, url, {"Authorization": token})
    finally:
        await runner.cleanup()
    assert [c["status"] for c in rows[1]["checks"]] == ["200"], rows[1]


async def test_inspect_reaches_upstreams_through_the_environments_proxy(
    elfs: ElfSet, faults: FaultUpstream, tmp_path: Path,
) -> None:
    """At a site whose one way out is HTTP_PROXY, the server reaches its upstreams through it;
    inspect asked them directly, and blamed the network ("unreachable") for every file."""
    from aiohttp import web

    from tests.harness import serve_loopback

    forward_proxy = ForwardProxy()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward_proxy.handle)
    runner, forward_proxy.url = await serve_loopback(app)
    upstream = f"http://debuginfod.symgate-test.invalid:{URL(faults.url).port}/ok"
    (tmp_path / "profile.pb.gz").write_bytes(profile(elfs))
    config = tmp_path / "inspect.toml"
    config.write_text(f'[[upstreams]]\nurl = "{upstream}"\n')
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    try:
        result = await run_in_thread(["symgate", "inspect", str(tmp_path / "profile.pb.gz"),
                                      "--config", str(config), "--json"],
                                     env={**env, "HTTP_PROXY": forward_proxy.url}, timeout=60)
    finally:
        await runner.cleanup()
    assert result.returncode == 0, result.stderr
    rows = {r["mapping_id"]: r for r in json.loads(result.stdout)}
    assert [c["status"] for c in rows[1]["checks"]] == ["200"], rows[1]
    assert forward_proxy.asked


async def test_inspect_follows_only_the_redirects_the_server_follows(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path
) -> None:
    """An upstream that redirects to another origin, not in its redirect_hosts: the server
    refuses the redirect (502), so /symbolize never gets the file. inspect followed it with
    aiohttp's defaults, said "debug info available", and took the upstream's configured
    credentials to that other host."""
    from aiohttp import web

    from proxy.config import UpstreamConfig
    from tests.harness import serve_loopback

    asked: list[dict[str, str]] = []

    async def mirror(request: web.Request) -> web.StreamResponse:
        asked.append(dict(request.headers))
        return web.Response(body=elfs.prog.debug.read_bytes(),
                            content_type="application/octet-stream")

    mirror_app = web.Application()
    mirror_app.router.add_get("/buildid/{rest:.*}", mirror)
    mirror_runner, mirror_url = await serve_loopback(mirror_app)

    async def redirecting(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(mirror_url + request.path)

    app = web.Application()
    app.router.add_get("/buildid/{rest:.*}", redirecting)
    runner, url = await serve_loopback(app)
    headers = {"X-Api-Key": "a-private-upstream-key"}
    try:
        sg = await start_symgate([UpstreamConfig(url=f"{url}/", headers=headers)])
        served = (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0]
        assert served == 502 and not asked  # the server's answer: refused, never followed
        rows = await _inspect_through(tmp_path, elfs, url, headers)
    finally:
        await runner.cleanup()
        await mirror_runner.cleanup()
    assert not [h for h in asked if "X-Api-Key" in h], asked  # the credentials stay home
    assert not asked, asked  # nor by inspect: nothing is asked of that host
    [check] = rows[1]["checks"]
    assert check["status"] == "error" and "redirect_hosts" in check["reason"], check
    assert "debug info available" not in rows[1]["verdict"]
    assert "redirect" in rows[1]["verdict"], rows[1]["verdict"]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_timeout_no_check_can_keep_is_refused(tmp_path: Path, elfs: ElfSet, value: str
                                                ) -> None:
    """--timeout 0 (often "no limit" elsewhere) timed every check out at once: each upstream
    was reported "timeout", the verdict blaming the network path of healthy upstreams."""
    (tmp_path / "profile.pb.gz").write_bytes(profile(elfs))
    (tmp_path / "inspect.toml").write_text("upstreams = []\n")
    for cmd in (["inspect", str(tmp_path / "profile.pb.gz"), "--config",
                 str(tmp_path / "inspect.toml")],
                ["symbolize", str(tmp_path / "profile.pb.gz"), "-o", str(tmp_path / "o"),
                 "--server", "http://127.0.0.1:9"]):
        result = subprocess.run(["symgate", *cmd, "--timeout", value], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 2, result
        assert "--timeout: not a number of seconds above 0" in result.stderr


@pytest.mark.parametrize(("args", "said"), [
    (["inspect", "p.pb.gz", "--token-file", "t"], "--token-file needs --server"),
    (["inspect", "p.pb.gz", "--token-file", "t", "--tenant", "a"], "--token-file needs"),
    (["symbolize", "p.pb.gz", "-o", "o", "--tenant", "a"], "--tenant needs --server"),
    (["symbolize", "p.pb.gz", "-o", "o", "--tenant", "a", "--token-file", "t"],
     "--token-file and --tenant need --server"),
    (["symbolize", "p.pb.gz", "-o", "o", "--timeout", "5"], "--timeout needs --server"),
    (["symbolize", "p.pb.gz", "-o", "o", "--timeout", "5", "--tenant", "a", "--token-file", "t"],
     "--token-file, --tenant and --timeout need --server"),
])
def test_a_token_tenant_or_timeout_for_no_server_is_a_usage_error(
        args: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """They went nowhere, and the profile was judged or symbolized as if they were not given
    (inspect's --tenant and --timeout alone are the configuration's upstreams': no server
    needed). symbolize's --timeout is told apart from its default, which offline is no error
    (test_symbolize_cli) and which its help still names."""
    from proxy.tools.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 2
    assert said in capsys.readouterr().err


def test_symbolizes_timeout_default_is_in_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.tools.cli import main

    with pytest.raises(SystemExit):
        main(["symbolize", "--help"])
    assert "seconds, with --server (default 120)" in " ".join(capsys.readouterr().out.split())


async def test_inspect_judges_a_tenants_requests_by_its_own_sources_and_view_of_the_cache(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """`--tenant`: inspect asked the global upstreams and the shared cache alone, so a tenant
    served by a private server (its debug file cached in its own scope) was told its mapping
    had no debug info anywhere, and one with `symbolize = false` that it would be filled in."""
    from dataclasses import replace

    from proxy.config import TenantConfig
    from tests.harness import fast_upstream

    token = "a-token-long-enough-1234"
    private = replace(fast_upstream(faults.url_for("auth")),
                      headers={"Authorization": "Bearer sesame"})
    sg = await start_symgate([faults.url_for("notfound")], tenants={
        "a": TenantConfig(upstreams=(private,), tokens=(token,)),
        "off": TenantConfig(symbolize=False)})
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path, headers={"Authorization": f"Bearer {token}"}))[0] == 200
    await sg.settled()
    source = tmp_path / "profile.pb.gz"
    source.write_bytes(profile(elfs))
    config = tmp_path / "inspect.toml"
    config.write_text(
        f'[[upstreams]]\nurl = "{faults.url_for("notfound")}"\n'
        f'[tenants.a]\ntokens = ["{token}"]\nupstreams = [{{ url = "{private.url}", '
        'headers = { Authorization = "Bearer sesame" } }]\n'
        '[tenants.off]\nsymbolize = false\n')
    (tmp_path / "token").write_text(token + "\n")

    async def rows(*flags: str) -> dict[int, dict[str, Any]]:
        result = await run_in_thread(["symgate", "inspect", str(source), "--config",
                                      str(config), "--server", sg.url, "--json", *flags],
                                     timeout=60)
        assert result.returncode == 0, result.stderr
        return {r["mapping_id"]: r for r in json.loads(result.stdout)}

    shared = (await rows())[1]
    assert [c["status"] for c in shared["checks"]] == ["404", "504"], shared
    assert shared["verdict"].startswith("debug info not on any upstream"), shared
    tenant = (await rows("--tenant", "a", "--token-file", str(tmp_path / "token")))[1]
    assert [(c["where"], c["status"]) for c in tenant["checks"]] == [
        (private.url, "200"), ("symgate cache", "200")], tenant
    assert tenant["verdict"].startswith(f"debug info available from {private.url}"), tenant
    off = (await rows("--tenant", "off"))[1]
    assert off["verdict"] == ('[tenants."off"] symbolize = false: /symbolize returns this '
                              "tenant's profiles unchanged"), off
    # A name the configuration lacks (misspelt, say) is judged as the server judges it, and said.
    result = await run_in_thread(["symgate", "inspect", str(source), "--config", str(config),
                                  "--json", "--tenant", "acme"], timeout=60)
    assert result.returncode == 0 and "tenant 'acme' is not in the configuration" \
        in result.stderr, result.stderr
    assert [c["status"] for c in json.loads(result.stdout)[0]["checks"]] == ["404"]
