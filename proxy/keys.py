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
from urllib.parse import quote

from proxy.errors import InvalidRequest
from symbolize import buildid as symbolize_buildid

# Bytes of UTF-8, as PATH_MAX counts them: no file a compiler named can be longer, and
# elfutils' client cuts its whole request URL at PATH_MAX, so no real client sends more.
MAX_SOURCE_PATH = 4096
_SECTION = re.compile(r"[A-Za-z0-9._$@-]{1,255}")


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


def normalize_source_path(raw: str) -> str:
    """An absolute source path, with `.` and `..` resolved the way elfutils canonicalises.

    Resolving here also means the path forwarded upstream can never climb out of /buildid.
    """
    if not raw.startswith("/"):
        raise InvalidRequest("invalid source path: must be absolute")
    if len(raw) > MAX_SOURCE_PATH or len(raw.encode(errors="surrogatepass")) > MAX_SOURCE_PATH:
        raise InvalidRequest(f"invalid source path: longer than {MAX_SOURCE_PATH} bytes")
    if any(ord(c) < 0x20 or c == "\x7f" for c in raw):
        raise InvalidRequest("invalid source path: contains control characters")
    path = posixpath.normpath(raw)
    # normpath keeps a leading "//" (POSIX allows it to mean something else); we do not.
    return "/" + path.lstrip("/")


def normalize_section(raw: str) -> str:
    # fullmatch: `$` would let a final newline through into SQL keys and log lines. "." and
    # ".." would be resolved away by HTTP clients, asking upstream for another path.
    if not _SECTION.fullmatch(raw) or raw in (".", ".."):
        raise InvalidRequest("invalid section name")
    return raw


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
        if rest.startswith("source/"):
            return cls.parse(build_id, "source", rest[len("source"):])
        if rest.startswith("section/"):
            return cls.parse(build_id, "section", rest[len("section/"):])
        return cls.parse(build_id, rest)

    @property
    def id(self) -> str:
        """The primary key in SQL; also what logs and the admin CLI show."""
        if self.kind is Kind.SOURCE:
            return f"{self.build_id}/source{self.detail}"
        if self.kind is Kind.SECTION:
            return f"{self.build_id}/section/{self.detail}"
        return f"{self.build_id}/{self.kind}"

    @property
    def upstream_path(self) -> str:
        """The request path on a debuginfod server, percent-encoded as elfutils' client does."""
        if self.kind is Kind.SOURCE:
            return f"/buildid/{self.build_id}/source{quote(self.detail, safe='/')}"
        if self.kind is Kind.SECTION:
            return f"/buildid/{self.build_id}/section/{quote(self.detail, safe='')}"
        return f"/buildid/{self.build_id}/{self.kind}"

    @property
    def storage_name(self) -> str:
        """Relative path in the cache directory: fixed-alphabet names only."""
        leaf = str(self.kind)
        if self.detail:
            leaf += "-" + hashlib.sha256(self.detail.encode()).hexdigest()[:40]
        return f"{self.build_id[:2]}/{self.build_id[2:] or '_'}/{leaf}"

    @property
    def default_filename(self) -> str:
        """X-DEBUGINFOD-FILE when upstream did not send one."""
        if self.kind is Kind.SOURCE:
            return posixpath.basename(self.detail)
        return f"{self.build_id}.debug" if self.kind is Kind.DEBUGINFO else self.build_id
