"""Tenants (X-Scope-OrgID) can have symbolization turned off, or be given upstreams of their
own in place of the global ones."""

from __future__ import annotations

import asyncio
from pathlib import Path

from proxy.config import TenantConfig, UploadConfig
from tests.elfs import ElfSet, build_program
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, SymgateFactory
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, parse, post, symbolize_config

ACME = "acme-token-of-sixteen-or-more"
ADMIN = "admin-token-of-sixteen-or-more"


async def test_tenants_can_be_disabled_or_given_their_own_upstreams(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate(
        [debuginfod.url], symbolize=symbolize_config(),
        tenants={"off": TenantConfig(symbolize=False),
                 "own": TenantConfig(upstreams=(faults.url_for("ok"),))})
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])])
    raw = profile.SerializeToString()
    status, headers, body = await post(sg, raw, **{"X-Scope-OrgID": "off"})
    assert status == 200 and body == raw and headers["X-Symgate-Symbolize"] == "disabled"
    status, headers, _ = await post(sg, raw, **{"X-Scope-OrgID": "own"})
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert faults.count("ok") >= 1  # the tenant's upstream, not the global one, was asked


async def test_a_tenants_uploaded_symbols_never_answer_another_asking_at_the_same_moment(
    start_symgate: SymgateFactory, tmp_path: Path,
) -> None:
    """Tenants without sources of their own share the shared scope but not their uploads:
    one's resolution of a build ID under way must not answer another's profile."""
    out = tmp_path / "bin"
    out.mkdir()
    own = [build_program(tmp_path / "src", out, f"own{i}", 300 + i) for i in range(12)]
    config = dict(symbolize=symbolize_config(),
                  upload=UploadConfig(admin_tokens=("admin-token-of-sixteen-or-more",)),
                  tenants={"acme": TenantConfig(tokens=(ACME,))})
    sg = await start_symgate(**config)
    for elf in own:
        status, _, _ = await sg.request(
            "PUT", f"/buildid/{elf.build_id}/debuginfo", data=elf.debug.read_bytes(),
            headers={"Authorization": f"Bearer {ACME}"})
        assert status == 201
    raw = make_profile([(place(elf, BASES["prog"] + i * 0x10000000), code_addresses(elf)[:5])
                        for i, elf in enumerate(own)]).SerializeToString()
    for _ in range(3):
        await sg.stop()
        sg = await start_symgate(**config)  # no table open: each is looked up again
        (_, acme, _), (_, other, _), (_, anonymous, _) = await asyncio.gather(
            post(sg, raw, Authorization=f"Bearer {ACME}"),
            post(sg, raw, **{"X-Scope-OrgID": "other"}), post(sg, raw))
        assert acme["X-Symgate-Mappings-Symbolized"] == str(len(own))
        assert other["X-Symgate-Mappings-Symbolized"] == "0"
        assert anonymous["X-Symgate-Mappings-Symbolized"] == "0"


async def test_a_shared_table_from_the_executable_never_hides_a_tenants_own_debug_file(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path,
) -> None:
    """The shared scope has the executable alone (a local debug directory), so its table has
    bare names; tenant A's own server has the debug file. A's profile is named from that, with
    lines, as it is on a server where nobody asked before A: the shared scope's miss of the
    debug file was judged by the global upstreams, not by A's, as a remembered 404 is."""
    tree = tmp_path / "debug" / ".build-id" / elfs.prog.build_id[:2]
    tree.mkdir(parents=True)
    (tree / elfs.prog.build_id[2:]).symlink_to(elfs.prog.executable)
    sg = await start_symgate(
        [faults.url_for("notfound")],
        symbolize=symbolize_config(debug_dirs=(tmp_path / "debug",)),
        tenants={"a": TenantConfig(upstreams=(faults.url_for("ok"),))})
    raw = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])]
                       ).SerializeToString()

    def lines(body: bytes) -> int:
        return sum(1 for loc in parse(body).location for line in loc.line if line.line)

    status, headers, shared = await post(sg, raw)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert lines(shared) == 0  # the executable's names alone
    status, headers, own = await post(sg, raw, **{"X-Scope-OrgID": "a"})
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert faults.count("ok") >= 1  # A's server was asked for its debug file
    assert lines(own) > 0
    status, headers, again = await post(sg, raw)
    assert lines(again) == 0  # and what A's server gave stays A's


async def test_a_tenants_own_table_built_by_another_process_comes_before_the_shared_one(
    start_symgate: SymgateFactory, elfs: ElfSet, tmp_path: Path,
) -> None:
    """Two serving processes on one data dir (serve --workers 2). The shared scope has the
    executable alone, and the other process has its table (bare names) open when tenant
    ACME's upload of the debug file is taken in, and its table built, here: ACME's profiles
    there were named by the shared table still, without lines, for as long as it stayed
    open, by which process the kernel handed the connection to."""
    config = dict(symbolize=symbolize_config(),
                  upload=UploadConfig(admin_tokens=(ADMIN,)),
                  tenants={"acme": TenantConfig(tokens=(ACME,))})
    here, there = [await start_symgate(data_dir=tmp_path / "d", **config) for _ in range(2)]
    elf = elfs.prog
    raw = make_profile([(place(elf, BASES["prog"]), code_addresses(elf)[:20])]
                       ).SerializeToString()

    def lines(body: bytes) -> int:
        return sum(1 for loc in parse(body).location for line in loc.line if line.line)

    status, _, _ = await here.request(
        "PUT", f"/buildid/{elf.build_id}/executable", data=elf.executable.read_bytes(),
        headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 201
    await here.built()
    status, headers, shared = await post(there, raw)
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert lines(shared) == 0  # the executable's names alone, its table open there
    status, _, _ = await here.request(
        "PUT", f"/buildid/{elf.build_id}/debuginfo", data=elf.debug.read_bytes(),
        headers={"Authorization": f"Bearer {ACME}"})
    assert status == 201
    await here.built()  # ACME's table, built here from its upload
    assert lines((await post(here, raw, Authorization=f"Bearer {ACME}"))[2]) > 0, "here"
    for _ in range(2):
        status, headers, own = await post(there, raw, Authorization=f"Bearer {ACME}")
        assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1"
        assert lines(own) > 0
        assert lines((await post(there, raw))[2]) == 0  # and the shared one stays bare
