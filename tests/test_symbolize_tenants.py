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
from tests.symbolize_helpers import BASES, post, symbolize_config

ACME = "acme-token-of-sixteen-or-more"


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
