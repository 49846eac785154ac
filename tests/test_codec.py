"""A profile's encoding in and out: gzip inflated at most once per decode, and once only where
a first decode measured it."""

from __future__ import annotations

import gzip
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from symbolize.parse_memory import (
    COLUMNS_PER_BYTE,
    bound_parses,
    mapped_bytes,
    mapping_at_most,
    parse_budget,
)
from symbolize.pprof.codec import (
    ProfileError,
    ProfileTooLarge,
    TooManyEntries,
    decode,
    encode,
    inflated,
)
from symbolize.pprof.profile_pb2 import Function, Line, Location, Profile, Sample, ValueType
from symbolize.pprof.profile_raw_pb2 import RawProfile
from symbolize.pprof.varint import encode_one
from symbolize.worker import Limits, TooMuchWork, check_samples, scan
from tests.symbolize_helpers import peak_rss, reset_peak_rss


def _gzipped_profile() -> tuple[bytes, bytes]:
    p = Profile(string_table=["", *(f"s{i}" for i in range(5000))])
    raw = p.SerializeToString()
    return raw, gzip.compress(raw)


def test_a_measured_body_inflates_to_the_same_profile_within_its_size() -> None:
    """The finish decodes what the scan measured: bounded by that size, not by the limit, so
    an inflate that would go past it (a body that is not the one measured) stops there."""
    raw, body = _gzipped_profile()
    first = decode(body, 1 << 30)
    assert first.gzipped and first.raw == raw
    again = decode(body, len(first.raw), measured=True)
    assert again.raw == raw and again.profile == first.profile
    with pytest.raises(ProfileTooLarge):
        decode(body, len(raw) - 1, measured=True)
    with pytest.raises(ProfileTooLarge):
        decode(body, len(raw) - 1)


def test_encode_keeps_the_encoding_it_came_in() -> None:
    raw, body = _gzipped_profile()
    profile = decode(body, 1 << 30).profile
    assert encode(profile, False) == raw
    assert gzip.decompress(encode(profile, True)) == raw
    assert encode(profile, True) == encode(profile, True)  # no timestamp in it


def test_a_profile_past_its_counts_is_refused_before_its_indices_are_checked() -> None:
    """The string indices are checked by a Python loop over every function (3 million took
    1.7 s); the counts cost nothing. A profile past a count is refused by the count, before
    that loop: here its functions' names also point outside its string table."""
    p = Profile(string_table=[""])
    p.function.extend(Function(id=i, name=5) for i in range(1, 4))
    body = p.SerializeToString()
    with pytest.raises(ProfileError, match="string index out of range"):
        scan(body, Limits(1 << 20, 10))
    with pytest.raises(TooMuchWork, match="3 functions"):
        scan(body, Limits(1 << 20, 10, max_profile_functions=2))
    with pytest.raises(ProfileError, match="string index out of range"):
        decode(body, 1 << 20)  # the tools' decode checks them itself


def test_every_gzip_member_is_read_and_bytes_after_the_last_are_refused() -> None:
    """`cat a.pb.gz b.pb.gz` is one gzip stream of two members, which gzip and Go's reader
    inflate one after the other: the two encodings one after the other, that is the two
    profiles merged. Only the first was read, the rest dropped without a word. Bytes after
    the last member that begin no other are refused, as Go refuses them."""
    a = Profile(string_table=["", "a"], comment=[1]).SerializeToString()
    b = Profile(comment=[1], period=7).SerializeToString()
    two = gzip.compress(a) + gzip.compress(b, mtime=1)
    merged = decode(two, 1 << 20)
    assert merged.gzipped and merged.raw == a + b
    assert list(merged.profile.comment) == [1, 1] and merged.profile.period == 7
    assert decode(two, len(a + b), measured=True).raw == a + b
    with pytest.raises(ProfileTooLarge):
        decode(two, len(a + b) - 1)
    for bad, why in ((gzip.compress(a) + b"\0\0", "after its last member"),
                     (two + b"\x1f", "after its last member"),
                     (two[:-3], "truncated")):
        with pytest.raises(ProfileError, match=why):
            decode(bad, 1 << 20)


def test_many_members_are_read_in_windows_and_bounded_in_number() -> None:
    """Each member after the first is given a window of the body, not the whole rest (which
    came back, unused, as a copy per member: 29 s for 4 MiB of empty members), and a stream
    has at most 4,096 members, as many as BGZF's 64 KiB blocks of the size limit."""
    raw = Profile(string_table=["", *(f"s{i}" for i in range(40_000))]).SerializeToString()
    blocks = b"".join(gzip.compress(raw[i:i + 65536], mtime=i) for i in range(0, len(raw),
                                                                             65536))
    assert decode(blocks, 1 << 30).raw == raw
    assert decode(blocks, len(raw), measured=True).raw == raw
    empty = gzip.compress(b"", mtime=0)
    assert inflated(empty * 4096, 1 << 20) == (True, b"")
    with pytest.raises(ProfileError, match="more than 4096 members"):
        decode(empty * 4097, 1 << 20)
    with pytest.raises(ProfileError, match="more than 4096 members"):
        decode(empty * 50_000 + gzip.compress(raw), 1 << 30)


# Samples as a RawProfile keeps them, bytes nothing reads: each corrupt in its own way.
_CORRUPT_SAMPLES = {
    "packed-field-longer-than-its-sample": b"\x0a\x05\x01",  # 5 bytes declared, 1 there
    "varint-past-its-packed-field": b"\x0a\x01\x80",
    "wire-type-7": b"\x0f\x01",
    "label-that-is-not-a-label": b"\x1a\x02\x08\x80",
    "varint-of-eleven-bytes": b"\x08" + b"\xff" * 10 + b"\x01",
}
# Valid however they are written: unpacked ids, a label, a field this reader does not know;
# each with a value, for the one sample type of _profile_of.
_ODD_SAMPLES = [b"\x08\x01\x08\x02\x10\x05", b"\x0a\x02\x01\x02\x12\x01\x07",
                b"\x1a\x04\x08\x01\x18\x02\x10\x01", b"\xa0\x06\x01\x10\x00",
                b"\x10" + b"\xff" * 9 + b"\x01"]


def _profile_of(samples: list[bytes]) -> RawProfile:
    """`samples` in a profile that has what they name: a sample type, locations 1 and 2, a
    string 1 for a label's key."""
    return RawProfile(string_table=["", "key"], sample_type=[ValueType()],
                      location=[Location(id=i).SerializeToString() for i in (1, 2)],
                      sample=samples)


@pytest.mark.parametrize("sample", list(_CORRUPT_SAMPLES.values()), ids=list(_CORRUPT_SAMPLES))
def test_a_corrupt_sample_is_refused_by_name(sample: bytes) -> None:
    """A RawProfile passes samples on unread: unchecked, a corrupt one went out in an answer
    no pprof reader could parse."""
    raw = _profile_of([b"\x0a\x01\x01\x10\x01", sample]).SerializeToString()
    with pytest.raises(ProfileError, match="not a pprof profile: sample 1 is not a valid "
                                           "Sample message"):
        decode(raw, 1 << 30)
    # The pipeline's own step for it, beside the resolution: the scan leaves samples alone.
    scanned = scan(raw, Limits(1 << 30, 10))
    for body in (raw, gzip.compress(raw)):
        with pytest.raises(ProfileError, match="sample 1"):
            check_samples(body, Limits(1 << 30, 10, scanned_size=scanned.size))


def test_a_corrupt_label_set_is_refused_by_name() -> None:
    raw = RawProfile(string_table=[""], label_set=[b"\x08\x01", b"\x12\x05\x08"])
    with pytest.raises(ProfileError, match="label set 1 is not a valid LabelSet message"):
        decode(raw.SerializeToString(), 1 << 30)


def test_samples_written_any_valid_way_are_taken_as_they_came() -> None:
    raw = _profile_of(_ODD_SAMPLES).SerializeToString()
    decoded = decode(raw, 1 << 30)
    assert list(decoded.profile.sample) == _ODD_SAMPLES
    assert encode(decoded.profile, False) == raw


def test_a_function_written_with_its_id_twice_is_read_as_a_reader_takes_it() -> None:
    """A field given twice is its last value to protobuf and to pprof's reader: function 5
    and function [5, 7] are functions 5 and 7, as a location written so is read. Merged
    into one column, both ids of the second counted, and the valid profile was refused as
    one whose function 5 is repeated."""
    twice = Function(id=5, name=1).SerializeToString() + b"\x08\x07"
    body = RawProfile(string_table=["", "f"], sample_type=[ValueType()],
                      function=[Function(id=5, name=1)]).SerializeToString() \
        + b"\x2a" + bytes([len(twice)]) + twice  # Profile.function, field 5
    assert [f.id for f in RawProfile.FromString(body).function] == [5, 7]
    decoded = decode(body, 1 << 30)
    assert [f.id for f in decoded.profile.function] == [5, 7]


def _ids_of(location_ids: list[int]) -> bytes:
    """A sample's ids as Go writes one or two: a field each, unpacked."""
    return b"".join(b"\x08" + encode_one(i) for i in location_ids)


def _stacks(frames: int, samples: int = 3000, locations: int = 20_000, *,
            ids: list[int] | None = None, unpacked_below: int = 0) -> RawProfile:
    """`samples` of `frames` frames each over locations 1 to `locations` (or `ids`), one
    value each; a sample of fewer than `unpacked_below` frames has its ids unpacked."""
    rng = random.Random(frames)
    ids = ids or list(range(1, locations + 1))
    p = Profile(string_table=["", "cpu", "nanoseconds"], sample_type=[ValueType(type=1, unit=2)])
    p.location.extend(Location(id=i, address=0x1000 + i % 4096) for i in ids)
    raw = RawProfile.FromString(p.SerializeToString())
    for n in range(samples):
        stack = [rng.choice(ids) for _ in range(1 + n % frames)]
        if len(stack) < unpacked_below:
            raw.sample.append(_ids_of(stack) + b"\x10\x01")
        else:
            raw.sample.append(Sample(location_id=stack, value=[1]).SerializeToString())
    return raw


def _naming(sound: bytes, sample: int, location_id: int, *, unpacked: bool = False
            ) -> bytes:
    """The profile `sound` with one more frame, `location_id`, at the top of its sample
    `sample`."""
    raw = RawProfile.FromString(sound)
    one = Sample.FromString(raw.sample[sample])
    stack = [location_id, *one.location_id]
    raw.sample[sample] = _ids_of(stack) + b"\x10\x01" if unpacked else \
        Sample(location_id=stack, value=[1]).SerializeToString()
    return raw.SerializeToString()


# Profiles whose samples' location ids are read each way check_samples reads them: decoded by
# protobuf (a frame or two a sample), as packed runs (many frames), among them ids Go writes a
# field each, ids 1 to n checked from their bytes (a run of over 64 KiB) or decoded (sparse).
_SHAPES = {
    "one frame": lambda: _stacks(1, samples=40_000),
    "one frame, unpacked": lambda: _stacks(1, samples=40_000, unpacked_below=2),
    "deep": lambda: _stacks(32),
    "deep, short ones unpacked": lambda: _stacks(32, unpacked_below=3),
    "deep, few bytes of runs": lambda: _stacks(32, samples=40, locations=100),
    "deep, sparse ids": lambda: _stacks(32, ids=[i * 1000 + 7 for i in range(1, 3000)]),
    "deep, ids near 2**64": lambda: _stacks(32, ids=[2**64 - 1 - i for i in range(3000)]),
}


@pytest.mark.parametrize("shape", list(_SHAPES), ids=list(_SHAPES))
def test_a_sample_naming_a_location_the_profile_lacks_is_refused(shape: str) -> None:
    """pprof's reader refuses it ("sample has nil location"); it was passed on as it came,
    as the ids were not looked up (their reading tripled the check of deep stacks)."""
    sound = _SHAPES[shape]()
    encoded = sound.SerializeToString()
    decode(encoded, 1 << 30)
    ids = sorted(Location.FromString(loc).id for loc in sound.location)
    # Past the highest id, and 0; the highest id's top byte with a larger rest; a gap.
    missing = [ids[-1] + 1 if ids[-1] < 2**64 - 1 else ids[0] - 1, 0, 2**64 - 1 - 2**60 + 5]
    missing += [ids[-1] + 2**14] if ids[-1] < 2**50 else []
    missing += [ids[0] + 1] if ids[1] != ids[0] + 1 else []
    for location_id in missing:
        for unpacked in (False, True):
            body = _naming(encoded, len(sound.sample) - 2, location_id,
                           unpacked=unpacked)
            with pytest.raises(ProfileError, match=f"a sample names location {location_id}, "
                                                   "which the profile does not have"):
                decode(body, 1 << 30)
            scanned = scan(body, Limits(1 << 30, 10))
            with pytest.raises(ProfileError, match=f"location {location_id},"):
                check_samples(body, Limits(1 << 30, 10, scanned_size=scanned.size,
                                           scanned_shape=scanned.shape))


def test_a_sample_naming_the_id_a_location_gave_last_is_taken() -> None:
    """A location with its id twice is the last to a reader: samples naming it by its last
    id are sound, by its first they name what the profile lacks."""
    raw = _stacks(32)
    raw.location.append(Location(id=50_000).SerializeToString() + b"\x08" + encode_one(60_000))
    decode(_naming(raw.SerializeToString(), 5, 60_000), 1 << 30)
    with pytest.raises(ProfileError, match="a sample names location 50000, which"):
        decode(_naming(raw.SerializeToString(), 5, 50_000), 1 << 30)


@pytest.mark.parametrize("sample", [b"\x0a\x02\x01\x80\x10\x01",
                                    b"\x0a\x0b" + b"\xff" * 10 + b"\x01\x10\x01"],
                         ids=["run-ending-inside-a-varint", "varint-of-eleven-bytes"])
def test_a_corrupt_run_of_many_frames_is_refused_by_name(sample: bytes) -> None:
    """Samples of many frames keep their ids' runs as bytes through protobuf's parse, which
    no longer finds a run that is not whole varints."""
    raw = _stacks(32)
    raw.sample.append(sample)
    with pytest.raises(ProfileError, match=f"sample {len(raw.sample) - 1} is not a valid "
                                           "Sample message"):
        decode(raw.SerializeToString(), 1 << 30)


def test_samples_of_many_frames_written_any_valid_way_are_taken() -> None:
    raw = _stacks(32)
    raw.sample.extend(_ODD_SAMPLES)
    decode(raw.SerializeToString(), 1 << 30)


def test_a_profile_of_no_string_table_is_refused_as_pprof_refuses_it() -> None:
    """Every field of a profile that names a string names string 0 where it is left out
    (drop_frames, a sample type's unit): pprof's reader looks each up, and refuses a profile
    whose table lacks it ("unrecognized profile format"), an empty one included."""
    for body in (b"", Profile(sample_type=[ValueType()]).SerializeToString()):
        with pytest.raises(ProfileError, match="its string table is empty"):
            decode(gzip.compress(body), 1 << 30)
    decode(Profile(string_table=[""]).SerializeToString(), 1 << 30)


def _taken(damage: str) -> bytes:
    raw = _stacks(32, samples=100)
    if damage == "values 0 and 2":
        raw.sample[3] = Sample(location_id=[1]).SerializeToString()
        raw.sample[4] = Sample(location_id=[2], value=[1, 1]).SerializeToString()
    elif damage == "values 0 and 2, unpacked":
        raw.sample[3] = b"\x08\x01"
        raw.sample[4] = b"\x08\x02\x10\x01\x10\x01"
    elif damage == "line of function 0":
        raw.location[0] = Location(id=1, line=[Line(line=3)]).SerializeToString()
    elif damage == "location ids as fixed64":
        raw.sample[3] = b"\x09" + (2).to_bytes(8, "little") + b"\x10\x01"
    return raw.SerializeToString()


@pytest.mark.parametrize("damage", ["values 0 and 2", "values 0 and 2, unpacked",
                                    "line of function 0", "location ids as fixed64"])
def test_what_pprofs_reader_refuses_that_the_check_still_takes(damage: str) -> None:
    """go tool pprof refuses each ("mismatch: sample has 0 values vs. 1 types", "location id:
    1 has a line with nil function", "unrecognized profile format"); symgate passes them on
    as they came. Each is told only by reading every sample or line on its own: merged into
    one message, protobuf leaves no trace of where a sample's values end, of a line whose
    function id is left out, or of a known field of another wire type (taken as unknown).
    A length a sample read from Python costs 50-80 ns: 15 ms for 300,000 samples, 60-80 for a
    million, most of the check of a million one-frame samples."""
    decode(_taken(damage), 1 << 30)


@pytest.fixture
def bounded() -> Iterator[None]:
    """This process's parses bounded, as a worker process's are (worker_process.init)."""
    before = bound_parses(True)
    yield
    bound_parses(before)


def test_a_parse_bound_is_given_back_after_it_and_a_lower_one_stands(bounded: None) -> None:
    """The bound of one parse is lifted after it (the worker goes on to rewrite, build and take
    other jobs), and a lower one already set (a build process's) is not raised by it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with mapping_at_most(1 << 30):
        inside = resource.getrlimit(resource.RLIMIT_AS)[0]
        assert mapped_bytes() < inside <= mapped_bytes() + (1 << 30)
    assert resource.getrlimit(resource.RLIMIT_AS) == (soft, hard)
    lower = mapped_bytes() + (2 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (lower, hard))
    try:
        with mapping_at_most(8 << 30):
            assert resource.getrlimit(resource.RLIMIT_AS)[0] == lower
        assert resource.getrlimit(resource.RLIMIT_AS)[0] == lower
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_parse_bounds_of_two_threads_do_not_leave_one_in_place(bounded: None) -> None:
    """RLIMIT_AS is the process's: where two threads' parses overlapped, each gave back the
    limit it found on entering, and the later to end put back the other's bound, lowered for
    good."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    first_in, second_tried = threading.Event(), threading.Event()

    def first() -> None:
        with mapping_at_most(1 << 30):
            first_in.set()
            second_tried.wait(0.5)  # the second enters now, where nothing keeps it out

    def second() -> None:
        first_in.wait()
        second_tried.set()
        with mapping_at_most(1 << 29):  # lower than the first's, and ends after it
            time.sleep(0.2)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert resource.getrlimit(resource.RLIMIT_AS) == (soft, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field, as a profile's writer encodes it."""
    return encode_one(number << 3 | 2) + encode_one(len(payload)) + payload


# A valid profile's head: its strings, one sample type, a mapping and location 1.
_HEAD = b"".join([_field(6, b""), _field(6, b"cpu"), _field(6, b"ns"),
                  _field(1, b"\x08\x01\x10\x02"), _field(3, b"\x08\x01\x10\x01\x18\x02"),
                  _field(4, b"\x08\x01\x10\x01\x18\x01")])
_ONE_SAMPLE = _field(2, b"\x08\x01\x10\x01")  # location 1, value 1


def _grown_by(run: Callable[[], object]) -> int:
    """How much more memory than now this process held at most while `run` ran."""
    reset_peak_rss()
    before = peak_rss(os.getpid())
    run()
    return peak_rss(os.getpid()) - before


@pytest.mark.parametrize("inside", [
    _field(2, b"\x08\x01\x10\x01" + b"\x22\x00" * (16 << 20)),  # a sample's empty breakdowns
    _field(16, b"\x08\x01" + b"\x12\x00" * (16 << 20)),  # a label set's empty labels
], ids=["breakdowns", "label-set-labels"])
def test_what_a_sample_or_label_set_holds_is_checked_in_columns(inside: bytes) -> None:
    """The scan's counts never see what a sample or a label set holds: checked as a message
    each (a Breakdown, a LabelSet and its Labels), 32 MiB of empty ones took 0.8-0.9 GB, 100 MB
    2.5-2.9 GB. Merged into columns, as the samples' labels are, they cost nothing."""
    raw = _HEAD + inside
    assert _grown_by(lambda: decode(raw, 1 << 30)) < 96 << 20


def test_an_odd_profiles_location_ids_are_read_without_its_samples() -> None:
    """A location with its id twice has each location's id read a message at a time; read
    with every sample and label a message too (CheckedAsBytes), 32 MiB of a sample's empty
    labels took 0.9 GB to say which id was repeated."""
    raw = _HEAD + _field(4, b"\x08\x01\x08\x01") + _field(
        2, b"\x08\x01\x10\x01" + b"\x1a\x00" * (16 << 20))
    reset_peak_rss()
    before = peak_rss(os.getpid())
    with pytest.raises(ProfileError, match="location id 1 is repeated"):
        decode(raw, 1 << 30)
    assert peak_rss(os.getpid()) - before < 96 << 20


def test_a_sample_of_millions_of_one_byte_ids_is_refused_before_it_takes_the_memory(
    bounded: None,
) -> None:
    """Columns take 8 bytes a value, in arrays that grow by doubling: a sample of 40 MiB of
    location ids of a byte each, among enough one-frame samples for the columns to be read,
    took 27 times its size (1.3 GB), checked unbounded and answered. Bounded, it is refused."""
    raw = _HEAD + _ONE_SAMPLE * (1 << 20) + _field(2, _field(1, b"\x01" * (40 << 20)) + b"\x10\x01")
    reset_peak_rss()
    before = peak_rss(os.getpid())
    with pytest.raises(TooManyEntries):
        decode(raw, 1 << 30)
    assert peak_rss(os.getpid()) - before < parse_budget(len(raw), COLUMNS_PER_BYTE)


def test_the_densest_real_samples_are_parsed_within_the_bound(bounded: None) -> None:
    """One-frame samples of one value, six bytes each (a location id and a value below 128),
    are the densest a real profile has: their arrays grow by doubling and the old ones stay in
    protobuf's arena, so that just past a power of two (2**23 of them, within the default
    limit of 10 million) they take 12 times their size, mapped. 2**22 and a few of them,
    refused with 8 times, are taken."""
    raw = _HEAD + _ONE_SAMPLE * ((1 << 22) + 1000)
    samples = len(decode(raw, 1 << 30).profile.sample)
    assert samples == (1 << 22) + 1000, samples


def test_a_process_that_does_not_bound_its_parses_is_not_bounded() -> None:
    """Only a process that runs nothing beside its parses bounds them (the server's workers):
    the command line's builds run in threads beside its check of the samples."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    before = bound_parses(False)
    try:
        with mapping_at_most(1 << 20):
            assert resource.getrlimit(resource.RLIMIT_AS) == (soft, hard)
    finally:
        bound_parses(before)
