"""What a request names is checked before anything is done with it, and is known by names that
no client text can steer: a fixed-alphabet path on disk, a percent-encoded path upstream, and
an id in SQL that reads back as the same key."""

from __future__ import annotations

import hashlib
import re

import pytest

from proxy.errors import InvalidRequest
from proxy.keys import (
    MAX_SOURCE_PATH,
    ArtifactKey,
    Kind,
    normalize_section,
    normalize_source_path,
    shown_detail,
    source_path_of,
)

BID = "0123456789abcdef0123456789abcdef01234567"
STORAGE_NAME = re.compile(
    r"^[0-9a-f]{2}/([0-9a-f]+|_)/(debuginfo|executable|(source|section)-[0-9a-f]{40})$")
# Client text that must never reach a file name: climbing, separators, spaces, encodings.
HOSTILE_SOURCES = ["/../../etc/passwd", "/usr/src/../../../root/.ssh/id_rsa", "/a b/c d.c",
                   "/%2e%2e/%2e%2e/etc/passwd", "/usr/src/ünïcode.c", "//server/share/x.c",
                   "/x/" + "a" * 4000]
HOSTILE_SECTIONS = ["...", "$@-", "A" * 255, ".debug_info"]


@pytest.mark.parametrize(("kind", "detail", "key_id"), [
    ("debuginfo", "", f"{BID}/debuginfo"),
    ("executable", "", f"{BID}/executable"),
    ("source", "/usr/src/prog/main.c", f"{BID}/source/usr/src/prog/main.c"),
    ("section", ".debug_line", f"{BID}/section/.debug_line"),
])
def test_id_names_the_key_and_reads_back_as_the_same_key(
    kind: str, detail: str, key_id: str
) -> None:
    key = ArtifactKey.parse(BID, kind, detail)
    assert key.kind is Kind(kind) and key.detail == detail
    assert key.id == key_id
    assert ArtifactKey.from_id(key.id) == key
    assert ArtifactKey.from_id(key.id).id == key_id


def test_build_ids_are_lowercased_so_one_artifact_has_one_key() -> None:
    key = ArtifactKey.parse(BID.upper(), "debuginfo")
    assert key == ArtifactKey.parse(BID, "debuginfo")
    assert key.build_id == BID


@pytest.mark.parametrize("bad", ["", "a", "abc", "zz", "12345g", "0" * 130, "ab/cd", "../..",
                                 "ab cd"])
def test_a_malformed_build_id_is_refused_for_every_kind(bad: str) -> None:
    for kind, detail in (("debuginfo", ""), ("executable", ""), ("source", "/a.c"),
                         ("section", ".text")):
        with pytest.raises(InvalidRequest, match="invalid build ID"):
            ArtifactKey.parse(bad, kind, detail)


def test_unknown_kinds_and_stray_paths_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="unknown artifact type 'symbols'"):
        ArtifactKey.parse(BID, "symbols")
    for kind in ("debuginfo", "executable"):
        with pytest.raises(InvalidRequest, match=f"{kind} takes no path"):
            ArtifactKey.parse(BID, kind, "/etc/passwd")
    with pytest.raises(InvalidRequest, match="unknown artifact type"):
        ArtifactKey.from_id(f"{BID}/symbols")


@pytest.mark.parametrize("detail", HOSTILE_SOURCES)
def test_a_source_paths_storage_name_is_a_hash_never_the_path(detail: str) -> None:
    name = ArtifactKey.parse(BID, "source", detail).storage_name
    assert STORAGE_NAME.match(name), name
    assert name.startswith(f"{BID[:2]}/{BID[2:]}/source-")
    assert ".." not in name and " " not in name and "%" not in name


@pytest.mark.parametrize("detail", HOSTILE_SECTIONS)
def test_a_sections_storage_name_is_a_hash_never_the_name(detail: str) -> None:
    name = ArtifactKey.parse(BID, "section", detail).storage_name
    assert STORAGE_NAME.match(name), name
    assert name.startswith(f"{BID[:2]}/{BID[2:]}/section-")
    assert ".." not in name and detail not in name.split("/")


def test_storage_names_are_distinct_per_key_and_fixed_for_whole_files() -> None:
    assert ArtifactKey.parse(BID, "debuginfo").storage_name == f"01/{BID[2:]}/debuginfo"
    assert ArtifactKey.parse(BID, "executable").storage_name == f"01/{BID[2:]}/executable"
    assert ArtifactKey.parse("ab", "debuginfo").storage_name == "ab/_/debuginfo"  # 2 digits
    keys = [ArtifactKey.parse(BID, "source", d) for d in HOSTILE_SOURCES]
    keys += [ArtifactKey.parse(BID, "section", d) for d in HOSTILE_SECTIONS]
    keys += [ArtifactKey.parse(BID, k) for k in ("debuginfo", "executable")]
    keys += [ArtifactKey.parse("ab" * 20, "source", HOSTILE_SOURCES[0])]
    assert len({k.storage_name for k in keys}) == len(set(keys))


def test_upstream_paths_are_percent_encoded_as_elfutils_client_does() -> None:
    assert ArtifactKey.parse(BID, "debuginfo").upstream_path == f"/buildid/{BID}/debuginfo"
    assert ArtifactKey.parse(BID, "executable").upstream_path == f"/buildid/{BID}/executable"
    source = ArtifactKey.parse(BID, "source", "/usr/src/a b/c#d?e%f.c")
    assert source.upstream_path == f"/buildid/{BID}/source/usr/src/a%20b/c%23d%3Fe%25f.c"
    section = ArtifactKey.parse(BID, "section", "sec$tion@x")
    assert section.upstream_path == f"/buildid/{BID}/section/sec%24tion%40x"


def test_an_upstream_source_path_stays_under_its_build_id() -> None:
    for detail in HOSTILE_SOURCES:
        path = ArtifactKey.parse(BID, "source", detail).upstream_path
        assert path.startswith(f"/buildid/{BID}/source/"), path
        assert "/../" not in path and not path.endswith("/.."), path
        assert "%2e" not in path.lower(), path  # a literal "%2e%2e" is sent as %252e%252e


@pytest.mark.parametrize(("raw", "normal"), [
    ("/usr/src/prog/main.c", "/usr/src/prog/main.c"),
    ("/usr/src/../lib/./x.c", "/usr/lib/x.c"),
    ("/../../etc/passwd", "/etc/passwd"),
    ("/usr/src/../../../../etc/passwd", "/etc/passwd"),
    ("//usr//src///a.c", "/usr/src/a.c"),
    # elfutils resolves "." and "..", but keeps a final "/": a directory, never a file.
    ("/usr/src/dir/", "/usr/src/dir/"),
    ("/usr/src/a.c//", "/usr/src/a.c/"),
    ("/usr/src/x/../a.c/", "/usr/src/a.c/"),
    ("/usr/src/a.c/.", "/usr/src/a.c"),
    ("/", "/"),
    ("/%2e%2e/a.c", "/%2e%2e/a.c"),  # already decoded by the router: a literal name here
])
def test_source_paths_are_resolved_as_elfutils_canonicalises_them(raw: str, normal: str) -> None:
    assert normalize_source_path(raw) == normal


@pytest.mark.parametrize(("raw", "reason"), [
    ("", "must be absolute"),
    ("usr/src/a.c", "must be absolute"),
    ("../etc/passwd", "must be absolute"),
    ("/a\x00b.c", "NUL byte"),
    ("/" + "a" * MAX_SOURCE_PATH, f"longer than {MAX_SOURCE_PATH} bytes"),
    # Under the limit in characters, over it in the bytes PATH_MAX counts (and 12 times
    # over once percent-encoded for the upstream).
    ("/" + "\U0001F600" * 1100, f"longer than {MAX_SOURCE_PATH} bytes"),
])
def test_bad_source_paths_are_refused_with_the_reason(raw: str, reason: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(reason)):
        normalize_source_path(raw)


def test_a_source_path_of_exactly_the_limit_is_taken() -> None:
    raw = "/" + "a" * (MAX_SOURCE_PATH - 1)
    assert normalize_source_path(raw) == raw


@pytest.mark.parametrize("name", [".debug_info", ".gnu_debugaltlink", "a", "x$y@z-1.2_3",
                                  "A" * 4096, "__ksymtab+sym", ".a b", ".é", "x%2Fy", ".a:b",
                                  "a/b", "../x", ".", "..", "a\tb", ".x\ny", ".debug\x7f"])
def test_section_names_an_elf_file_may_have_are_taken_as_they_are(name: str) -> None:
    assert normalize_section(name) == name


@pytest.mark.parametrize("name", [
    "", "A" * 4097, "é" * 2049, ".debug\x00", "\x00", ".a\ud800",
])
def test_other_section_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidRequest, match="invalid section name"):
        normalize_section(name)


def test_a_section_name_that_is_not_utf8_keeps_its_bytes_on_disk_and_in_sql() -> None:
    """`.caf\xe9` (Latin-1) and `.caf%E9` (UTF-8 text) are two sections, both served."""
    raw = ArtifactKey.parse(BID, "section", source_path_of(b".caf%E9"))
    literal = ArtifactKey.parse(BID, "section", ".caf%E9")
    assert raw.detail.encode("utf-8", "surrogateescape") == b".caf\xe9"
    assert raw.id == f"{BID}/section:.caf%E9" and raw.id.isascii()
    assert literal.id == f"{BID}/section/.caf%E9"
    assert raw.storage_name != literal.storage_name
    assert raw.upstream_path == f"/buildid/{BID}/section/.caf%E9"
    assert ArtifactKey.from_id(raw.id) == raw and ArtifactKey.from_id(literal.id) == literal


@pytest.mark.parametrize("name", ["a\tb", ".x\ny", ".\x1b[31m", ".caf\udce9\t"])
def test_a_section_name_with_control_characters_is_kept_percent_encoded(name: str) -> None:
    """As a source path's: SQL ids, logs and messages get no control character of it."""
    key = ArtifactKey.parse(BID, "section", name)
    assert key.detail == name
    assert key.id.startswith(f"{BID}/section:") and key.id.isprintable()
    assert ArtifactKey.from_id(key.id) == key
    assert shown_detail(key.detail).isprintable()
    assert key.upstream_path.isprintable()


# /src/café.c as a Latin-1 file system names it: no UTF-8, as a compiler records it in DWARF.
LATIN1 = b"/src/caf\xe9/m\xe9.c"


def test_a_source_path_that_is_not_utf8_keeps_its_bytes_upstream_on_disk_and_in_sql() -> None:
    key = ArtifactKey.parse(BID, "source", source_path_of(b"/src/caf%E9/m%e9.c"))
    assert key.detail.encode("utf-8", "surrogateescape") == LATIN1
    # Asked of upstreams as elfutils' client asks for it: the same bytes, percent-encoded.
    assert key.upstream_path == f"/buildid/{BID}/source/src/caf%E9/m%E9.c"
    # SQL and logs take text: the bytes, percent-encoded, under a prefix of their own.
    assert key.id == f"{BID}/source:/src/caf%E9/m%E9.c"
    assert key.id.isascii()
    assert ArtifactKey.from_id(key.id) == key
    assert STORAGE_NAME.match(key.storage_name)
    # A header is text too.
    assert key.default_filename == "m%E9.c"


@pytest.mark.parametrize("raw", ["/src/t\tab.c", "/src/new\nline.c", "/a\x1fb\x7f.c",
                                 "/src/caf\udce9\t.c"])
def test_a_source_path_with_control_characters_is_kept_percent_encoded(raw: str) -> None:
    """A file may be named so, and elfutils serves it; SQL ids, logs and headers get no
    control character of it."""
    key = ArtifactKey.parse(BID, "source", raw)
    assert key.detail == raw
    assert key.id.startswith(f"{BID}/source:") and key.id.isprintable()
    assert ArtifactKey.from_id(key.id) == key
    assert key.default_filename.isprintable() and "%" in key.default_filename
    assert key.upstream_path.isprintable()


def test_a_path_of_percent_signs_is_another_file_than_one_of_such_bytes() -> None:
    """`%E9` in a UTF-8 path is three characters; a byte E9 is one: two keys, two files."""
    literal = ArtifactKey.parse(BID, "source", "/src/caf%E9/m%E9.c")
    raw = ArtifactKey.parse(BID, "source", source_path_of(b"/src/caf%E9/m%E9.c"))
    assert literal != raw
    assert literal.id != raw.id and literal.storage_name != raw.storage_name
    assert literal.upstream_path == f"/buildid/{BID}/source/src/caf%25E9/m%25E9.c"
    assert ArtifactKey.from_id(literal.id) == literal and ArtifactKey.from_id(raw.id) == raw


def test_utf8_source_paths_keep_the_names_they_had() -> None:
    """Caches and SQL rows written before bytes were kept still name the same files."""
    key = ArtifactKey.parse(BID, "source", source_path_of(b"/usr/src/%C3%BCn%C3%AFcode.c"))
    assert key.detail == "/usr/src/ünïcode.c"
    assert key.id == f"{BID}/source/usr/src/ünïcode.c"
    digest = hashlib.sha256("/usr/src/ünïcode.c".encode()).hexdigest()[:40]
    assert key.storage_name == f"01/{BID[2:]}/source-{digest}"
    assert key.upstream_path == f"/buildid/{BID}/source/usr/src/%C3%BCn%C3%AFcode.c"


def test_a_long_path_of_bytes_counts_its_bytes() -> None:
    fits = b"/" + b"\xe9" * (MAX_SOURCE_PATH - 1)
    assert ArtifactKey.parse(BID, "source", fits.decode("utf-8", "surrogateescape"))
    with pytest.raises(InvalidRequest, match="longer than"):
        ArtifactKey.parse(BID, "source", (fits + b"\xe9").decode("utf-8", "surrogateescape"))
