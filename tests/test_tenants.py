"""Tenant scope: what came through a tenant's own sources is that tenant's alone.

An artifact or symbol table fetched through `[tenants.X] upstreams` (typically a private
server with credentials) is cached under X's scope; /buildid and /symbolize answer it to X's
requests only. What came from the global sources stays shared. Tenants with tokens must prove
who they are.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import aiohttp
from multidict import CIMultiDict

from proxy.artifacts.index import key_hash
from proxy.config import MAX_TENANT, SymbolizeConfig, TenantConfig, UploadConfig, UpstreamConfig
from proxy.keys import ArtifactKey, Kind
from proxy.web.state import STATE
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import Symgate, SymgateFactory, eventually, fast_upstream
from tests.profiles import code_addresses, make_profile, place

BASE = 0x5555_5555_4000
TOKEN_A = "a-token-long-enough-1234"
TOKEN_B = "b-token-long-enough-5678"
ADMIN = "an-admin-token-long-enough-5678"
NAMELESS = "the-nameless-tenants-token-9012"


def private(faults: FaultUpstream) -> UpstreamConfig:
    """A server that answers only with its credentials: 'Bearer sesame'."""
    return replace(fast_upstream(faults.url_for("auth")),
                   headers={"Authorization": "Bearer sesame"})


def profile_of(elfs: ElfSet) -> bytes:
    return make_profile([(place(elfs.prog, BASE), code_addresses(elfs.prog)[:20])]
                        ).SerializeToString()


async def test_a_tenants_private_artifacts_and_tables_reach_that_tenant_only(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate(
        [faults.url_for("notfound")],
        symbolize=SymbolizeConfig(build_workers=1),
        tenants={"a": TenantConfig(upstreams=(private(faults),)), "b": TenantConfig()})
    bid = elfs.prog.build_id
    path = f"/buildid/{bid}/debuginfo"
    raw = profile_of(elfs)

    # Tenant A fetches through its private server, and symbolizes with it.
    status, _, body = await sg.get(path, headers={"X-Scope-OrgID": "a"})
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    status, headers, _ = await sg.request(
        "POST", "/symbolize", data=raw,
        headers={"Content-Type": "application/octet-stream", "X-Scope-OrgID": "a"})
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"

    # Nobody else sees either: not without a tenant, not as tenant B, not by HEAD.
    for headers_ in ({}, {"X-Scope-OrgID": "b"}, {"X-Scope-OrgID": "c"}):
        status, _, _ = await sg.get(path, headers=headers_)
        assert status == 404, headers_
        status, _ = await sg.head(path, headers=headers_)
        assert status == 404, headers_
        status, _, _ = await sg.get(path, headers={**headers_, "Cache-Control": "only-if-cached"})
        assert status == 504, headers_
        status, headers, body = await sg.request(
            "POST", "/symbolize", data=raw,
            headers={"Content-Type": "application/octet-stream", **headers_})
        assert status == 200 and body == raw, headers_
        assert headers["X-Symgate-Mappings-Unsymbolized"] == "not_found=1", headers_
    assert faults.count("auth") >= 1

    # Tenant A still gets its own, from the cache now.
    before = faults.count("auth")
    status, _, body = await sg.get(path, headers={"X-Scope-OrgID": "a"})
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert faults.count("auth") == before


async def test_the_shared_cache_answers_every_tenant(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A tenant with its own sources still sees what the global sources gave everyone."""
    sg = await start_symgate(
        [faults.url_for("ok")], tenants={"a": TenantConfig(upstreams=(private(faults),))})
    path = f"/buildid/{elfs.other.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 200
    before = faults.count("auth")
    assert (await sg.get(path, headers={"X-Scope-OrgID": "a"}))[0] == 200
    assert faults.count("auth") == before and faults.count("ok") == 1


async def test_a_tenants_misses_are_its_own(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A 404 remembered for one scope does not answer another scope's request."""
    sg = await start_symgate(
        [faults.url_for("notfound")],
        tenants={"a": TenantConfig(upstreams=(private(faults),))})
    path = f"/buildid/{elfs.prog.build_id}/executable"
    assert (await sg.get(path))[0] == 404
    assert (await sg.get(path))[0] == 404
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="executable",
                           outcome="negative_hit") == 1
    status, _, body = await sg.get(path, headers={"X-Scope-OrgID": "a"})
    assert status == 200 and body == elfs.prog.executable.read_bytes()


async def test_tokens_prove_the_tenant(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate(
        [faults.url_for("notfound")],
        tenants={"a": TenantConfig(upstreams=(private(faults),), tokens=(TOKEN_A,))})
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    bearer = {"Authorization": f"Bearer {TOKEN_A}"}
    # Naming a tenant that has tokens is not enough; a wrong token is refused.
    status, headers, body = await sg.get(path, headers={"X-Scope-OrgID": "a"})
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    assert b"needs its bearer token" in body
    status, _, _ = await sg.get(path, headers={"Authorization": "Bearer " + "x" * 24})
    assert status == 401
    status, _, _ = await sg.get(path, headers={"X-Scope-OrgID": "b", **bearer})
    assert status == 401
    # The token alone names the tenant (gdb can send a header, not always two).
    status, _, body = await sg.get(path, headers=bearer)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    status, _, _ = await sg.get(path, headers={"X-Scope-OrgID": "a", **bearer})
    assert status == 200
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="rejected") == 3
    # Still nothing for the shared scope, and the server keeps serving.
    assert (await sg.get(path))[0] == 404
    assert (await sg.get("/healthz"))[0] == 200


async def test_a_malformed_tenant_header_is_400(start_symgate: SymgateFactory) -> None:
    sg = await start_symgate([])
    path = "/buildid/" + "ab" * 20 + "/debuginfo"
    assert (await sg.get(path, headers={"X-Scope-OrgID": "x" * 256}))[0] == 400
    assert (await sg.get(path, headers={"X-Scope-OrgID": "a\tb"}))[0] == 400


async def _status_of_raw(sg: Symgate, head: bytes) -> bytes:
    """The status line of the answer to `head`, sent as it is (aiohttp's client sends header
    values as UTF-8 only)."""
    host, port = sg.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        return (await asyncio.wait_for(reader.read(), 10)).split(b"\r\n", 1)[0]
    finally:
        writer.close()


async def test_tenant_headers_and_tokens_that_are_not_utf8_are_refused_not_500(
    start_symgate: SymgateFactory, elfs: ElfSet
) -> None:
    """aiohttp keeps a header's bytes that are not UTF-8 as surrogate escapes: such an
    X-Scope-OrgID became a scope whose key could not be hashed, and such a bearer token one
    that could not be compared, each a 500 with a traceback."""
    sg = await start_symgate(
        [], tenants={"a": TenantConfig(tokens=(TOKEN_A,))},
        upload=UploadConfig(admin_tokens=(ADMIN,)))
    bid = elfs.prog.build_id
    admin = f"Authorization: Bearer {ADMIN}\r\n".encode()
    for method, path, extra, status in [
            (b"GET", f"/buildid/{bid}/debuginfo", b"X-Scope-OrgID: caf\xe9\r\n", b"400"),
            (b"HEAD", f"/buildid/{bid}/debuginfo", b"X-Scope-OrgID: \xff\r\n", b"400"),
            (b"GET", f"/metadata?key=buildid&value={bid}", b"X-Scope-OrgID: \xff\r\n",
             b"400"),
            (b"POST", "/symbolize", b"X-Scope-OrgID: \xff\r\n"
             b"Content-Type: application/octet-stream\r\nContent-Length: 0\r\n", b"400"),
            (b"PUT", f"/buildid/{bid}/debuginfo", admin + b"X-Scope-OrgID: \xff\r\n"
             b"Content-Length: 0\r\n", b"400"),
            (b"GET", f"/buildid/{bid}/debuginfo", b"Authorization: Bearer \xff\xfe\r\n",
             b"401"),
            (b"PUT", f"/buildid/{bid}/debuginfo", b"Authorization: Bearer \xff\r\n"
             b"Content-Length: 0\r\n", b"401"),
            (b"DELETE", f"/buildid/{bid}/debuginfo", b"Authorization: Bearer \xff\r\n",
             b"401")]:
        head = (method + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + extra
                + b"Connection: close\r\n\r\n")
        line = await _status_of_raw(sg, head)
        assert line.split(b" ")[1] == status, (method, path, extra, line)
    assert (await sg.get("/healthz"))[0] == 200


async def test_a_tenant_name_with_unicode_blanks_around_it_is_another_tenant(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """X-Scope-OrgID is the gateway's name for the tenant, taken as it is: a name that has
    a Unicode space or separator at an end (which str.strip() took off) is another tenant's
    than the one without, and never gets that one's private files. HTTP's own blanks around
    a value are no part of it."""
    sg = await start_symgate([faults.url_for("notfound")],
                             tenants={"acme": TenantConfig(upstreams=(private(faults),))})
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    status, _, body = await sg.get(path, headers={"X-Scope-OrgID": "acme"})
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    for name, status in [("acme\u3000", b"404"), ("\u00a0acme", b"404"), ("acme\u2028", b"404"),
                         ("acme\x85", b"404"), ("\u2003acme\u205f", b"404"),
                         (" \tacme \t", b"200")]:
        for method in (b"GET", b"HEAD"):
            head = (method + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                    b"X-Scope-OrgID: " + name.encode() + b"\r\nConnection: close\r\n\r\n")
            line = await _status_of_raw(sg, head)
            assert line.split(b" ")[1] == status, (name, method, line)
    assert faults.count("auth") == 1  # acme's one fetch; the others asked the global server


async def test_a_bearer_token_with_unicode_blanks_around_it_is_another_token(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A token is compared as it was sent, as the tenant's name is: str.strip() took Unicode
    spaces and separators off either end, so "<token>\u3000" proved the tenant its token
    names. HTTP's own blanks around it are no part of it."""
    sg = await start_symgate([faults.url_for("notfound")],
                             tenants={"a": TenantConfig(upstreams=(private(faults),),
                                                        tokens=(TOKEN_A,))})
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    for token, status in [(TOKEN_A + "\u3000", b"401"), ("\u00a0" + TOKEN_A, b"401"),
                          (TOKEN_A + "\x85", b"401"), (TOKEN_A + " \t", b"200")]:
        for method in (b"GET", b"HEAD"):
            head = (method + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                    b"Authorization: Bearer " + token.encode() + b"\r\n"
                    b"Connection: close\r\n\r\n")
            line = await _status_of_raw(sg, head)
            assert line.split(b" ")[1] == status, (token, method, line)
    assert faults.count("auth") == 1  # the one fetch its own token made


async def test_the_longest_tenant_name_the_config_takes_is_served_and_stored(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A config takes tenant names up to the scope column's width (longer ones it refuses:
    PostgreSQL refused each of their rows, an upload a 503 "retry later" for good), named by
    a token or by X-Scope-OrgID alike."""
    longest = "\u00e9" * MAX_TENANT  # each character two bytes of UTF-8: the column is chars
    sg = await start_symgate([faults.url_for("notfound")],
                             tenants={longest: TenantConfig(upstreams=(private(faults),),
                                                            tokens=(TOKEN_A,))})
    bearer = {"Authorization": f"Bearer {TOKEN_A}"}
    status, _, body = await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo", headers=bearer)
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    status, _, body = await sg.request(
        "PUT", f"/buildid/{elfs.other.build_id}/debuginfo", data=elfs.other.debug.read_bytes(),
        headers={"X-Scope-OrgID": longest, **bearer})
    assert status == 201 and json.loads(body)["scope"] == longest, body
    await sg.settled()
    state = sg.runner.app[STATE]
    for elf in (elfs.prog, elfs.other):  # both rows in SQL: what another process reads
        key = ArtifactKey(elf.build_id, Kind.DEBUGINFO)
        assert await state.repo.get_artifact(key_hash(longest, key)) is not None
    assert (await sg.get(f"/buildid/{elfs.other.build_id}/debuginfo"))[0] == 404


async def test_many_clients_of_two_scopes_at_once(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """20 clients of tenant A and 20 of nobody, at once and staggered, for one build ID that
    only A's server has: A's get it from one fetch, nobody else gets it at all."""
    sg = await start_symgate(
        [faults.url_for("notfound")], tenants={"a": TenantConfig(upstreams=(private(faults),))})
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    want = elfs.big.debug.read_bytes()

    async def one(i: int) -> tuple[str, int, bool]:
        await asyncio.sleep(0.005 * (i % 5))  # staggered: some join a fetch under way
        tenant = "a" if i % 2 else ""
        headers = {"X-Scope-OrgID": tenant} if tenant else {}
        status, _, body = await sg.get(path, headers=headers)
        return tenant, status, body == want

    results = await asyncio.gather(*(one(i) for i in range(40)))
    assert {(t, s, ok) for t, s, ok in results} == {("a", 200, True), ("", 404, False)}
    assert faults.count("auth") == 1  # one fetch for A's twenty clients
    assert faults.count("notfound") == 1  # and one upstream question for the others


async def test_a_tenants_executable_never_marks_a_shared_table(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """The shared table comes from a local debug file; only tenant A's server has the
    executable. A's profile is translated with it, but the shared table keeps no layout of
    A's file, and shared requests go on looking for their own."""
    tree = tmp_path / "debug" / ".build-id" / elfs.prog.build_id[:2]
    tree.mkdir(parents=True)
    (tree / (elfs.prog.build_id[2:] + ".debug")).symlink_to(elfs.prog.debug)
    sg = await start_symgate(
        [faults.url_for("notfound")],
        symbolize=SymbolizeConfig(build_workers=1, debug_dirs=(tmp_path / "debug",)),
        tenants={"a": TenantConfig(upstreams=(private(faults),))})
    raw = profile_of(elfs)
    status, headers, first = await sg.request(
        "POST", "/symbolize", data=raw,
        headers={"Content-Type": "application/octet-stream", "X-Scope-OrgID": "a"})
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert await sg.metric("symgate_symtab_layout_guesses_total") == 0  # A's exe was used
    status, headers, again = await sg.request(
        "POST", "/symbolize", data=raw,
        headers={"Content-Type": "application/octet-stream", "X-Scope-OrgID": "a"})
    assert again == first
    assert await sg.metric("symgate_symtab_layout_guesses_total") == 0  # and kept for A
    state = sg.runner.app[STATE]
    row = await state.repo.get_symbol_table("", elfs.prog.build_id)
    assert row is not None and row.file_layout is None
    status, headers, _ = await sg.request(
        "POST", "/symbolize", data=raw, headers={"Content-Type": "application/octet-stream"})
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert await sg.metric("symgate_symtab_layout_guesses_total") == 1  # guessed, not A's


async def test_the_same_url_with_a_tenants_credentials_is_the_tenants_own(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([fast_upstream(faults.url_for("auth"))],
                             tenants={"a": TenantConfig(upstreams=(private(faults),))})
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    assert (await sg.get(path))[0] == 502  # the shared source has no credentials: 401 upstream
    status, _, body = await sg.get(path, headers={"X-Scope-OrgID": "a"})
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert (await sg.get(path))[0] == 502  # and what A fetched stays A's


async def test_metrics_name_a_tenants_own_server_by_the_tenant_not_its_address(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """/metrics is read by whoever scrapes it, who is no tenant: a tenant's own server is
    "tenant:NAME#N" there, its address (an internal host, a path naming a customer) nowhere."""
    sg = await start_symgate([faults.url_for("notfound")],
                             tenants={"a": TenantConfig(upstreams=(private(faults),))})
    as_a = {"X-Scope-OrgID": "a"}
    assert (await sg.get(f"/buildid/{elfs.prog.build_id}/debuginfo", headers=as_a))[0] == 200
    assert (await sg.get(f"/buildid/{'ab' * 20}/debuginfo", headers=as_a))[0] == 404
    await sg.settled()
    status, _, text = await sg.get("/metrics")
    assert status == 200 and faults.url_for("auth").encode() not in text
    for result, count in (("ok", 1), ("not_found", 1)):
        assert await sg.metric("symgate_upstream_requests_total", upstream="tenant:a#1",
                               result=result) == count
    assert await sg.metric("symgate_negative_writes_total", upstream="tenant:a#1") == 1
    # The global one by its URL, as before.
    assert await sg.metric("symgate_upstream_requests_total",
                           upstream=faults.url_for("notfound"), result="not_found") == 0


async def test_metrics_stay_prometheus_text_whatever_upstreams_and_tenants_are_named(
    start_symgate: SymgateFactory
) -> None:
    """Quotes, backslashes and newlines are escaped in label values, non-ASCII is kept: a
    scraper reads back the very names."""
    url, tenant = 'http://127.0.0.1:9/a"b\\c/é\\n', 'q"\\ \n é'
    sg = await start_symgate([fast_upstream(url)], tenants={
        tenant: TenantConfig(upstreams=(fast_upstream("http://127.0.0.1:9/"),))})
    labels = {key[1] for key in await sg.metrics()}  # parsed as Prometheus reads it
    assert (("result", "ok"), ("upstream", url)) in labels
    assert (("result", "ok"), ("upstream", f"tenant:{tenant}#1")) in labels


async def test_a_tenant_of_global_sources_shares_their_fetches(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """A tenant whose list is global sources only is in the shared scope: one fetch for all."""
    shared = fast_upstream(faults.url_for("slow-body"))
    sg = await start_symgate([shared], tenants={"t": TenantConfig(upstreams=(shared,)),
                                                "u": TenantConfig(upstreams=(shared,))})
    path = f"/buildid/{elfs.big.build_id}/debuginfo"
    results = await asyncio.gather(*(
        sg.get(path, headers={"X-Scope-OrgID": t} if t else {}) for t in ("", "t", "u") * 4))
    assert {(s, b == elfs.big.debug.read_bytes()) for s, _, b in results} == {(200, True)}
    assert faults.count("slow-body") == 1


async def test_two_tenant_headers_are_refused(start_symgate: SymgateFactory) -> None:
    """A gateway that appends its header instead of replacing the client's: trust neither."""
    sg = await start_symgate([])
    headers = CIMultiDict([("X-Scope-OrgID", "a"), ("X-Scope-OrgID", "b")])
    status, _, body = await sg.get("/buildid/" + "ab" * 20 + "/debuginfo", headers=headers)
    assert status == 400 and b"more than one X-Scope-OrgID" in body


async def test_two_authorization_headers_are_refused(start_symgate: SymgateFactory) -> None:
    """Authorization is one field (RFC 9110): the first of two was taken, while a proxy in front
    that appends, or checks the last, judged the request by the other. Trust neither, as for
    X-Scope-OrgID, whether one of them is a tenant's token or not."""
    sg = await start_symgate([], tenants={"a": TenantConfig(tokens=("token-of-tenant-a",))})
    path = "/buildid/" + "ab" * 20 + "/debuginfo"
    for second in ("Bearer token-of-tenant-a", "Bearer nobody"):
        headers = CIMultiDict([("X-Scope-OrgID", "a"),
                               ("Authorization", "Bearer token-of-tenant-a"),
                               ("Authorization", second)])
        status, _, body = await sg.get(path, headers=headers)
        assert status == 400 and b"more than one Authorization" in body
    one = CIMultiDict([("X-Scope-OrgID", "a"), ("Authorization", "Bearer token-of-tenant-a")])
    assert (await sg.get(path, headers=one))[0] == 404  # the token alone is good


async def test_a_client_that_leaves_mid_stream_is_counted_aborted_not_internal(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([fast_upstream(faults.url_for("slow-body"))])
    faults.chunk_size = 256 * 1024
    faults.chunk_delay = 0.1
    async with aiohttp.ClientSession() as session, session.get(
            f"{sg.url}/buildid/{elfs.big.build_id}/debuginfo") as r:
        assert r.status == 200
        await r.content.readexactly(1024)
    # The client is gone; the download goes on and is cached, the request counted aborted.

    async def settled() -> bool:
        return await sg.metric("symgate_requests_total", endpoint="buildid",
                               kind="debuginfo", outcome="aborted") == 1

    await eventually(settled)
    assert await sg.metric("symgate_requests_total", endpoint="buildid", kind="debuginfo",
                           outcome="internal") == 0
    status, _, body = await sg.get(f"/buildid/{elfs.big.build_id}/debuginfo")
    assert status == 200 and body == elfs.big.debug.read_bytes()


async def test_a_section_cut_from_a_tenants_upload_is_never_handed_to_another_tenant(
    start_symgate: SymgateFactory, elfs: ElfSet
) -> None:
    """Tenants without sources of their own share the shared scope, but not their uploads:
    a cut under way from one's upload must not answer another asking for that section."""
    sg = await start_symgate(tenants={"acme": TenantConfig(tokens=(TOKEN_A,))})
    status, _, _ = await sg.request(
        "PUT", f"/buildid/{elfs.big.build_id}/debuginfo", data=elfs.big.debug.read_bytes(),
        headers={"Authorization": f"Bearer {TOKEN_A}"})
    assert status == 201
    path = f"/buildid/{elfs.big.build_id}/section/.symgate_pad"
    acme = asyncio.create_task(sg.get(path, headers={"Authorization": f"Bearer {TOKEN_A}"}))
    await asyncio.sleep(0.02)  # its cut under way
    other = await sg.get(path, headers={"X-Scope-OrgID": "other"})
    anonymous = await sg.get(path)
    assert (await acme)[0] == 200
    assert other[0] == 404 and anonymous[0] == 404


async def test_no_tenants_miss_reaches_the_public_status_page(
    start_symgate: SymgateFactory, faults: FaultUpstream
) -> None:
    """The page at / is public: a tenant's misses name its build IDs and source paths, whether
    it has sources of its own or shares the global ones (then its scope is the shared one)."""
    sg = await start_symgate([faults.url_for("notfound")],
                             tenants={"acme": TenantConfig(tokens=(TOKEN_A,)),
                                      "own": TenantConfig(upstreams=(private(faults),))})
    secret, own, anonymous = "ac" * 20, "0e" * 20, "ab" * 20
    for path, headers in ((f"/buildid/{secret}/source/home/acme/secret-plan.c",
                           {"Authorization": f"Bearer {TOKEN_A}"}),
                          (f"/buildid/{secret}/debuginfo", {"X-Scope-OrgID": "other"}),
                          (f"/buildid/{own}/debuginfo", {"X-Scope-OrgID": "own"}),
                          (f"/buildid/{anonymous}/debuginfo", {})):
        assert (await sg.get(path, headers=headers))[0] == 404, path
    status, _, page = await sg.get("/")
    assert status == 200
    assert anonymous.encode() in page  # a miss of nobody's: shown
    assert secret.encode() not in page and b"secret-plan" not in page
    assert own.encode() not in page


async def test_a_tenant_asking_fewer_global_sources_never_answers_anothers_join_with_404(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Tenant T lists one of the two global servers, so it is in the shared scope and its
    fetches are shared. A client of nobody's that joins T's fetch asks both: the one T asks
    saying 404 is not its answer, the other server's file is (not a 404, which elfutils'
    client would keep for ten minutes)."""
    held = fast_upstream(faults.url_for("hold404"), first_byte_timeout_s=60)
    sg = await start_symgate([held, fast_upstream(faults.url_for("ok"))],
                             tenants={"t": TenantConfig(upstreams=(held,))})
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    tenant = asyncio.create_task(sg.get(path, headers={"X-Scope-OrgID": "t"}))
    await eventually(lambda: faults.count("hold404") == 1)  # T's fetch waits on its server
    anonymous = asyncio.create_task(sg.get(path))

    async def joined() -> bool:
        return await sg.metric("symgate_singleflight_joins_total") == 1

    await eventually(joined)
    faults.release.set()
    assert (await tenant)[0] == 404  # T's one server has not got it
    status, _, body = await anonymous
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    assert faults.count("ok") == 1


async def test_a_request_waiting_for_the_headers_of_a_fetch_that_asks_fewer_sources_counts(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """symgate_fetch_waiters counts the requests that wait for a fetch under way to stream:
    the client of nobody's that waits for the headers of T's fetch (which asks fewer sources:
    its failure is no answer) was left out, so the gauge showed one where two waited behind
    the held upstream. Both counted while they wait, and neither once answered."""
    held = fast_upstream(faults.url_for("hold404"), first_byte_timeout_s=60)
    sg = await start_symgate([held, fast_upstream(faults.url_for("ok"))],
                             tenants={"t": TenantConfig(upstreams=(held,))})
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    tenant = asyncio.create_task(sg.get(path, headers={"X-Scope-OrgID": "t"}))
    await eventually(lambda: faults.count("hold404") == 1)
    anonymous = asyncio.create_task(sg.get(path))

    async def both_wait() -> bool:
        return await sg.metric("symgate_fetch_waiters") == 2

    await eventually(both_wait)
    faults.release.set()
    assert (await tenant)[0] == 404
    assert (await anonymous)[0] == 200
    assert await sg.metric("symgate_fetch_waiters") == 0


async def test_the_nameless_tenants_token_neither_uploads_nor_deletes(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """[tenants.""] tokens let requests that name no tenant in. Taken as a tenant's own
    upload token, such a token wrote into the nameless tenant's scope, which is the shared
    one: its holder's file then answered every tenant, before a tenant's own private server
    was even asked, and it could delete what an admin uploaded there."""
    sg = await start_symgate(
        [faults.url_for("notfound")],
        tenants={"": TenantConfig(tokens=(NAMELESS,)),
                 "a": TenantConfig(upstreams=(private(faults),))},
        upload=UploadConfig(admin_tokens=(ADMIN,)))
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    nameless = {"Authorization": f"Bearer {NAMELESS}"}
    status, _, body = await sg.request(
        "PUT", path, data=elfs.prog.executable.read_bytes(), headers=nameless)
    assert status == 403 and b"admin" in body, (status, body)
    # Before its body: what curl's Expect: 100-continue is told.
    status, _, _ = await sg.request("PUT", path, data=elfs.prog.executable.read_bytes(),
                                    headers={**nameless, "Expect": "100-continue"})
    assert status == 403
    status, _, body = await sg.get(path, headers={"X-Scope-OrgID": "a"})
    assert status == 200 and body == elfs.prog.debug.read_bytes()  # A's own server's
    assert faults.count("auth") == 1
    status, _, _ = await sg.request("PUT", path, data=elfs.prog.debug.read_bytes(),
                                    headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 201
    assert (await sg.request("DELETE", path, headers=nameless))[0] == 403
    status, _, body = await sg.get(path, headers=nameless)  # still reads with it
    assert status == 200 and body == elfs.prog.debug.read_bytes()


async def test_where_requests_naming_no_tenant_need_a_token_naming_an_unlisted_one_does_too(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """[tenants.""] tokens close the server to requests without one (a site's egress to the
    public upstreams, without a gateway). A request naming a tenant no config lists passed,
    as that tenant, into the shared scope and its upstreams: a header any client can send.
    A listed tenant without tokens is the operator's own choice, and stays open."""
    sg = await start_symgate(
        [fast_upstream(faults.url_for("ok"))],
        tenants={"": TenantConfig(tokens=(NAMELESS,)), "open": TenantConfig()})
    path = f"/buildid/{elfs.prog.build_id}/debuginfo"
    for headers in ({}, {"X-Scope-OrgID": "zzz"}, {"X-Scope-OrgID": "Open"}):
        status, _, body = await sg.get(path, headers=headers)
        assert status == 401, (headers, status, body)
        assert (await sg.head(path, headers=headers))[0] == 401
    assert faults.count("ok") == 0
    status, _, body = await sg.get(path, headers={"X-Scope-OrgID": "open"})
    assert status == 200 and body == elfs.prog.debug.read_bytes()
    status, _, body = await sg.get(path, headers={"Authorization": f"Bearer {NAMELESS}"})
    assert status == 200 and body == elfs.prog.debug.read_bytes()


async def test_a_private_fetch_under_way_and_its_files_after_reach_no_other_process_client(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    """Two serving processes on one data dir (serve --workers 2). Tenant A's fetches of a
    build ID's files, sources and a section are held at its private server in one: no other
    client of either process joins them or follows them (by GET, HEAD, only-if-cached), nor
    gets what they committed, which A's clients get from either."""
    held = replace(private(faults), url=faults.url_for("hold"), first_byte_timeout_s=60)
    tenants = {"a": TenantConfig(upstreams=(held,), tokens=(TOKEN_A,)),
               "b": TenantConfig(tokens=(TOKEN_B,))}
    one, two = [await start_symgate([faults.url_for("notfound")], data_dir=tmp_path / "d",
                                    tenants=tenants) for _ in range(2)]
    bid = elfs.prog.build_id
    paths = [f"/buildid/{bid}/{kind}" for kind in ("debuginfo", "executable",
                                                   f"source{elfs.prog.sources[0]}",
                                                   "section/.text")]
    a = {"Authorization": f"Bearer {TOKEN_A}"}
    outsiders: list[tuple[dict[str, str], int]] = [
        ({}, 404), ({"X-Scope-OrgID": "c"}, 404), ({"X-Scope-OrgID": "A"}, 404),
        ({"Authorization": f"Bearer {TOKEN_B}"}, 404), ({"X-Scope-OrgID": " a"}, 401)]

    async def nothing_for_outsiders() -> None:
        for sg in (one, two):
            for path in paths:
                for headers, status in outsiders:
                    assert (await sg.get(path, headers=headers))[0] == status, (path, headers)
                    assert (await sg.head(path, headers=headers))[0] == status
                    cached = {**headers, "Cache-Control": "only-if-cached"}
                    assert (await sg.get(path, headers=cached))[0] in (status, 504)
            query = f"/metadata?key=buildid&value={bid}"
            for headers, _ in outsiders[:4]:
                assert json.loads((await sg.get(query, headers=headers))[2])["results"] == []

    fetches = [asyncio.create_task(one.get(path, headers=a)) for path in paths]

    async def all_of_a_wait() -> bool:  # the section's cut on its parent's fetch too
        return await one.metric("symgate_fetch_waiters") == len(paths)

    await eventually(all_of_a_wait)
    await nothing_for_outsiders()
    assert await all_of_a_wait()  # and nobody else joined them
    faults.release.set()
    assert [(await f)[0] for f in fetches] == [200] * len(paths)
    await one.settled()
    await nothing_for_outsiders()
    asked = faults.count("hold")
    for path in paths:
        assert (await two.get(path, headers=a))[0] == 200, path
    assert faults.count("hold") == asked  # what the other process committed
