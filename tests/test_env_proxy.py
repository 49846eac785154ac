"""Sites whose one way out is an HTTP proxy set HTTP(S)_PROXY: upstream requests go through
it, looked up once per origin (proxy.sources.env_routes), and NO_PROXY still exempts hosts."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from proxy.config import UpstreamConfig
from tests.elfs import ElfSet, build_id_tree
from tests.faults import FakeNetwork, FaultUpstream
from tests.harness import SymgateFactory, fast_upstream

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


class ForwardProxy:
    """A plain HTTP forward proxy on loopback: takes absolute-form requests, passes them on,
    and keeps the URLs it was asked for. Names under .invalid, which only it resolves (as an
    egress proxy resolves names the site's own DNS does not), are 127.0.0.1 to it."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.authorizations: list[str] = []
        self.url = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.asked.append(str(request.url))
        self.authorizations.append(request.headers.get("Proxy-Authorization", ""))
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "proxy-authorization", "proxy-connection")}
        url = request.url
        if (url.host or "").endswith(".invalid"):
            url = url.with_host("127.0.0.1")
        async with aiohttp.ClientSession() as s, s.get(url, headers=headers,
                                                       allow_redirects=False) as r:
            body = await r.read()
            passed = {k: v for k, v in r.headers.items()
                      if k.lower() not in ("transfer-encoding", "content-length",
                                           "content-encoding", "connection")}
            return web.Response(status=r.status, body=body, headers=passed)


@pytest.fixture
async def forward_proxy() -> AsyncIterator[ForwardProxy]:
    proxy = ForwardProxy()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    proxy.url = f"http://127.0.0.1:{port}"
    yield proxy
    await runner.cleanup()


async def test_upstream_requests_go_through_http_proxy(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
    forward_proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTP_PROXY", forward_proxy.url.replace("://", "://user:secret@"))
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    sg = await start_symgate([faults.url_for("ok")])
    for build_id in (elfs.prog.build_id, elfs.other.build_id):
        status, _, body = await sg.get(f"/buildid/{build_id}/debuginfo")
        assert status == 200 and body[:4] == b"\x7fELF"
    upstream = faults.url_for("ok")
    assert forward_proxy.asked == [f"{upstream}/buildid/{elfs.prog.build_id}/debuginfo",
                                   f"{upstream}/buildid/{elfs.other.build_id}/debuginfo"]
    assert all(a.startswith("Basic ") for a in forward_proxy.authorizations)
    # A miss goes the same way, and is still remembered.
    missing = "/buildid/" + "ab" * 20 + "/debuginfo"
    assert (await sg.get(missing))[0] == 404
    assert (await sg.get(missing))[0] == 404
    assert len(forward_proxy.asked) == 3


async def test_no_proxy_exempts_an_upstream(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
    forward_proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTP_PROXY", forward_proxy.url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    sg = await start_symgate([faults.url_for("ok")])
    status, _, _ = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200
    assert forward_proxy.asked == []
    assert faults.count("ok") == 1


async def test_netrc_credentials_reach_the_upstream_unless_it_has_its_own(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login site password s3cret\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    sg = await start_symgate([faults.url_for("ok")])
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo"))[0] == 200
    expected = aiohttp.encode_basic_auth("site", "s3cret")
    assert faults.headers[-1].get("Authorization") == expected
    # An upstream configured with its own Authorization keeps it: netrc does not override.
    own = fast_upstream(faults.url_for("ok"))
    own = dataclasses.replace(own, headers={"Authorization": "Bearer configured"})
    sg2 = await start_symgate([own])
    assert (await sg2.get(f"/buildid/{elfs.other.build_id}/debuginfo"))[0] == 200
    assert faults.headers[-1].get("Authorization") == "Bearer configured"


async def test_netrcs_default_credentials_do_not_follow_a_redirect_to_another_host(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """~/.netrc's `default` entry is the credentials for the site's upstreams: a host their
    redirects name is the upstream's choice, and gets only what a `machine` entry names it
    for."""
    mirror = FaultUpstream(elfs)
    await mirror.start()
    try:
        netrc = tmp_path / "netrc"
        netrc.write_text("default login site password s3cret\n")
        netrc.chmod(0o600)
        monkeypatch.setenv("NETRC", str(netrc))
        port = URL(mirror.url).port
        path = f"/buildid/{elfs.prog.build_id}/debuginfo"
        faults.redirect_target = f"http://localhost:{port}/ok{path}"
        up = fast_upstream(faults.url_for("redirect-to"), redirect_hosts=[f"localhost:{port}"])
        sg = await start_symgate([up], data_dir=tmp_path / "default")
        assert (await sg.get(path))[0] == 200
        assert faults.headers[-1].get("Authorization") == aiohttp.encode_basic_auth(
            "site", "s3cret")
        assert "Authorization" not in mirror.headers[-1]
        # Named for the mirror's host, they are the operator's for it.
        netrc.write_text("machine localhost login mirror password m1rror\n")
        sg = await start_symgate([up], data_dir=tmp_path / "machine")
        assert (await sg.get(path))[0] == 200
        assert mirror.headers[-1].get("Authorization") == aiohttp.encode_basic_auth(
            "mirror", "m1rror")
    finally:
        await mirror.stop()


async def test_credentials_in_an_upstream_url_are_its_authorization(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DEBUGINFOD_URLS=http://user:pass@host/ is an upstream configured with credentials: a
    ~/.netrc `default` entry must not be added to them (aiohttp refused every such request:
    a 500), and a redirect within the upstream's origin keeps them, as headers are kept."""
    netrc = tmp_path / "netrc"
    netrc.write_text("default login any password other\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    expected = aiohttp.encode_basic_auth("site", "s3cret")
    # An absolute Location, as a server behind a proxy that knows its public name sends.
    faults.redirect_target = f"{faults.url_for('ok')}/buildid/{elfs.other.build_id}/debuginfo"
    for mode, elf in (("ok", elfs.prog), ("redirect-to", elfs.other)):
        sg = await start_symgate([faults.url_for(mode).replace("://", "://site:s3cret@")],
                                 data_dir=tmp_path / mode)
        status, _, body = await sg.get(f"/buildid/{elf.build_id}/debuginfo")
        assert status == 200, body
        assert faults.headers[-1].get("Authorization") == expected, mode


async def test_an_upstream_only_the_proxy_resolves_may_redirect_within_itself(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
    forward_proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At a site whose one way out is the proxy, symgate cannot resolve the upstream's name:
    a redirect within the upstream's own origin was refused all the same ("cannot resolve"),
    for an address rule that has nothing to compare there."""
    monkeypatch.setenv("HTTP_PROXY", forward_proxy.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    upstream = f"http://debuginfod.symgate-test.invalid:{URL(faults.url).port}"
    sg = await start_symgate([f"{upstream}/redirect"])
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes(), body
    assert forward_proxy.asked[-1] == f"{upstream}/ok/buildid/{elfs.prog.build_id}/debuginfo"


async def test_a_redirect_through_the_proxy_cannot_reach_inside_by_rebinding(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
    forward_proxy: ForwardProxy, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through a proxy, symgate connects to the proxy, which resolves the redirect's target
    itself: a listed name that answers a public address to symgate's check, then 127.0.0.1
    (or an address of the site) to the proxy, must not lead the proxy inside."""
    inside = FaultUpstream(elfs)  # a service on the proxy's loopback
    await inside.start()
    try:
        net = FakeNetwork(monkeypatch)  # the proxy resolves through it too, as the site's DNS
        net.answers["cdn.test"] = ["93.184.216.34", "127.0.0.1"]
        monkeypatch.setenv("HTTP_PROXY", forward_proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        port = URL(inside.url).port
        path = f"/buildid/{elfs.prog.build_id}/debuginfo"
        faults.redirect_target = f"http://cdn.test:{port}/ok{path}"
        up = fast_upstream(net.public_url(faults, "redirect-to"),
                           redirect_hosts=[f"cdn.test:{port}"])
        sg = await start_symgate([up])
        status, _, body = await sg.get(path)
        assert status == 502 and b"HTTP proxy" in body, body
        assert inside.count("ok") == 0 and net.off_box == []
        # Followed: the upstream's own name on another port, which the proxy resolves for its
        # every request anyway; an address, which cannot answer differently to the proxy (the
        # test network routes both addresses to any port on loopback).
        net.routes.add("93.184.216.34")
        for served, host in enumerate(("up.test", "93.184.216.34"), start=1):
            faults.redirect_target = f"http://{host}:{port}/ok{path}"
            sg = await start_symgate([dataclasses.replace(
                up, redirect_hosts=(f"{host}:{port}",))],
                data_dir=sg.config.server.data_dir.with_name(host))
            status, _, body = await sg.get(path)
            assert status == 200 and body == elfs.prog.debug.read_bytes(), host
            assert forward_proxy.asked[-1] == faults.redirect_target
            assert inside.count("ok") == served
    finally:
        await inside.stop()


@pytest.mark.parametrize("proxy", ["http://[::1", "http://127.0.0.1:99999",
                                   "user:secret@127.0.0.1:9", "socks5://user:secret@127.0.0.1:9",
                                   "http://user:secret%E2%82%AC@127.0.0.1:9"])
async def test_an_http_proxy_variable_that_is_no_http_url_is_a_502_that_names_it(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, proxy: str,
) -> None:
    """An HTTP_PROXY that is no URL (an unclosed IPv6 address, a port past 65535) raised
    ValueError from deep in every fetch: a 500 that said nothing, the upstreams after the
    first never asked, not even a local directory. One without a scheme (curl takes
    "user:password@proxy:3128") was aiohttp's InvalidURL, whose text, the proxy's password in
    it, went to every client in its 502; a SOCKS one was spoken plain HTTP to. A password
    outside Latin-1 was a 500 whose log quoted its character."""
    monkeypatch.setenv("HTTP_PROXY", proxy)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    body = await _unusable_environment_answer(start_symgate, faults, elfs, tmp_path)
    assert b"an HTTP proxy the environment names (HTTP_PROXY, HTTPS_PROXY)" in body


@pytest.mark.parametrize(("netrc", "why"), [
    (b"machine 127.0.0.1 login us\xe9r password secret\n", b"is not UTF-8"),
    (b"machine 127.0.0.1 login a:b password secret\n", b"cannot be sent as Basic"),
    ("default login a password secret\u20ac\n".encode(), b"cannot be sent as Basic")])
async def test_a_netrc_whose_credentials_cannot_be_sent_is_a_502_that_names_it(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, netrc: bytes, why: bytes,
) -> None:
    """A ~/.netrc that is not UTF-8 (Python's netrc raised UnicodeDecodeError, which aiohttp
    does not catch), or whose entry for the upstream aiohttp's BasicAuth refuses (a ':' in
    the login, a password outside Latin-1), raised from deep in every fetch: a 500 that said
    nothing, the upstreams after it never asked, the log quoting the password's character."""
    (tmp_path / "netrc").write_bytes(netrc)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    body = await _unusable_environment_answer(start_symgate, faults, elfs, tmp_path)
    assert b"~/.netrc (or $NETRC)" in body and why in body, body


async def _unusable_environment_answer(start_symgate: SymgateFactory, faults: FaultUpstream,
                                       elfs: ElfSet, tmp_path: Path) -> bytes:
    """The answer, a 502, for a file only the HTTP upstream could have, whose route the
    environment makes unusable, from a server whose local directory (listed after it) still
    serves; the upstream never reached, and no secret quoted."""
    tree = tmp_path / "debug"
    build_id_tree(tree, elfs.prog.build_id, elfs.prog.debug, elfs.prog.executable)
    sg = await start_symgate([fast_upstream(faults.url_for("ok")),
                              UpstreamConfig(path=tree, rescan_s=0)])
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo")
    assert status == 200 and body == elfs.prog.debug.read_bytes()  # from the directory
    status, _, body = await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo")
    assert status == 502, body
    assert b"secret" not in body and b"20ac" not in body.lower()
    assert faults.count("ok") == 0  # never reached, past a route it could not use
    return body


async def test_routes_remembered_stay_bounded_however_many_origins_redirects_name() -> None:
    # An upstream chooses the hosts its redirects name: one sending each miss to a new port
    # grew the remembered routes for as long as symgate ran.
    from proxy.sources.env_routes import MAX_ORIGINS, EnvironmentRoutes

    routes = EnvironmentRoutes()
    first = await routes.route(URL("http://127.0.0.1:1/buildid/ab/debuginfo"))
    for port in range(2, 3 * MAX_ORIGINS):
        await routes.route(URL(f"http://127.0.0.1:{port}/x"))
    assert len(routes) == MAX_ORIGINS
    # The oldest went first; asked again, it is looked up again, the same route.
    assert await routes.route(URL("http://127.0.0.1:1/y")) == first
    assert len(routes) == MAX_ORIGINS
