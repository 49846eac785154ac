"""Tenants (X-Scope-OrgID) can have symbolization turned off, or be given upstreams of their
own in place of the global ones."""

from __future__ import annotations

from proxy.config import TenantConfig
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, SymgateFactory
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, post, symbolize_config


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
