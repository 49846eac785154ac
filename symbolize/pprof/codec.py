"""Reading and writing pprof profiles: gzip or raw protobuf, with bounded decompression.

Profiles are read as RawProfile: samples and locations stay encoded until the rewrite reads the
locations it symbolizes, and go back out as they came.

gzip is ISA-L's (python-isal), not zlib's: a gzipped profile of 100,000 locations inflated in
2.4 ms against zlib's 5.0, and its 3.9 MB answer deflated in 8 ms against zlib's 129 at level
6 (37 at level 1, for the same size as ISA-L's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from google.protobuf.message import DecodeError
from isal import igzip, isal_zlib

from .profile_pb2 import LabelSet, Location, Sample
from .profile_raw_pb2 import CheckedAsBytes, RawProfile

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
        profile = RawProfile.FromString(as_bytes(raw))
    except DecodeError as e:
        raise ProfileError(f"not a pprof profile: {e}") from e
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


def check(decoded: Decoded) -> None:
    """Raise ProfileError where check_tables or check_samples finds the profile wrong."""
    check_tables(decoded.profile)
    check_samples(decoded.raw)


def check_samples(raw: Buffer) -> None:
    """Raise ProfileError where a Sample, Location or LabelSet of the encoded profile `raw` is
    not a valid message. A RawProfile passes them on as bytes unread: unchecked, a corrupt one
    (a packed field longer than its sample, say) went out in an answer no pprof reader can
    parse. Locations are read by the rewrite only where it fills some in: a corrupt one was a
    400 where a profile's debug files were found and a 200, its bytes sent back, where not.

    protobuf parses them all in C, as a reader will, against a microsecond each for a loop in
    Python; but it makes a message of each: for a million one-frame samples 55 ms where malloc
    has memory at hand, 100 to 190 in a fresh process (the scan's 75 ms becomes 270), and 90 MB
    while it lasts. (Their shapes vary with stack depth and labels: they have no rows for numpy
    to check in bulk, as columns.py does locations.)"""
    try:
        CheckedAsBytes.FromString(as_bytes(raw))
    except DecodeError:
        raise ProfileError(f"not a pprof profile: {_first_corrupt(raw)}") from None


def _first_corrupt(raw: Buffer) -> str:
    """Which sample, location or label set is corrupt, for the error: a loop in Python, only
    once a profile is known to have one."""
    profile = RawProfile.FromString(as_bytes(raw))
    for what, kind, encoded in (("sample", Sample, profile.sample),
                                ("location", Location, profile.location),
                                ("label set", LabelSet, profile.label_set)):
        for i, one in enumerate(encoded):
            try:
                kind.FromString(one)
            except DecodeError as e:
                return f"{what} {i} is not a valid {kind.__name__} message ({e})"
    return "a sample, location or label set is not a valid message"


def check_tables(profile: RawProfile) -> None:
    """Raise ProfileError where the profile's string indices point outside its string table,
    it has samples but no sample types, or a mapping's or function's id is 0 or another's, as
    pprof's own reader refuses them (its decoder's string lookups, Profile.CheckValid): of two
    mappings with one id, a location's addresses would be translated with either's range. A
    Python loop over its mappings and functions: some 0.5 us each."""
    strings = len(profile.string_table)
    if strings and profile.string_table[0] != "":
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
        if not 0 <= index < max(strings, 1):
            raise ProfileError(f"not a pprof profile: {what}: string index {index} out of range")
    seen: set[int] = set()
    for m in profile.mapping:
        if not (0 <= m.filename < max(strings, 1) and 0 <= m.build_id < max(strings, 1)):
            raise ProfileError(f"mapping {m.id}: string index out of range")
        if m.id == 0 or m.id in seen:
            raise ProfileError(f"mapping id {m.id} is {'reserved' if not m.id else 'repeated'}")
        seen.add(m.id)
    seen.clear()
    for f in profile.function:
        for index in (f.name, f.system_name, f.filename):
            if not 0 <= index < max(strings, 1):
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
