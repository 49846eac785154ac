"""What a request asks for, validated, and the names it is known by upstream, in SQL and on disk.

Nothing a client sends ever becomes part of a filesystem path directly: build IDs are checked
to be hex, and source paths and section names are hashed into the storage name.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import quote, unquote_to_bytes

from proxy.errors import InvalidRequest
from symbolize import buildid as symbolize_buildid

# Bytes of UTF-8, as PATH_MAX counts them: no file a compiler named can be longer, and
# elfutils' client cuts its whole request URL at PATH_MAX, so no real client sends more.
MAX_SOURCE_PATH = 4096
# An ELF section name is any bytes but NUL, and elfutils' debuginfod serves whichever the file
# has (`.text.` and a long C++ name, `__ksymtab+sym`, `.a b`, `a/b`: all that follows
# `/section/`, a tab too). Upstreams are never asked for a section, and upstream_path encodes
# a "/" of one.


class Kind(StrEnum):
    DEBUGINFO = "debuginfo"
    EXECUTABLE = "executable"
    SOURCE = "source"
    SECTION = "section"

    @property
    def is_elf(self) -> bool:
        """ELF files carry their build ID, so what upstream sends can be verified."""
        return self in (Kind.DEBUGINFO, Kind.EXECUTABLE)


def normalize_build_id(raw: str) -> str:
    try:
        return symbolize_buildid.normalize_build_id(raw)
    except symbolize_buildid.InvalidBuildId as e:
        raise InvalidRequest(str(e)) from None


def source_path_of(encoded: bytes) -> str:
    """A source path as a client percent-encodes it, decoded: the path's bytes as text, each
    byte that is not UTF-8 as Python's file names carry it (a lone surrogate, U+DC80-U+DCFF).

    A compiler names a file with whatever bytes the build's file system had: a path such as
    /src/caf\xe9.c (Latin-1) is a valid source of a valid build ID, which elfutils' debuginfod
    serves and its client asks for as /src/caf%E9.c."""
    return unquote_to_bytes(encoded).decode("utf-8", "surrogateescape")


def _path_bytes(path: str) -> bytes:
    return path.encode("utf-8", "surrogateescape")


def is_text(path: str) -> bool:
    """Whether `path` is UTF-8 text: no byte of it is carried as a lone surrogate."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def plain(detail: str) -> bool:
    """Whether a source path or section name goes into SQL keys as it is: UTF-8 text without
    control characters. Others are named by their bytes, percent-encoded."""
    return is_text(detail) and _CONTROL.search(detail) is None


def normalize_source_path(raw: str) -> str:
    """An absolute source path, with `.` and `..` resolved the way elfutils canonicalises.

    Resolving here also means the path forwarded upstream can never climb out of /buildid.
    `raw` may carry bytes that are not UTF-8 as source_path_of decodes them.
    """
    if not raw.startswith("/"):
        raise InvalidRequest("invalid source path: must be absolute")
    try:
        size = len(_path_bytes(raw))
    except UnicodeEncodeError:  # a surrogate that stands for no byte: no path has it
        raise InvalidRequest("invalid source path: not a path's bytes") from None
    if len(raw) > MAX_SOURCE_PATH or size > MAX_SOURCE_PATH:
        raise InvalidRequest(f"invalid source path: longer than {MAX_SOURCE_PATH} bytes")
    # No path has a NUL. A tab or a line break it may have (gcc records `t\tab.c` as it is,
    # elfutils serves it): such a path is named in SQL and headers percent-encoded (plain).
    if "\x00" in raw:
        raise InvalidRequest("invalid source path: contains a NUL byte")
    path = "/" + posixpath.normpath(raw).lstrip("/")
    # normpath keeps a leading "//" (POSIX allows it to mean something else); we do not. It
    # drops a final "/", which elfutils keeps: "main.c/" names a directory, no file (404),
    # and must not be answered with main.c.
    return path + "/" if raw.endswith("/") and path != "/" else path


def normalize_section(raw: str) -> str:
    """A section name, which may carry bytes that are not UTF-8 as source_path_of decodes them
    (`.caf%E9`: elfutils' debuginfod serves a Latin-1 name, and its client asks for it so)."""
    # A control character is named in SQL keys and log lines percent-encoded, as a source
    # path's is (plain): a tab was refused, though elfutils serves such a section. "." and
    # ".." are names a file may have too: elfutils' client sends them as they are, and its
    # debuginfod serves them. No name has a NUL.
    try:
        size = len(_path_bytes(raw))
    except UnicodeEncodeError:  # a surrogate that stands for no byte: no name has it
        raise InvalidRequest("invalid section name") from None
    if not raw or "\x00" in raw or size > MAX_SOURCE_PATH:
        raise InvalidRequest("invalid section name")
    return raw


def shown_detail(detail: str) -> str:
    """A source path or section name for a message: bytes that are not UTF-8, and control
    characters, percent-encoded (a response body or a log line is printable text)."""
    return detail if plain(detail) else quote(_path_bytes(detail), safe="/")


# The id of a source path that is not UTF-8 (ArtifactKey.id): a text path's id is
# "<build ID>/source/...", whose path starts with a slash. A section name's likewise.
_RAW_SOURCE = "source:"
_RAW_SECTION = "section:"
_PARSED_MAX = 4096
_PARSED: dict[tuple[str, str], ArtifactKey] = {}


@dataclass(frozen=True, slots=True)
class ArtifactKey:
    build_id: str
    kind: Kind
    # The source path for SOURCE, the section name for SECTION, "" otherwise.
    detail: str = ""

    @classmethod
    def parse(cls, build_id: str, kind: str, detail: str = "") -> ArtifactKey:
        """InvalidRequest for what debuginfod would refuse. Keys are immutable, and a hot key is
        asked for thousands of times a second: what parsed well is remembered (not sources'
        and sections' keys, whose paths could make the memo large)."""
        if detail:
            return cls._parse(build_id, kind, detail)
        memo = _PARSED.get((build_id, kind))
        if memo is not None:
            return memo
        key = cls._parse(build_id, kind, detail)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()  # bounded; refilled by what is asked for now
        _PARSED[(build_id, kind)] = key
        return key

    @classmethod
    def _parse(cls, build_id: str, kind: str, detail: str) -> ArtifactKey:
        bid = normalize_build_id(build_id)
        try:
            k = Kind(kind)
        except ValueError:
            raise InvalidRequest(f"unknown artifact type {kind!r}") from None
        if k is Kind.SOURCE:
            return cls(bid, k, normalize_source_path(detail))
        if k is Kind.SECTION:
            return cls(bid, k, normalize_section(detail))
        if detail:
            raise InvalidRequest(f"{kind} takes no path")
        return cls(bid, k)

    @classmethod
    def from_id(cls, key_id: str) -> ArtifactKey:
        """The inverse of `id`: back from what SQL and logs hold."""
        build_id, _, rest = key_id.partition("/")
        if rest.startswith(_RAW_SOURCE):
            return cls.parse(build_id, "source",
                             source_path_of(rest[len(_RAW_SOURCE):].encode()))
        if rest.startswith(_RAW_SECTION):
            return cls.parse(build_id, "section",
                             source_path_of(rest[len(_RAW_SECTION):].encode()))
        if rest.startswith("source/"):
            return cls.parse(build_id, "source", rest[len("source"):])
        if rest.startswith("section/"):
            return cls.parse(build_id, "section", rest[len("section/"):])
        return cls.parse(build_id, rest)

    @property
    def id(self) -> str:
        """The primary key in SQL; also what logs and the admin CLI show."""
        if self.kind is Kind.SOURCE:
            if plain(self.detail):
                return f"{self.build_id}/source{self.detail}"
            # SQL and logs take text: a path that is not UTF-8, or has a tab or a line break,
            # is named by its bytes, percent-encoded (every byte but letters, digits,
            # `_.-~/`, so that no two paths share a name), under a prefix that no text path's
            # id has.
            return f"{self.build_id}/{_RAW_SOURCE}{quote(_path_bytes(self.detail), safe='/')}"
        if self.kind is Kind.SECTION:
            if plain(self.detail):
                return f"{self.build_id}/section/{self.detail}"
            return f"{self.build_id}/{_RAW_SECTION}{quote(_path_bytes(self.detail), safe='')}"
        return f"{self.build_id}/{self.kind}"

    @property
    def upstream_path(self) -> str:
        """The request path on a debuginfod server, percent-encoded as elfutils' client does."""
        if self.kind is Kind.SOURCE:
            return f"/buildid/{self.build_id}/source{quote(_path_bytes(self.detail), safe='/')}"
        if self.kind is Kind.SECTION:
            return f"/buildid/{self.build_id}/section/{quote(_path_bytes(self.detail), safe='')}"
        return f"/buildid/{self.build_id}/{self.kind}"

    @property
    def storage_name(self) -> str:
        """Relative path in the cache directory: fixed-alphabet names only."""
        leaf = str(self.kind)
        if self.detail:
            leaf += "-" + hashlib.sha256(_path_bytes(self.detail)).hexdigest()[:40]
        return f"{self.build_id[:2]}/{self.build_id[2:] or '_'}/{leaf}"

    @property
    def default_filename(self) -> str:
        """X-DEBUGINFOD-FILE when upstream did not send one."""
        if self.kind is Kind.SOURCE:
            name = posixpath.basename(self.detail)
            # A header is printable text: a name that is not UTF-8, or has a control
            # character, goes percent-encoded.
            return name if plain(name) else quote(_path_bytes(name))
        return f"{self.build_id}.debug" if self.kind is Kind.DEBUGINFO else self.build_id
