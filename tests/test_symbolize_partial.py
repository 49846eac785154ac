"""A mapping that cannot be symbolized costs that mapping alone: with no debug info anywhere,
an upstream that lies or dies mid-body, or the deadline passed, the other mappings are still
symbolized, the headers say why the rest were not, nothing of a bad upstream's bytes is kept,
and work cut off by the deadline goes on to serve the next request."""

from __future__ import annotations

import asyncio
import gc
from dataclasses import replace

import pytest
from elftools.elf.elffile import ELFFile

from proxy.config import TenantConfig
from proxy.keys import ArtifactKey
from proxy.web.state import STATE
from tests.elfs import ElfSet
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, SymgateFactory, eventually, fast_upstream
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, parse, post, symbolize_config


async def test_missing_debug_info_for_one_mapping_does_not_fail_the_others(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    good = place(elfs.prog, BASES["prog"])
    unknown = replace(place(elfs.shlib, BASES["libmix.so"]), build_id="ab" * 20)
    profile = make_profile([(good, code_addresses(elfs.prog)[:40]),
                            (unknown, code_addresses(elfs.shlib)[:40])])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "not_found=1"
    out = parse(body)
    assert out.mapping[0].has_functions and not out.mapping[1].has_functions
    assert all(not loc.line for loc in out.location if loc.mapping_id == 2)
    assert await sg.metric("symgate_symbolize_mappings_total", result="not_found") == 1


@pytest.mark.parametrize("mode", ["wrong-bytes", "reset-mid-body", "truncated"])
async def test_an_upstream_that_lies_or_dies_mid_body_costs_its_mapping_only(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream, elfs: ElfSet,
    mode: str,
) -> None:
    sg = await start_symgate(
        [fast_upstream(faults.url_for(mode))], symbolize=symbolize_config(),
        tenants={"good": TenantConfig(upstreams=(debuginfod.url,))})
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])])
    raw = profile.SerializeToString()
    status, headers, body = await post(sg, raw)
    assert status == 200 and body == raw, headers
    # Wrong bytes are the upstream lying (malformed); a body cut short is its failure.
    reason = "malformed" if mode == "wrong-bytes" else "upstream_error"
    assert headers["X-Symgate-Mappings-Unsymbolized"] == f"{reason}=1"
    assert faults.count(mode) >= 1
    # Nothing of the bad bytes stayed: no artifact, no table, no remembered failure.
    state = sg.runner.app[STATE]
    key = ArtifactKey.parse(elfs.prog.build_id, "debuginfo")
    assert state.service.cache.peek("", key) is None
    assert await state.repo.get_symbol_table("", elfs.prog.build_id) is None
    assert await state.repo.artifacts_of(elfs.prog.build_id) == []
    assert await state.repo.negatives_of(elfs.prog.build_id) == []
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 0
    # The same server, asked through a sound upstream, symbolizes the same profile.
    status, headers, body = await post(sg, raw, **{"X-Scope-OrgID": "good"})
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    assert parse(body).mapping[0].has_functions


async def test_a_liar_before_an_upstream_that_has_the_file_costs_nothing(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """The first upstream sends another build ID's file, the second has the right one: the
    fetch is made again at once, with the liar asked after it, and the first profile is
    symbolized (it was left bare, and its answer kept so by a caching backend)."""
    sg = await start_symgate([fast_upstream(faults.url_for("wrong-bytes")), debuginfod.url],
                             symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers
    assert parse(body).mapping[0].has_functions
    # Once for the debug file, once for the executable (its program headers): each lie cost
    # one answer, then the other upstream had the file.
    assert faults.count("wrong-bytes") == 2
    for kind in ("debuginfo", "executable"):
        assert await sg.metric("symgate_verification_failures_total", kind=kind,
                               reason="build_id_mismatch",
                               upstream=faults.url_for("wrong-bytes")) == 1


async def test_deadline_answers_with_what_is_ready(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """The upstream holds its answer until the first profile has been answered: the deadline
    answered it, not the fetch (a 3 s delay against a 2.5 s bound was a race on a loaded
    machine)."""
    sg = await start_symgate(
        [fast_upstream(faults.url_for("hold"), first_byte_timeout_s=60)],
        symbolize=symbolize_config(deadline_s=0.5))
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    status, headers, _ = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Mappings-Unsymbolized"] == "deadline=1"
    assert faults.count("hold") >= 1  # asked, and still held
    faults.release.set()

    async def warmed() -> bool:  # fetches and build went on after the answer
        return (await sg.metric("symgate_symtab_builds_total", result="ok") >= 1
                and await sg.metric("symgate_cache_entries") == 2)  # debuginfo, executable

    await eventually(warmed)
    status, headers, _ = await post(sg, profile.SerializeToString())
    assert headers["X-Symgate-Mappings-Symbolized"] == "1", (
        headers["X-Symgate-Mappings-Unsymbolized"])


async def test_a_zero_deadline_is_no_deadline(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """As 0 is no bound for the configuration's other limits. It was a deadline already past:
    every profile was answered `deadline=1` before any table, even an open one, was looked at,
    and a server so configured never symbolized anything."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(deadline_s=0.0))
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    status, headers, _ = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers


async def test_a_mapping_whose_addresses_are_in_no_function_is_told_apart_from_no_symbols(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """Its table is built and has functions, but none of the mapping's addresses is in one:
    they are in the file's first, read-only segment (its headers, .dynsym, .rela), before any
    function, as a profiler that maps the whole file may send them. `unresolved`, not the
    `no_symbols` of a file without any."""
    good = place(elfs.prog, BASES["prog"])
    with elfs.prog.executable.open("rb") as f:
        first = next(s for s in ELFFile(f).iter_segments() if s["p_type"] == "PT_LOAD")
        assert not first["p_flags"] & 1 and first["p_offset"] == 0  # not executable
        head = list(range(first["p_vaddr"] + 0x40, first["p_vaddr"] + first["p_filesz"], 8))
    whole_head = replace(good, memory_start=good.runtime(first["p_vaddr"]),
                         memory_limit=good.runtime(first["p_vaddr"] + 0x1000), file_offset=0)
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    profile = make_profile([(good, code_addresses(elfs.prog)[:10]), (whole_head, head)])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "unresolved=1"
    assert await sg.metric("symgate_symbolize_mappings_total", result="unresolved") == 1
    assert await sg.metric("symgate_symbolize_mappings_total", result="no_symbols") == 0
    out = parse(body)
    assert all(not loc.line for loc in out.location if loc.mapping_id == 2)


async def test_an_upstream_failing_both_files_leaves_no_failure_unretrieved(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The executable is fetched beside the debug file. When both fail, the executable's
    failure was left unread whenever it came first: asyncio then logged it as an ERROR with
    its traceback ("Task exception was never retrieved"), one per mapping, in the logs an
    operator alerts on, for an upstream error already counted and answered."""
    sg = await start_symgate([fast_upstream(faults.url_for("status500"), retries=0)],
                             symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:20])])
    status, headers, _body = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Mappings-Unsymbolized"] == "upstream_error=1"
    await sg.settled()
    gc.collect()  # a task's unread failure is reported as the task is collected
    await asyncio.sleep(0)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
