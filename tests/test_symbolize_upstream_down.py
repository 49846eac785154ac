"""A site's own executables (symbolize.debug_dirs) symbolize its profiles while the upstream
that would have their debug files is down; the debug file is asked for again once the miss
TTL has passed, and its lines then replace the executable's bare names."""

from __future__ import annotations

import asyncio
from pathlib import Path

from proxy.config import NegativeConfig
from proxy.web.state import STATE
from symbolize.pprof.profile_pb2 import Profile
from tests.elfs import Elf, ElfSet
from tests.faults import FaultUpstream
from tests.harness import Symgate, SymgateFactory, fast_upstream
from tests.profiles import code_addresses, frames_of, make_profile, place
from tests.symbolize_helpers import BASES, post, symbolize_config

# Long enough that the steps between two asks fit in it on a loaded machine.
TTL_S = 2.0


def executables_only(root: Path, elf: Elf) -> Path:
    """A .build-id tree that holds the executable alone, as a site's own build output may."""
    d = root / ".build-id" / elf.build_id[:2]
    d.mkdir(parents=True)
    (d / elf.build_id[2:]).symlink_to(elf.executable)
    return root


async def _lines(sg: Symgate, elf: Elf) -> tuple[dict[str, str], list[int]]:
    profile = make_profile([(place(elf, BASES["prog"]), code_addresses(elf)[10:40])])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200, body
    out = Profile.FromString(body)
    return headers, [frames_of(out, loc)[-1].line for loc in out.location if loc.line]


async def test_local_executables_serve_while_the_upstream_is_down_then_its_debug_file(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet, tmp_path: Path
) -> None:
    faults.flaky_failures = 10_000  # every request a 500, until the upstream recovers below
    sg = await start_symgate(
        [fast_upstream(faults.url_for("flaky"), retries=0)],
        negative=NegativeConfig(not_found_initial_ttl_s=TTL_S, not_found_ttl_s=TTL_S),
        symbolize=symbolize_config(debug_dirs=(executables_only(tmp_path / "own", elfs.prog),)))

    headers, lines = await _lines(sg, elfs.prog)
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"  # from the executable's symbols
    assert lines and not any(lines)  # and so without lines
    assert faults.count("flaky") == 1

    # The TTL passes with the upstream still down: the same table serves, not built again.
    await _wait(TTL_S)
    headers, lines = await _lines(sg, elfs.prog)
    assert headers["X-Symgate-Mappings-Symbolized"] == "1" and not any(lines)
    assert faults.count("flaky") == 2
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 1

    # The upstream recovers: once the TTL has passed again, the debug file is fetched and
    # its table, with lines, replaces the executable's.
    faults.flaky_failures = 0
    headers, lines = await _lines(sg, elfs.prog)
    assert not any(lines)  # still believed: the TTL has not passed since the last ask
    await _wait(TTL_S)
    headers, lines = await _lines(sg, elfs.prog)
    assert headers["X-Symgate-Mappings-Symbolized"] == "1"
    assert any(lines)  # the debug file's (crt code has none in either)
    assert await sg.metric("symgate_symtab_builds_total", result="ok") == 2
    rec = await sg.runner.app[STATE].repo.get_symbol_table("", elfs.prog.build_id)
    assert rec is not None and rec.source_key.endswith("/debuginfo")
    assert rec.expires_at is None  # a debug file's table is not asked about again

    # From here on the table serves without asking anybody.
    asked = faults.count("flaky")
    await _wait(TTL_S)
    await _lines(sg, elfs.prog)
    assert faults.count("flaky") == asked


async def _wait(seconds: float) -> None:
    await asyncio.sleep(seconds + 0.1)
