"""What /symbolize refuses, and how: a body that is not a profile, of the wrong type, too
large or a gzip bomb, or one naming more build IDs than a request may, gets a 4xx that says
why, before anything is fetched (a corrupt sample: as soon as it is found), and the server goes
on serving; a build ID no debuginfod could have is reported, not fetched; and a large body that
is sound is read whole, not mistaken for a bad one."""

from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.web.state import STATE
from symbolize.pprof.profile_pb2 import Line, Profile
from symbolize.pprof.profile_raw_pb2 import RawProfile
from tests.elfs import ElfSet, build_id_tree
from tests.faults import FaultUpstream
from tests.harness import Debuginfod, SymgateFactory
from tests.processes import descendants, run_in_thread
from tests.profiles import code_addresses, make_profile, place
from tests.symbolize_helpers import BASES, parse, peak_rss, post, reset_peak_rss, symbolize_config

pytestmark = pytest.mark.one_database  # SQL is not its subject: tests/conftest.py


@pytest.mark.parametrize(("body", "status", "reason"), [
    (b"", 400, b"empty body"),
    (b"this is not a profile at all", 400, b"not a pprof profile"),
    (gzip.compress(b"x" * 1000)[:20], 400, b"truncated gzip"),
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + b"\xff" * 20, 400, b"not valid gzip"),
    # Whole, but its CRC-32 is not its content's: damaged on the way, so not believed.
    (gzip.compress(b"\x32\x00" * 500)[:-8] + b"\0\0\0\0" + (1000).to_bytes(4, "little"), 400,
     b"not valid gzip"),
    # A whole gzip member, then bytes that begin no other: not dropped without a word.
    (gzip.compress(b"\x32\x00" * 500) + b"\0" * 8, 400, b"after its last member"),
], ids=["empty", "not-a-profile", "truncated-gzip", "bad-deflate", "bad-checksum",
        "trailing-bytes"])
async def test_bad_bodies_get_a_clear_4xx_and_the_server_survives(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, body: bytes, status: int,
    reason: bytes,
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    got, _, text = await post(sg, body)
    assert got == status and reason in text, text
    assert b"RawProfile" not in text  # symgate's own reading of a Profile is nobody's business
    assert (await sg.get("/healthz"))[0] == 200
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="rejected") == 1


@pytest.mark.parametrize("ctype", ["text/plain", "application/json; charset=utf-8"])
async def test_a_body_that_is_not_a_profile_by_its_type_is_415(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, ctype: str
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    status, _, text = await post(sg, profile.SerializeToString(), **{"Content-Type": ctype})
    assert status == 415 and b"unsupported Content-Type" in text, text
    status, _, _ = await post(sg, profile.SerializeToString(),
                              **{"Content-Type": "application/x-protobuf"})
    assert status == 200
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="rejected") == 1


async def test_a_body_that_its_content_encoding_does_not_decode_is_400(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """aiohttp fails such a body as it is read: that was a 500, "internal error"."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    status, _, text = await post(sg, b"\x1f\x8b" + b"\0" * 50, **{"Content-Encoding": "gzip"})
    assert status == 400 and b"request body is unreadable" in text, text
    assert await sg.metric("symgate_symbolize_profiles_total", outcome="rejected") == 1
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    status, headers, _ = await post(sg, gzip.compress(profile.SerializeToString()),
                                    **{"Content-Encoding": "gzip"})
    assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", headers


async def test_a_body_sent_deflated_is_taken_and_other_codings_are_415(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """symgate inflates a body's Content-Encoding itself (proxy.web.content_encoding): the
    codings it knows, and a clear 415 for the others."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    status, headers, body = await post(sg, zlib.compress(profile.SerializeToString()),
                                       **{"Content-Encoding": "deflate"})
    assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", headers
    assert parse(body).function  # answered inflated, as it was read
    status, _, text = await post(sg, profile.SerializeToString(), **{"Content-Encoding": "br"})
    assert status == 415 and b"unsupported Content-Encoding 'br'" in text, text


async def test_a_deflated_body_whose_end_inflates_to_more_than_a_piece_is_taken(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """isal's inflater of the zlib format takes in all of its input and holds back output past
    the piece asked for: that rest came only by asking again, with no input, which the
    inflating did not do once its input was used up, so a sound deflated body whose last bytes
    inflate to more than a piece was refused as one that "ends before its compressed stream
    does" (with 64 KiB pieces to measure it, any body whose last 64 KiB were not the
    end; a long comment does that here)."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    profile.string_table.append("x" * 200_000)
    profile.comment.append(len(profile.string_table) - 1)
    for coding, compress in (("deflate", zlib.compress), ("gzip", gzip.compress)):
        status, headers, body = await post(sg, compress(profile.SerializeToString()),
                                           **{"Content-Encoding": coding})
        assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", body[:200]
        assert parse(body).comment == profile.comment


async def test_a_profile_with_a_corrupt_sample_is_400(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """Samples are passed on unread: one that is not a Sample message was answered 200
    `symbolized`, in a profile no pprof reader could parse."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    raw = RawProfile.FromString(profile.SerializeToString())
    raw.sample[2] = b"\x0a\x05\x01"  # location_id, packed: 5 bytes declared, 1 there
    for body in (raw.SerializeToString(), gzip.compress(raw.SerializeToString())):
        status, _, text = await post(sg, body)
        assert status == 400, text
        assert b"not a pprof profile: sample 2 is not a valid Sample message" in text, text


async def test_a_profile_with_a_corrupt_location_is_400_whether_or_not_it_is_symbolized(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Locations are read only where the rewrite fills some in: a corrupt one was a 400 for a
    profile whose debug file was found, and its own bytes sent back in a 200 for one whose
    debug file was not, which a backend then kept."""
    sg = await start_symgate([faults.url_for("ok")], symbolize=symbolize_config())
    for build_id in ("ab" * 20, elfs.prog.build_id):  # not found upstream, and found
        placed = replace(place(elfs.prog, BASES["prog"]), build_id=build_id)
        raw = RawProfile.FromString(
            make_profile([(placed, code_addresses(elfs.prog)[:5])]).SerializeToString())
        raw.location[2] = b"\x22\x05\x01"  # a line: 5 bytes declared, 1 there
        status, _, text = await post(sg, raw.SerializeToString())
        assert status == 400, (build_id, text)
        assert b"not a pprof profile: location 2 is not a valid Location message" in text, text
    assert (await sg.get("/healthz"))[0] == 200


async def test_mapping_and_function_ids_that_are_0_or_repeated_are_400(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """As pprof's own reader refuses them (CheckValid). Of two mappings with one id, the
    locations of either were translated with the last one's range, and answered 200."""
    sg = await start_symgate([faults.url_for("ok")], symbolize=symbolize_config())
    placed = [(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:3]),
              (place(elfs.shlib, BASES["libmix.so"]), code_addresses(elfs.shlib)[:3])]
    for damage, said in (("repeat mapping", b"mapping id 1 is repeated"),
                         ("zero mapping", b"mapping id 0 is reserved"),
                         ("repeat function", b"function id 7 is repeated"),
                         ("zero function", b"function id 0 is reserved")):
        profile = make_profile(placed)
        if damage == "repeat mapping":
            profile.mapping[1].id = profile.mapping[0].id
        elif damage == "zero mapping":
            profile.mapping[0].id = 0
        else:
            profile.string_table.append("f")
            for _ in range(2):
                profile.function.add(id=7 if damage == "repeat function" else 0,
                                     name=len(profile.string_table) - 1)
        status, _, text = await post(sg, profile.SerializeToString())
        assert status == 400 and said in text, (damage, text)
    assert faults.count("ok") == 0
    assert (await sg.get("/healthz"))[0] == 200


def _damage(profile: Profile, how: str) -> None:
    """Make `profile` (make_profile's, of six locations and samples) one that pprof's reader
    refuses as malformed (Profile.CheckValid, and its decoder's string lookups), as `how`."""
    location, sample = profile.location[3], profile.sample[2]
    if how == "location id 0":
        location.id = 0
    elif how == "location id repeated":
        location.id = profile.location[1].id
    elif how == "sample of no location":
        sample.location_id[0] = 999
    elif how == "sample of location 0":
        sample.location_id[0] = 0
    elif how == "a value too many":
        sample.value.append(5)
    elif how == "no sample types":
        del profile.sample_type[:]
    elif how == "line of no function":
        location.line.append(Line(function_id=55, line=3))
    elif how == "no string table":
        del profile.string_table[:]
    elif how == "label key out of range":
        sample.label[0].key = 999
    elif how == "label string negative":
        sample.label[0].str = -1
    elif how == "sample type out of range":
        profile.sample_type[0].unit = 999
    elif how == "comment out of range":
        profile.comment.append(999)
    elif how == "period type out of range":
        profile.period_type.type = 999
    else:
        raise AssertionError(how)


_MALFORMED = {
    "location id 0": b"location id 0 is reserved",
    "location id repeated": b"location id 2 is repeated",
    "sample of no location": b"a sample names location 999, which the profile does not have",
    "sample of location 0": b"a sample names location 0, which the profile does not have",
    "a value too many": b"sample 2 has 2 values for 1 sample types",
    "no sample types": b"it has samples but no sample types",
    "line of no function": b"a location's line names function 55, which the profile does not",
    "no string table": b"its string table is empty",
    "label key out of range": b"a sample's label has string index 999, out of range",
    "label string negative": b"a sample's label has string index -1, out of range",
    "sample type out of range": b"sample_type 0: string index 999 out of range",
    "comment out of range": b"comment 1: string index 999 out of range",
    "period type out of range": b"period_type: string index 999 out of range",
}


async def test_profiles_pprof_refuses_as_malformed_are_400_not_symbolized(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, tmp_path: Path
) -> None:
    """Samples and locations are passed on unread, and were checked only to be messages: a
    profile with two locations of one id, a sample of a location it lacks or with a value too
    many, a label's string past the table, was answered 200 `symbolized` (its debug file was
    found and filled in), in a body `go tool pprof` refuses as malformed, as it refused the
    profile sent. Refused by the server, gzipped or not, and by the CLI, writing nothing."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    placed = place(elfs.prog, BASES["prog"])
    vaddrs = code_addresses(elfs.prog)[:6]
    tree = build_id_tree(tmp_path / "debug", elfs.prog.build_id, elfs.prog.debug,
                         elfs.prog.executable)
    sound = make_profile([(placed, vaddrs)]).SerializeToString()
    status, headers, _ = await post(sg, sound)  # symbolized, where it is not damaged
    assert status == 200 and headers["X-Symgate-Symbolize"] == "symbolized", headers
    for how, said in _MALFORMED.items():
        profile = make_profile([(placed, vaddrs)])
        _damage(profile, how)
        raw = profile.SerializeToString()
        for body in (raw, gzip.compress(raw)):
            status, _, text = await post(sg, body)
            assert status == 400 and b"not a pprof profile: " + said in text, (how, text)
        source, out = tmp_path / "in.pb", tmp_path / "out.pb"
        source.write_bytes(raw)
        result = await run_in_thread(["symgate", "symbolize", str(source), "-o", str(out),
                                      "--debug-dir", str(tree)], timeout=120)
        assert result.returncode == 1, (how, result.stderr)
        assert said.decode() in result.stderr and not out.exists(), (how, result.stderr)
    assert (await sg.get("/healthz"))[0] == 200
    assert await sg.metric("symgate_symbolize_profiles_total",
                           outcome="rejected") == 2 * len(_MALFORMED)


async def test_a_corrupt_sample_is_400_without_waiting_for_the_resolution(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    """Samples are checked beside the resolution and the rewrite, which read none: a corrupt
    one refuses the profile as soon as it is found, not once its debug file has come. The
    fetch it started goes on, shared: the next profile of that build ID gets its table."""
    faults.release.clear()
    sg = await start_symgate([faults.url_for("hold")], symbolize=symbolize_config(
        deadline_s=60.0))
    profile = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    raw = RawProfile.FromString(profile.SerializeToString())
    raw.sample[2] = b"\x0a\x05\x01"
    status, _, text = await post(sg, raw.SerializeToString())
    assert status == 400 and b"sample 2 is not a valid Sample message" in text, text
    # Answered while the upstream still holds its answer, and the resolution waits for it.
    assert faults.count("hold") and sg.runner.app[STATE].symbols.busy
    faults.release.set()
    status, headers, _ = await post(sg, profile.SerializeToString())
    assert status == 200 and headers["X-Symgate-Mappings-Symbolized"] == "1", headers


async def test_gzip_bomb_and_oversized_bodies_are_413(
    start_symgate: SymgateFactory, debuginfod: Debuginfod
) -> None:
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config(
        max_request_bytes=1024 * 1024, max_decompressed_bytes=8 * 1024 * 1024))
    bomb = gzip.compress(b"\0" * (64 * 1024 * 1024))  # 64 MiB of zeros in ~64 KiB
    assert len(bomb) < 1024 * 1024
    status, _, text = await post(sg, bomb)
    assert status == 413 and b"decompresses to more than" in text
    status, _, text = await post(sg, os.urandom(2 * 1024 * 1024))
    assert status == 413 and b"larger than" in text
    assert (await sg.get("/healthz"))[0] == 200


@pytest.mark.parametrize("entry", [b"\x1a\x00", b"\x12\x00", b"\x32\x00"],
                         ids=["mappings", "samples", "strings"])
async def test_a_profile_of_empty_entries_is_422_before_it_takes_the_memory(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet, entry: bytes,
) -> None:
    """protobuf keeps an object of 43 to 85 bytes for every entry, however small on the wire:
    64 MiB of empty mappings, a gzip of 64 KiB, took a worker 2.7 GB before their count was
    held against the limit (11 GB at the default 256 MiB). Its parse in a worker is bounded by
    its size (symbolize.parse_memory) and refused past it; the worker that refused it
    symbolizes the next profile."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    good = make_profile([(place(elfs.prog, BASES["prog"]), code_addresses(elfs.prog)[:5])])
    assert (await post(sg, good.SerializeToString()))[0] == 200  # the workers are up
    workers = descendants(os.getpid())
    for pid in workers:
        reset_peak_rss(pid)
    peaks = {pid: peak_rss(pid) for pid in workers}
    body = entry * (32 << 20)
    bomb = gzip.compress(body, 1)
    status, _, text = await post(sg, bomb, **{"Content-Encoding": "gzip"})
    assert status == 422 and b"too many entries" in text, text
    # 64 MiB inflated, and the parse's budget of 832 MiB above what the worker mapped.
    grown = max(peak_rss(pid) - peaks[pid] for pid in workers if pid in descendants(os.getpid()))
    assert grown < 1000 << 20, grown
    status, _, answer = await post(sg, good.SerializeToString())
    assert status == 200 and parse(answer).function
    assert (await sg.get("/healthz"))[0] == 200


async def test_too_many_build_ids_is_422(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")], symbolize=symbolize_config(max_mappings=2))
    placed = [(replace(place(elfs.prog, BASES["prog"]), build_id=f"{i:02x}" * 20), [0x1100])
              for i in range(3)]
    status, _, text = await post(sg, make_profile(placed).SerializeToString())
    assert status == 422 and b"3 build IDs" in text
    assert faults.count("ok") == 0
    # 0 is no bound, as for the other limits: it refused every profile with a build ID.
    sg = await start_symgate([faults.url_for("ok")], data_dir=sg.config.server.data_dir.parent
                             / "unbounded", symbolize=symbolize_config(max_mappings=0))
    status, headers, _ = await post(sg, make_profile(placed).SerializeToString())
    assert status == 200 and "X-Symgate-Mappings-Unsymbolized" in headers


async def test_a_2000_character_build_id_is_reported_not_fetched(
    start_symgate: SymgateFactory, faults: FaultUpstream, elfs: ElfSet
) -> None:
    sg = await start_symgate([faults.url_for("ok")], symbolize=symbolize_config())
    placed = replace(place(elfs.prog, BASES["prog"]), build_id="ab" * 1000)
    profile = make_profile([(placed, code_addresses(elfs.prog)[:5])])
    status, headers, body = await post(sg, profile.SerializeToString())
    assert status == 200 and body == profile.SerializeToString()
    assert headers["X-Symgate-Mappings-Unsymbolized"] == "invalid_build_id=1"
    assert faults.count("ok") == 0


async def test_a_profile_over_a_mebibyte_is_read_whole(
    start_symgate: SymgateFactory, debuginfod: Debuginfod, elfs: ElfSet
) -> None:
    """Bodies arrive in many reads; a short read once made big profiles look corrupt."""
    sg = await start_symgate([debuginfod.url], symbolize=symbolize_config())
    placed = place(elfs.prog, BASES["prog"])
    vaddrs = code_addresses(elfs.prog) * 400  # ~60k locations, 1.4 MB of raw protobuf
    raw = make_profile([(placed, vaddrs)]).SerializeToString()
    assert len(raw) > 1024 * 1024  # far more than one read returns
    status, headers, body = await post(sg, raw)
    assert status == 200, body[:200]
    assert int(headers["X-Symgate-Locations-Symbolized"]) >= len(vaddrs) * 0.9
