"""Reading and writing pprof profiles: gzip or raw protobuf, with bounded decompression.

Profiles are read as RawProfile: samples and locations stay encoded until the rewrite reads the
locations it symbolizes, and go back out as they came.

gzip is ISA-L's (python-isal), not zlib's: a gzipped profile of 100,000 locations inflated in
2.4 ms against zlib's 5.0, and its 3.9 MB answer deflated in 8 ms against zlib's 129 at level
6 (37 at level 1, for the same size as ISA-L's).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError, Message
from isal import igzip, isal_zlib

from ..parse_memory import COLUMNS_PER_BYTE, PARSE_PER_BYTE, mapping_at_most, parse_budget
from . import varint
from .profile_pb2 import LabelSet, Location, Sample
from .profile_raw_pb2 import (
    CheckedAsBytes,
    CheckedLocations,
    MergedProfile,
    MergedRunsProfile,
    MergedRunsSample,
    RawProfile,
)

# Bytes, or a view of them: a request's as a worker maps them (proxy.symbols.shared_bodies).
Buffer = bytes | memoryview


def as_bytes(data: Buffer) -> bytes:
    """`data` for a protobuf parse: upb parses any buffer, a memoryview as well as bytes,
    where its stubs say bytes."""
    return cast(bytes, data)


# isal's stubs declare its error an instance of Exception; it is the class.
_GZIP_ERROR = cast("type[Exception]", isal_zlib.error)
GZIP_MAGIC = b"\x1f\x8b"


class ProfileError(ValueError):
    """The body is not a usable pprof profile; the message says why."""


class ProfileTooLarge(ProfileError):
    """The profile decompresses to more than the allowed size (a gzip bomb, or just huge)."""


class TooManyEntries(ProfileError):
    """A body whose entries would take more memory to parse than a body of its size may
    (symbolize.parse_memory): millions of empty messages, refused before they can be counted
    against the limits."""


M = TypeVar("M", bound=Message)
# What protobuf's arena says when an allocation fails (RLIMIT_AS): a DecodeError.
_ARENA_FAILED = "Arena alloc failed"


def parsed(kind: type[M], data: bytes, per_byte: int = PARSE_PER_BYTE) -> M:
    """`data` parsed as a `kind`, within the memory parse_memory allows its size;
    TooManyEntries past it, DecodeError for bytes that are no `kind`."""
    budget = parse_budget(len(data), per_byte)
    try:
        with mapping_at_most(budget):
            return kind.FromString(data)
    except MemoryError:
        pass
    except DecodeError as e:
        if _ARENA_FAILED not in str(e):
            raise
    raise TooManyEntries(f"the body's {len(data)} bytes hold too many entries: parsing them "
                         f"takes more than {budget} bytes of memory")


@dataclass(frozen=True, slots=True)
class Decoded:
    profile: RawProfile
    gzipped: bool
    raw: Buffer  # the uncompressed protobuf bytes


# Inflated a mebibyte at a time when measuring: a bomb costs this much memory, not its size.
_CHUNK = 1 << 20
# A gzip stream's members: as many as a stream of 64 KiB blocks (BGZF's) up to the default size
# limit; each costs a decompressor and a copy of its window's unused bytes.
_MAX_MEMBERS = 4096
_MEMBER_WINDOW = 1 << 16


def _inflate(body: Buffer, limit: int, keep: bool) -> tuple[int, bytes]:
    """How many bytes `body` inflates to, and with `keep` those bytes, stopping the moment
    they pass `limit`. Without `keep` the output is thrown away as it comes, a mebibyte at a
    time, so a gzip bomb is refused without ever being held. Every member of the stream is
    inflated, one after another, as gzip and Go's reader do (`cat a.pb.gz b.pb.gz` is one
    profile, the two merged), up to _MAX_MEMBERS; bytes after the last member that begin no
    other are an error."""
    view = memoryview(body)
    size, parts, at, members = 0, [], 0, 0
    try:
        while True:  # a member at a time
            members += 1
            if members > _MAX_MEMBERS:
                raise ProfileError(f"not valid gzip: more than {_MAX_MEMBERS} members")
            inflater = isal_zlib.decompressobj(wbits=16 + isal_zlib.MAX_WBITS)
            # The first member is given every byte at once (a profile is one member: one
            # call); a later one a window at a time, as what a member leaves unused comes
            # back as a copy: the whole rest, for each of many small members, was quadratic.
            data: Buffer = view[at:] if members == 1 else view[at: at + _MEMBER_WINDOW]
            at += len(data)
            while True:
                out = inflater.decompress(data, limit + 1 - size if keep else _CHUNK)
                size += len(out)
                if size > limit:
                    raise ProfileTooLarge(f"profile decompresses to more than {limit} bytes")
                if keep and out:
                    parts.append(out)
                data = inflater.unconsumed_tail
                if inflater.eof:
                    break
                if not data and at < len(view):
                    data = view[at: at + _MEMBER_WINDOW]
                    at += len(data)
                elif not out and not data:
                    break
            if not inflater.eof:
                raise ProfileError("truncated gzip stream")
            at -= len(inflater.unused_data)  # the next member's: given back
            if at >= len(view):
                return size, b"".join(parts)
            if view[at: at + 2] != GZIP_MAGIC:
                raise ProfileError("not valid gzip: bytes after its last member")
    except _GZIP_ERROR as e:
        raise ProfileError(f"not valid gzip: {e}") from e


def _gunzip(body: Buffer, limit: int, measured: bool) -> bytes:
    # Only what is known to fit is inflated whole.
    if not measured:
        _inflate(body, limit, keep=False)
    return _inflate(body, limit, keep=True)[1]


def decode(body: Buffer, max_decompressed: int, *, measured: bool = False,
           checked: bool = True) -> Decoded:
    """`measured`: `body` is known to inflate to no more than `max_decompressed` bytes (its
    size as a first decode found it): it is inflated at once, not measured first. Without
    `checked`, the caller runs `check` itself (after bounds of its own that cost less)."""
    gzipped, raw = inflated(body, max_decompressed, measured=measured)
    try:
        profile = parsed(RawProfile, as_bytes(raw))
    except DecodeError as e:
        # protobuf names the message it parsed: symgate's reading of a Profile, not the
        # client's business ("Error parsing message with type 'perftools.profiles.RawProfile'").
        said = str(e).replace(RawProfile.DESCRIPTOR.full_name, "perftools.profiles.Profile")
        raise ProfileError(f"not a pprof profile: {said}") from e
    decoded = Decoded(profile, gzipped, raw)
    if checked:
        check(decoded)
    return decoded


def inflated(body: Buffer, max_decompressed: int, *, measured: bool = False
             ) -> tuple[bool, Buffer]:
    """Whether `body` is gzipped, and its protobuf bytes (`body` itself when it is not);
    `measured` as for `decode`."""
    if not body:
        raise ProfileError("empty body")
    gzipped = body[:2] == GZIP_MAGIC
    raw = _gunzip(body, max_decompressed, measured) if gzipped else body
    if len(raw) > max_decompressed:
        raise ProfileTooLarge(f"profile is larger than {max_decompressed} bytes")
    return gzipped, raw


@dataclass(frozen=True, slots=True)
class Shape:
    """How many of each table a profile has: what its samples and locations are checked
    against (check_samples), counted where it is parsed as a RawProfile anyway."""

    strings: int
    sample_types: int
    samples: int
    locations: int
    functions: int


def shape_of(profile: RawProfile) -> Shape:
    return Shape(len(profile.string_table), len(profile.sample_type), len(profile.sample),
                 len(profile.location), len(profile.function))


def check(decoded: Decoded) -> None:
    """Raise ProfileError where check_tables or check_samples finds the profile wrong."""
    check_tables(decoded.profile)
    check_samples(decoded.raw, shape_of(decoded.profile))


def check_samples(raw: Buffer, shape: Shape) -> None:
    """Raise ProfileError where a Sample, Location or LabelSet of the encoded profile `raw` is
    not a valid message, or where they refer to what the profile does not have, as pprof's
    reader refuses them (Profile.CheckValid): a location id that is 0 or another's, a sample
    naming a location the profile lacks, samples whose values are not as many as their sample
    types say, a line naming a function it lacks (a function the rewrite adds could take its
    id), a label's string index out of the table.

    A RawProfile passes them on as bytes unread: unchecked, a corrupt one (a packed field
    longer than its sample, say) went out in an answer no pprof reader can parse, and so did
    a profile whose locations were numbered twice, which the rewrite filled in and answered
    200 `symbolized`.

    protobuf parses them all in C, as a reader will, merged into one message each
    (MergedProfile), which costs what parsing them as a message each (CheckedAsBytes) did
    without its memory: for a million one-frame samples with a label, 200 ms either way and
    87 MB against 226 (without labels 78 ms against 48: the ids read as columns). The ids are
    read with numpy; only a profile found wrong, or written oddly (a location with its id
    twice), is read a message at a time, to say where. Samples of many frames are parsed
    with their location ids left as bytes (MergedRunsProfile): decoded by protobuf, then
    encoded again and decoded by numpy to be looked up, they tripled the check of 300,000
    samples of 32 frames (105 to 340 ms); as bytes, the ids of dense locations (pprof's
    writers number them from 1) are checked from their bytes, undecoded."""
    runs = len(raw) >= _RUNS_FROM * shape.samples > 0
    merged = _merged(MergedRunsProfile if runs else MergedProfile, raw)
    if len(merged.sample.value) != shape.samples * shape.sample_types:
        raise ProfileError(f"not a pprof profile: {_odd_values(raw, shape.sample_types)}")
    locations = _column(merged.location, "id")
    if len(locations) != shape.locations or not locations.all():
        locations = _location_ids(raw)  # each location's last id, as a reader takes it
    where = _Ids(locations, "location")
    function_ids = _column(merged.function, "id")
    if len(function_ids) != shape.functions:
        # A function with its id twice, both merged into the column: the last is its id.
        function_ids = _function_ids(raw)
    functions = _Ids(function_ids, "function")
    for refs in _columns(merged.location.line, "function_id"):
        # A line of function 0 is a line of no function, which Go writes and pprof reads.
        if (missing := functions.first_missing(refs[refs != 0])) is not None:
            raise ProfileError(f"not a pprof profile: a location's line names function "
                               f"{missing}, which the profile does not have")
    for field in ("key", "str", "num_unit"):
        for indices in _columns(merged.sample.label, field):
            # As unsigned, a negative index is past any table.
            if len(out := indices[indices >= np.uint64(max(shape.strings, 1))]):
                raise ProfileError(f"not a pprof profile: a sample's label has string index "
                                   f"{int(out[:1].view(np.int64)[0])}, out of range")
    try:
        if isinstance(merged, MergedRunsProfile):
            missing = _missing_in_runs(merged.sample, where, raw)
        else:
            missing = where.first_missing_encoded(_packed(merged.sample, "location_id"))
    except _Overlong:
        raise ProfileError(f"not a pprof profile: {_first_corrupt(raw)}") from None
    if missing is not None:
        raise ProfileError(f"not a pprof profile: a sample names location {missing}, which "
                           "the profile does not have")


# Bytes of profile a sample, on average, from which its samples' location ids are read as runs
# (MergedRunsProfile): a few frames each and more. One-frame samples are some 30: their runs,
# a Python object each, cost more than protobuf's decoding of their ids.
_RUNS_FROM = 48


def _merged(kind: type[MergedProfile] | type[MergedRunsProfile], raw: Buffer
            ) -> MergedProfile | MergedRunsProfile:
    # Bounded, as the scan's parse was, though more loosely: no entry is a message of its own
    # (label sets and breakdowns merged too: empty ones cost nothing), but its columns take 8
    # bytes a value, past 8 times the size of the densest real samples (parse_memory).
    try:
        return parsed(kind, as_bytes(raw), COLUMNS_PER_BYTE)
    except DecodeError:
        raise ProfileError(f"not a pprof profile: {_first_corrupt(raw)}") from None


class _Overlong(Exception):
    """A varint of location ids runs past ten bytes, or past its run: read as bytes, not by
    protobuf, they are a corrupt sample only the message-at-a-time parse can name."""


def _missing_in_runs(sample: MergedRunsSample, where: _Ids, raw: Buffer) -> int | None:
    """The first location id the samples name that `where` lacks, from their packed runs and
    from the ids written a field each (left unknown, as a MergedRunsSample does not type them).
    Reads `sample`'s fields away."""
    runs = list(sample.location_id)
    encoded = np.frombuffer(b"".join(runs), dtype=np.uint8)
    lengths = np.fromiter(map(len, runs), dtype=np.int64, count=len(runs))
    del runs
    ends = np.cumsum(lengths)[lengths > 0] - 1
    if len(ends) and (encoded[ends] >= 0x80).any():
        raise _Overlong  # a run ends inside a varint
    if (missing := where.first_missing_encoded(encoded)) is not None:
        return missing
    del encoded
    for name in ("location_id", "value", "label", "breakdown"):
        sample.ClearField(name)
    loose = np.frombuffer(sample.SerializeToString(), dtype=np.uint8)  # its unknown fields
    if not len(loose):
        return None
    # Field 1 as varints: a tag (0x08) and an id each, Go's way with one or two frames.
    stops = np.flatnonzero(loose < 0x80)
    tags = np.concatenate(([0], stops[1::2] + 1))[: (len(stops) + 1) // 2]
    if len(stops) % 2 or (loose[tags] != 0x08).any() or (stops[::2] != tags).any():
        # Other fields, or field 1 of another wire type: protobuf's typed parse judges them.
        return _refs_as_typed(raw, where)
    first = stops[::2] + 1
    return where.first_missing(varint.get(loose, first, stops[1::2] - first + 1))


def _refs_as_typed(raw: Buffer, where: _Ids) -> int | None:
    merged = _merged(MergedProfile, raw)
    return where.first_missing_encoded(_packed(merged.sample, "location_id"))


U64 = npt.NDArray[np.uint64]
U8 = npt.NDArray[np.uint8]
# Bytes of varints decoded at a time: a sample's location ids are a few bytes each, tens of
# millions in a profile of deep stacks, and some 16 bytes each while they are read (4 MiB at
# a time was 60 MB).
_BATCH_BYTES = 1 << 20


def _packed(message: Message, field: str) -> U8:
    """The varints of the repeated integer `field` of `message`, one after another: the field
    serialised alone (packed, in C), where a loop over its values would cost some 50 ns
    each."""
    alone = type(message)()
    # A copy of the one field: upb copies a repeated field's array whole.
    getattr(alone, field).MergeFrom(getattr(message, field))
    encoded = np.frombuffer(alone.SerializeToString(), dtype=np.uint8)
    if not len(encoded):
        return encoded
    at = 1  # past the tag: a packed field is one, its length, its varints
    while encoded[at] & 0x80:
        at += 1
    return encoded[at + 1:]


def _varints(encoded: U8) -> Iterator[U64]:
    """The values of whole varints one after another, some batches of them."""
    at = 0
    while at < len(encoded):
        end = min(at + _BATCH_BYTES, len(encoded))
        part = encoded[at:end]
        stops = np.flatnonzero(part < 0x80)
        if not len(stops) or (width := np.diff(stops, prepend=-1)).max() > varint.MAX_WIDTH:
            raise _Overlong
        yield varint.get(part, stops - width + 1, width)
        at += int(stops[-1]) + 1


def _columns(message: Message, field: str) -> Iterator[U64]:
    """The values of the repeated integer `field` of `message`, some batches of them."""
    return _varints(_packed(message, field))


def _column(message: Message, field: str) -> U64:
    parts = list(_columns(message, field))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def _all_within(encoded: U8, high: int) -> bool:
    """Whether every varint of `encoded` (whole ones, one after another) is surely from 1 to
    `high`, told from their bytes without decoding them: a varint longer than `high`'s is past
    it, one as long is past it where its last byte (its top bits) is past `high`'s, and only
    those whose last byte is `high`'s are decoded. False where some may not be, or are
    written longer than they need (a zero byte), for the caller to decode them all."""
    width = 1
    while high >> (7 * width):
        width += 1
    if width >= varint.MAX_WIDTH - 1 or len(encoded) < _BATCH_BYTES // 16:
        return False  # decoded: as cheap, or past what the bytes tell
    n = len(encoded)
    more = encoded >= 0x80
    if not encoded.all():
        return False
    if width == 1:
        return not (encoded > high).any()
    # Where `width` - 1 bytes in a row go on: a varint of `width` bytes ends after them, or
    # a longer one goes on.
    going = more[: n - width + 1].copy()
    for k in range(1, width - 1):
        going &= more[k: n - width + 1 + k]
    if (going & more[width - 1:]).any():
        return False
    last = encoded[width - 1:]
    top = high >> (7 * (width - 1))
    if (going & (last > top)).any():
        return False
    ties = np.flatnonzero(going & (last == top))
    return bool((varint.get(encoded, ties, np.full(len(ties), width)) <= high).all())


class _Ids:
    """A table's ids, checked to be neither 0 nor another's, to look others up in: as a
    bitmap over their range where they are dense (pprof's writers number from 1), sorted
    where they are not."""

    def __init__(self, ids: U64, what: str) -> None:
        self._count = len(ids)
        if not len(ids):
            self._low, self._bitmap, self._sorted = 0, np.zeros(0, np.bool_), None
            return
        if not ids.all():
            raise ProfileError(f"not a pprof profile: {what} id 0 is reserved")
        low, high = int(ids.min()), int(ids.max())
        self._low, self._sorted = low, None
        if high - low < 4 * len(ids) + 4096:
            self._bitmap = np.zeros(high - low + 1, dtype=np.bool_)
            self._bitmap[ids - np.uint64(low)] = True
            repeated = int(np.count_nonzero(self._bitmap)) != len(ids)
        else:
            self._bitmap = np.zeros(0, np.bool_)
            self._sorted = np.sort(ids)
            repeated = bool((self._sorted[1:] == self._sorted[:-1]).any())
        if repeated:
            ordered = np.sort(ids)
            twice = ordered[1:][ordered[1:] == ordered[:-1]]
            first = int(ids[np.isin(ids, twice)][0])
            raise ProfileError(f"not a pprof profile: {what} id {first} is repeated")

    def first_missing_encoded(self, encoded: U8) -> int | None:
        """The first of the varints `encoded` that is none of the ids, or None."""
        if self._sorted is None and self._low == 1 and len(self._bitmap) == self._count \
                and _all_within(encoded, self._count):
            return None  # ids 1 to n, as pprof's writers number them: all named are there
        for refs in _varints(encoded):
            if (missing := self.first_missing(refs)) is not None:
                return missing
        return None

    def first_missing(self, refs: U64) -> int | None:
        """The first of `refs` that is none of the ids, or None."""
        if self._sorted is not None:
            at = np.minimum(np.searchsorted(self._sorted, refs), len(self._sorted) - 1)
            found = self._sorted[at] == refs
        else:
            offset = refs - np.uint64(self._low)  # wraps below the lowest: past the bitmap
            found = offset < np.uint64(len(self._bitmap))
            found[found] = self._bitmap[offset[found]]
        if found.all():
            return None
        return int(refs[np.argmin(found)])


def _first_corrupt(raw: Buffer) -> str:
    """Which sample, location or label set is corrupt, for the error: a loop in Python, only
    once a profile is known to have one. Bounded as the scan's parse was (a profile refused
    either way: said without its place where that would take more)."""
    try:
        profile = parsed(RawProfile, as_bytes(raw))
    except TooManyEntries:
        return "a sample, location or label set is not a valid message"
    for what, kind, encoded in (("sample", Sample, profile.sample),
                                ("location", Location, profile.location),
                                ("label set", LabelSet, profile.label_set)):
        for i, one in enumerate(encoded):
            try:
                kind.FromString(one)
            except DecodeError as e:
                return f"{what} {i} is not a valid {kind.__name__} message ({e})"
    return "a sample, location or label set is not a valid message"


def _location_ids(raw: Buffer) -> U64:
    """Each location's id as a reader takes it (the last where one has two), a message at a
    time: for the odd profile whose ids are not one a location. The locations alone: as
    CheckedAsBytes, every sample and label of the profile was a message too (100 MB of one
    sample's empty labels took 2.9 GB); bounded, for a location's own lines (TooManyEntries)."""
    locations = parsed(CheckedLocations, as_bytes(raw)).location
    return np.fromiter((loc.id for loc in locations), dtype=np.uint64, count=len(locations))


def _function_ids(raw: Buffer) -> U64:
    """Each function's id as a reader takes it, for the odd profile whose ids are not one a
    function (as _location_ids)."""
    functions = parsed(RawProfile, as_bytes(raw)).function
    return np.fromiter((f.id for f in functions), dtype=np.uint64, count=len(functions))


def _odd_values(raw: Buffer, types: int) -> str:
    """Which sample has a value count other than the profile's sample types', for the error:
    a loop in Python, only once the counts are known not to add up."""
    if not types:
        return "it has samples but no sample types"
    try:
        # Bounded: a message for every sample and label (2.9 GB for 100 MB of empty labels).
        samples = parsed(CheckedAsBytes, as_bytes(raw)).sample
    except TooManyEntries:
        return "its samples' values are not one per sample type"
    for i, sample in enumerate(samples):
        if len(sample.value) != types:
            return f"sample {i} has {len(sample.value)} values for {types} sample types"
    return "its samples' values are not one per sample type"  # unreachable: they add up


def check_tables(profile: RawProfile) -> None:
    """Raise ProfileError where the profile has no string table, its string indices point
    outside it, it has samples but no sample types, or a mapping's or function's id is 0 or
    another's, as pprof's own reader refuses them (its decoder's string lookups,
    Profile.CheckValid): of two mappings with one id, a location's addresses would be
    translated with either's range. A Python loop over its mappings and functions: some
    0.5 us each."""
    strings = len(profile.string_table)
    # Without one, pprof's reader refuses even the index 0 of a field left out (its
    # drop_frames), and reads the profile as some other format ("unrecognized profile format").
    if not strings:
        raise ProfileError("not a pprof profile: its string table is empty (string_table[0] "
                           "must be \"\")")
    if profile.string_table[0] != "":
        raise ProfileError("not a pprof profile: string_table[0] must be empty")
    if profile.sample and not profile.sample_type:
        raise ProfileError("not a pprof profile: it has samples but no sample types")
    indices = [(f"sample_type {i}", index) for i, t in enumerate(profile.sample_type)
               for index in (t.type, t.unit)]
    indices += [(f"comment {i}", index) for i, index in enumerate(profile.comment)]
    period = profile.period_type
    indices += [("period_type", period.type), ("period_type", period.unit),
                ("drop_frames", profile.drop_frames), ("keep_frames", profile.keep_frames),
                ("default_sample_type", profile.default_sample_type)]
    for what, index in indices:
        if not 0 <= index < strings:
            raise ProfileError(f"not a pprof profile: {what}: string index {index} out of range")
    seen: set[int] = set()
    for m in profile.mapping:
        if not (0 <= m.filename < strings and 0 <= m.build_id < strings):
            raise ProfileError(f"mapping {m.id}: string index out of range")
        if m.id == 0 or m.id in seen:
            raise ProfileError(f"mapping id {m.id} is {'reserved' if not m.id else 'repeated'}")
        seen.add(m.id)
    seen.clear()
    for f in profile.function:
        for index in (f.name, f.system_name, f.filename):
            if not 0 <= index < strings:
                raise ProfileError(f"function {f.id}: string index out of range")
        if f.id == 0 or f.id in seen:
            raise ProfileError(f"function id {f.id} is {'reserved' if not f.id else 'repeated'}")
        seen.add(f.id)


def encode(profile: RawProfile, gzipped: bool, appended: Sequence[bytes | memoryview] = ()
           ) -> bytes:
    """The profile's encoding, gzipped as it came; `appended`: encoded fields of it kept apart
    (rewrite's locations_apart), after the rest."""
    raw = profile.SerializeToString()
    if appended:
        raw = b"".join([raw, *appended])
    # mtime=0: the same profile always encodes to the same bytes.
    return igzip.compress(raw, mtime=0) if gzipped else raw
