"""Configuration: a TOML file parsed into typed, validated dataclasses.

Every key has a default, so an empty file (or no file) is a complete configuration.
Unknown keys and bad values raise ConfigError naming the offending key, because a typo in a
cache budget or a TTL should stop the server at start, not silently use a default.

pydantic does the checking; this module says what a good value is, and turns pydantic's first
error into one "key: reason" line.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import ErrorDetails
from yarl import URL

DEFAULT_UPSTREAM = "https://debuginfod.elfutils.org/"
DEFAULT_LISTEN = "127.0.0.1:8002"

FetchPolicy = Literal["in_order", "race"]
# What /symbolize names frames it cannot symbolize: nothing (bare addresses), or
# `libfoo.so+0x1a2b` (the file offset, stable across runs).
Fallback = Literal["none", "module-offset"]
LogFormat = Literal["text", "json"]


class ConfigError(ValueError):
    """A configuration key is unknown or has a value that cannot be used. `file`: the file the
    key is in, when the message names only the key."""

    def __init__(self, message: str, file: Path | None = None) -> None:
        super().__init__(message)
        self.file = file


class _Invalid(ValueError):
    """A check across keys runs on the table above the key it blames; `loc` leads down to it."""

    def __init__(self, loc: tuple[str | int, ...], reason: str) -> None:
        super().__init__(reason)
        self.loc = loc


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


# 4 EiB, the most any size may be: past 2**63 a size no longer fits what C takes it as (the
# bound on a profile's inflating, a build's RLIMIT_AS), and every gzipped profile was a 500.
MAX_BYTES = 2**62


def _size(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("must not be negative")
        size: float = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        # A float, for "1.5GiB": hundreds of digits make it inf, which int() raised on
        # (OverflowError, a traceback rather than the key's error).
        size = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()]
    else:
        raise ValueError(f"expected a size such as 20GiB, got {value!r}")
    if size > MAX_BYTES:
        raise ValueError(f"must be at most {MAX_BYTES} bytes (4 EiB), got {value!r}")
    return int(size)


# A name or IPv4 address, or an IPv6 one in brackets (with its zone, if any); ASCII digits.
_LISTEN = re.compile(r"(?:\[([0-9A-Fa-f:.]+(?:%[\w.-]+)?)\]|([^\s\[\]:%]+)):([0-9]{1,5})")


def _host_port(value: str) -> tuple[str, int]:
    # Strictly: read leniently, "[]:8002" was the empty host, every address of the machine.
    m = _LISTEN.fullmatch(value)
    if m is None or int(m.group(3)) > 65535:
        raise ValueError(f"expected HOST:PORT (an IPv6 address in brackets), got {value!r}")
    return m.group(1) or m.group(2), int(m.group(3))


def _listen(value: object) -> object:
    if isinstance(value, str):
        _host_port(value)
    return value


def _none_if_empty(value: str | None) -> str | None:
    return value or None


# The drivers symgate ships with: SQLAlchemy's async ones. Another scheme (postgresql:// means
# psycopg2 to SQLAlchemy) failed only once a migration or a query tried to import its driver.
_DATABASE_SCHEMES = ("sqlite+aiosqlite", "postgresql+asyncpg")


def _database_url(value: str | None) -> str | None:
    if value is not None and value.partition("://")[0] not in _DATABASE_SCHEMES:
        # Never the URL itself: it may hold a password (SYMGATE_DATABASE_URL, a Secret's).
        scheme, sep, _ = value.partition("://")
        got = f"a {scheme}:// URL" if sep else "no URL"
        raise ValueError("expected sqlite+aiosqlite:///PATH or "
                         f"postgresql+asyncpg://USER@HOST/DATABASE, got {got}")
    if value is not None:
        from sqlalchemy.engine import make_url

        try:
            make_url(value)
        except ValueError:  # its port (every command ended in this traceback otherwise)
            raise ValueError("a URL whose host and port cannot be read (is the port a "
                             "number?)") from None
    return value


def _url(value: object) -> str:
    if not isinstance(value, str) or not re.match(r"^https?://[^/\s]+", value, re.IGNORECASE):
        # Not even a URL shown_url can read ("https//user:token@host", a typo): whatever
        # precedes an @ of its first part may be credentials, which start-up errors print.
        shown = re.sub(r"^([^/]*/*)[^/]*@", r"\1***@", value) if isinstance(value, str) \
            else value
        raise ValueError(f"expected an http:// or https:// URL, got {shown!r}")
    if "?" in value or "#" in value:
        # /buildid/... is appended to the URL as a string (as elfutils' client does): after a
        # query it would be part of the query, and every request would ask for the root.
        raise ValueError(f"a query or fragment cannot end this URL, since request paths are "
                         f"appended to it: {shown_url(value)!r}")
    try:
        # As requests read it: a port past 65535 or no number, an IPv6 address unclosed,
        # failed the start (or every request) with a traceback that named no key.
        URL(value).raw_host  # noqa: B018
    except ValueError as e:
        raise ValueError(f"not a URL requests can go to ({e}): {shown_url(value)!r}") from None
    # A scheme is case-insensitive (RFC 3986; elfutils' client takes HTTPS://), but the rest
    # of symgate compares it as written ("https" after a redirect, the bucket's "http").
    scheme, sep, rest = value.partition("://")
    return scheme.lower() + sep + rest


def shown_url(url: str) -> str:
    """`url` as logs, metrics, the status page and SQL rows show it: credentials written into
    it (https://user:token@host/) are replaced by `***`, since all of those are read by people
    and systems that must not get them."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if not sep or "@" not in authority:
        return url
    return f"{scheme}://***@{authority.rpartition('@')[2]}{slash}{path}"


def _endpoint(value: object) -> str:
    if value == "":
        return ""
    url = _url(value)
    if url != shown_url(url):
        # Not used (the bucket's credentials are the environment's), and logged at start.
        raise ValueError("credentials cannot go in the endpoint's URL: give them in "
                         f"AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY ({shown_url(url)!r})")
    return url


def _bucket_url(value: object) -> str:
    # Bucket names as S3 allows them; the rest, if any, is a prefix every object key starts with.
    if not isinstance(value, str) or not re.fullmatch(
            r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/\S*)?", value):
        raise ValueError(f"expected s3://BUCKET or s3://BUCKET/PREFIX, got {value!r}")
    return value.rstrip("/")


def _path(value: object, info: ValidationInfo) -> Path:
    if not (isinstance(value, Path) or (isinstance(value, str) and value)):
        raise ValueError(f"expected a path, got {value!r}")
    # Refused here, not by the first open(), which raised it as a fault of the program.
    if "\0" in str(value):
        raise ValueError(f"a path holds no NUL character, got {str(value)!r}")
    try:
        expanded = Path(value).expanduser()
    except RuntimeError:  # "~name" of no user
        raise ValueError(f"no such user: {Path(value).parts[0]!r}") from None
    # Relative to the directory of the file that names it (load_config), as nginx and
    # systemd read theirs: the same file means the same directories wherever the server
    # was started. (An absolute path joined to it stays itself.)
    config_dir: Path = (info.context or {}).get("config_dir", Path())
    return config_dir / expanded


def _sqlite_beside(url: str, config_dir: Path) -> str:
    """`url`, a relative SQLite file in it made relative to `config_dir`, as paths are."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:") \
            or parsed.query.get("uri"):  # a file: URI, which is the driver's to read
        return url
    return parsed.set(database=str(config_dir / parsed.database)) \
        .render_as_string(hide_password=False)


def _headers(value: object) -> object:
    # Checked here, not by pydantic, which would blame headers.NAME (that reads like a key) and
    # echo a misplaced credential string back into the log.
    if not isinstance(value, Mapping):
        raise ValueError("expected a table of strings")
    for name, v in value.items():
        if not isinstance(v, str):
            raise ValueError(f"expected a table of strings, {name} is {v!r}")
        # What no request can carry: aiohttp refused every request to the upstream (each
        # miss a 500). The value is not shown: it is a credential, as often as not.
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a header name")
        if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in v):
            raise ValueError(f"the value of {name} has a control character (a line break?)")
    return value


# RFC 9110's token, which a field name is.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _hosts(value: object) -> object:
    # "host" or "host:port" ("[v6]:port"); the name alone means the scheme's default port.
    if not isinstance(value, list | tuple):
        raise ValueError("expected a list of host or host:port strings")
    for host in value:
        if not isinstance(host, str) or not re.fullmatch(
                r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?", host):
            raise ValueError(f"expected host or host:port, got {host!r}")
    return tuple(h.lower() for h in value)


def _tokens(value: object) -> object:
    # Tokens are secrets: errors give their position and length, never the token.
    if isinstance(value, list | tuple):
        for i, token in enumerate(value):
            if not isinstance(token, str) or len(token) < 16:
                got = f"{len(token)} characters" if isinstance(token, str) else repr(token)
                raise ValueError(f"expected strings of at least 16 characters, token {i} is {got}")
    return value


def _servers(value: object) -> object:
    # A bare URL is short for a table with only url, and errs at the array, as it always has.
    if not isinstance(value, list | tuple):
        return value
    return [UpstreamConfig(url=_url(u)) if isinstance(u, str) else u for u in value]


# Scalars are strict (true is not 1, "yes" is not true); containers are not, so TOML arrays
# can become tuples and tables dataclasses.
Flag = Annotated[bool, Strict()]
Text = Annotated[str, Strict()]
Count = Annotated[int, Strict(), Field(ge=0)]
AtLeastOne = Annotated[int, Strict(), Field(ge=1)]
# Some 31 years, the most any duration may be: far past it, a time goes past what a timedelta,
# a datetime (an expiry stored in SQL: a miss then answered 500) or a thread's wait can hold.
MAX_SECONDS = 1e9
Seconds = Annotated[float, Strict(), Field(ge=0, le=MAX_SECONDS)]
# A period of a background loop: 0 would make it spin.
Period = Annotated[float, Strict(), Field(gt=0, le=MAX_SECONDS)]


# The longest tenant name, in characters: the width of the scope column that keys its rows.
MAX_TENANT = 255


def tenant_name_fault(name: str) -> str | None:
    """What keeps `name` out of the scope column that keys a tenant's rows, None if nothing:
    more characters than it is wide, or a NUL (which PostgreSQL's text does not hold)."""
    if len(name) > MAX_TENANT:
        return f"{len(name)} characters, more than {MAX_TENANT}"
    if "\0" in name:
        return "a NUL character"
    return None


def shown_name(name: str) -> str:
    """A tenant's name for a message: quoted and escaped, cut past 40 characters."""
    return json.dumps(name if len(name) <= 40 else name[:40] + "...")


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) or 1


# Worker processes of one kind: unbounded, `workers = 100000` forked until the machine ran
# out. A fixed bound, not one per core: one config file serves nodes of every size (a
# Kubernetes ConfigMap), and one refused on the smaller nodes would crash-loop there.
MAX_PROCESSES = 256
Processes = Annotated[int, Strict(), Field(ge=1, le=MAX_PROCESSES)]
Size = Annotated[int, BeforeValidator(_size)]
Url = Annotated[str, BeforeValidator(_url)]
DirPath = Annotated[Path, BeforeValidator(_path)]
Listen = Annotated[str, Strict(), BeforeValidator(_listen)]

# No inf or nan: 0 already means "no limit" where there is one, and a timedelta of inf fails.
_SECTION = ConfigDict(extra="forbid", allow_inf_nan=False)


@dataclass(frozen=True, config=_SECTION)
class UpstreamConfig:
    # Exactly one of url (a debuginfod server) and path (a local directory of debug files).
    url: Url = ""
    path: DirPath | None = None
    # For a path: seconds between re-indexing walks of the directory (0: only at start).
    rescan_s: Seconds = 60.0
    connect_timeout_s: Seconds = 5.0
    # Until the response headers arrive: a server that accepts but never answers.
    first_byte_timeout_s: Seconds = 30.0
    # Longest silence between two body chunks: a server that hangs mid-body.
    read_timeout_s: Seconds = 30.0
    # The whole exchange: connect, every redirect hop's headers, and the body.
    total_timeout_s: Seconds = 900.0
    # Retries and their waits are spent inside a client's request (total_timeout_s bounds
    # each attempt, not their sum): a million retries held it for ever, and a client gives up
    # long before a wait of minutes (elfutils' after 90 s of silence).
    retries: Annotated[Count, Field(le=10)] = 2
    retry_backoff_s: Annotated[Seconds, Field(le=60)] = 0.25
    retry_backoff_max_s: Annotated[Seconds, Field(le=60)] = 4.0
    # As browsers stop at: each redirect is one more request inside a client's.
    max_redirects: Annotated[Count, Field(le=20)] = 3
    # Where else than its own origin this upstream may redirect to ("host" or "host:port");
    # never to a loopback, link-local or private address unless the upstream itself is on one.
    redirect_hosts: Annotated[tuple[str, ...], BeforeValidator(_hosts)] = ()
    breaker_failures: Count = 5
    breaker_cooldown_s: Seconds = 30.0
    # A file that failed here (5xx, a timeout, a reset once asked) is not asked of this
    # upstream again for this long: its requests get 502 at once. 0: asked every time.
    failed_file_rest_s: Seconds = 10.0
    headers: Annotated[Mapping[str, str], BeforeValidator(_headers)] = field(
        default_factory=dict)

    @model_validator(mode="after")
    def _url_or_path(self) -> UpstreamConfig:
        if (self.url == "") == (self.path is None):
            raise _Invalid(("url",), "required (or path, for a local directory; not both)")
        return self


@dataclass(frozen=True, config=_SECTION)
class ServerConfig:
    listen: Listen = DEFAULT_LISTEN
    data_dir: DirPath = field(default_factory=lambda: default_data_dir())
    # Chained caches append themselves to X-Forwarded-For; past this many hops a request is
    # answered locally, like elfutils' --forwarded-ttl-limit, so a loop cannot amplify.
    forwarded_ttl_limit: Count = 8
    access_log: Flag = True
    # "text" for people, "json" for one JSON object a line (access and event logs alike).
    log_format: LogFormat = "text"
    # Retry-After with 502/503/504, for faults that pass: a client told more than an hour
    # would never ask again.
    retry_after_s: Annotated[Count, Field(le=3600)] = 30
    # On SIGTERM: stop accepting, let responses under way finish for this long, then stop.
    shutdown_grace_s: Seconds = 30.0
    # Hit counts and access times are batched in memory so that a hit never waits on SQL;
    # this is how much of them a crash can lose.
    access_flush_s: Period = 5.0
    # A client must send a whole request head within this long of connecting, and of the end
    # of the previous response on a kept-alive connection (also the keep-alive idle timeout).
    header_timeout_s: Period = 10.0
    # A client that acknowledges none of the bytes sent to it for this long is disconnected
    # (proxy/web/send_timeout.py): it would hold its connection, and a cached file's lease, as
    # long as it liked. 0: never.
    send_timeout_s: Seconds = 60.0
    # Client connections at once; past it, new ones get an immediate 503. Unset: derived from
    # the open files limit (raised to its hard limit at start), keeping room for cache files.
    max_connections: AtLeastOne | None = None
    # Serving processes on the one port (SO_REUSEPORT), sharing the data dir and database.
    # Unset: one per core this process may run on. `symgate serve --workers N` overrides it.
    workers: Processes | None = None


@dataclass(frozen=True, config=_SECTION)
class CacheConfig:
    dir: DirPath | None = None
    max_bytes: Size = 20 * 1024**3
    # In-flight fetches at once across all clients; further misses wait for a slot.
    max_concurrent_fetches: AtLeastOne = 32
    # The largest artifact fetched: an upstream that sends more (or never stops) is cut off
    # there, not after filling the disk. Pyroscope's client stops at 512 MiB.
    max_artifact_bytes: Size = 4 * 1024**3
    # How often each process looks for `cache purge`s made on any replica (or by the admin
    # CLI), uploads deleted and downloads an upload replaced (by another process or replica),
    # and removes its own copy: how long such a file may still be served.
    purge_poll_s: Period = 2.0


@dataclass(frozen=True, config=_SECTION)
class DatabaseConfig:
    url: Annotated[Text | None, AfterValidator(_none_if_empty),
                   AfterValidator(_database_url)] = None
    migrate_on_start: Flag = True
    # How long connecting to PostgreSQL, or one statement, may take before the database counts
    # as unreachable: a server that accepts and never answers must not hold misses for minutes.
    timeout_s: Seconds = 5.0


@dataclass(frozen=True, config=_SECTION)
class NegativeConfig:
    # The first 404 is remembered briefly (some upstreams publish minutes after a first miss);
    # each repeated miss doubles the TTL up to not_found_ttl_s, elfutils' cache_miss_s default.
    not_found_initial_ttl_s: Seconds = 60.0
    not_found_ttl_s: Seconds = 600.0
    # How long this process trusts its in-memory copy of a SQL negative before asking SQL
    # again; bounds how stale a negative cleared by another replica can be.
    memo_s: Seconds = 1.0
    # Expired misses are kept until a sweep, not deleted on every lookup that finds one.
    sweep_s: Period = 300.0
    # Bounds the memory a flood of distinct missing build IDs can take.
    memo_entries: AtLeastOne = 100_000

    @model_validator(mode="after")
    def _initial_within_max(self) -> NegativeConfig:
        if self.not_found_initial_ttl_s > self.not_found_ttl_s:
            raise _Invalid(("not_found_initial_ttl_s",), "must not exceed not_found_ttl_s")
        return self


@dataclass(frozen=True, config=_SECTION)
class FetchConfig:
    policy: FetchPolicy = "in_order"


@dataclass(frozen=True, config=_SECTION)
class SymbolizeConfig:
    enabled: Flag = True
    # Trees laid out like /usr/lib/debug: .build-id/xx/rest.debug (and .build-id/xx/rest for the
    # executable), searched before the upstreams: a site's own binaries.
    debug_dirs: tuple[DirPath, ...] = ()
    max_request_bytes: Size = 32 * 1024**2
    # A gzip bomb is refused once it inflates past this, not after.
    max_decompressed_bytes: Size = 256 * 1024**2
    # Distinct build IDs one request may make symgate fetch or build; more is a 422. 0: no
    # bound.
    max_mappings: Count = 256
    # Past this, the profile is answered with what is symbolized so far; fetches go on.
    # 0: no deadline.
    deadline_s: Seconds = 30.0
    # Worker processes that build symbol tables.
    build_workers: Processes = 2
    # A build runs in a child of its worker (proxy/symbols/isolated_build.py), killed past
    # this many seconds, and allowed this much address space (0: no bound; the kernel's OOM
    # killer then takes that child first): the file is then remembered as malformed.
    build_timeout_s: Seconds = 600.0
    build_memory_bytes: Size = 0
    # Worker processes that decode, rewrite and encode profiles, off the event loop.
    workers: Processes = field(default_factory=lambda: min(2, cores()))
    # Seconds without a job after which the worker processes exit (started again by the next
    # job): an idle server is one process. 0: they start with the server and stay.
    worker_idle_s: Seconds = 60.0
    # A worker started with the server, so that its first profile waits for none. false: the
    # first build or profile starts one; a server used as a proxy alone stays one process.
    worker_at_start: Flag = True
    # Profiles in work at once, and waiting for a slot; past both, 429 with Retry-After.
    max_concurrent: AtLeastOne = 4
    max_waiting: Count = 16
    # A profile's body must arrive within this (else 408): an upload that trickles in holds
    # an admission place, never a worker slot, and only for this long.
    body_timeout_s: Seconds = 60.0
    # A body still coming slower than this (bytes a second, on average) gives its place up
    # to a profile that would be refused 429 (it is answered 408). 0: never.
    min_body_rate: Size = 64 * 1024
    # Work bounds per profile, checked as it is decoded (before any rewrite); more is a 422,
    # 0 is no bound. Far above a real profile of a big process (hundreds of mappings, 10^5
    # locations).
    max_profile_mappings: Count = 10_000
    max_profile_locations: Count = 2_000_000
    max_profile_functions: Count = 2_000_000
    max_profile_samples: Count = 10_000_000
    # Each open table holds a file descriptor and its mapped pages.
    open_tables: AtLeastOne = 512
    # How long a failed build is believed: a file without symbols may be replaced upstream by
    # one with them (like a 404, retried); a malformed one rarely is, so symbolicator waits a day.
    no_symbols_retry_s: Seconds = 600.0
    malformed_retry_s: Seconds = 86400.0
    # Names for frames that stay unsymbolized; ?fallback= on a request overrides it.
    fallback: Fallback = "none"


@dataclass(frozen=True, config=_SECTION)
class UploadConfig:
    """PUT /buildid/ID/debuginfo|executable: a site's own debug files, pinned."""

    enabled: Flag = True
    # Every upload together; they are never evicted and do not count against cache.max_bytes.
    # A PUT past it is a 507 until uploads are deleted.
    max_bytes: Size = 20 * 1024**3
    # The largest file one PUT may send: 413, before the body when its size is announced.
    max_file_bytes: Size = 4 * 1024**3
    # The whole body must arrive within this (else 408): a stalled uploader holds no temp file
    # for ever.
    body_timeout_s: Seconds = 600.0
    # Bearer tokens that upload into the shared scope (or a tenant's, named by X-Scope-OrgID).
    admin_tokens: Annotated[tuple[Text, ...], BeforeValidator(_tokens)] = field(
        default=(), repr=False)


@dataclass(frozen=True, config=_SECTION)
class StorageConfig:
    """A shared S3-compatible bucket behind every replica's own disk (proxy.bucket).
    Credentials come from the standard AWS_* environment variables, never from this file."""

    url: Annotated[str, BeforeValidator(_bucket_url)]
    # MinIO, Ceph RGW, GCS interop, ...; AWS's own endpoint for the region when unset.
    endpoint: Annotated[str, BeforeValidator(_endpoint)] = ""
    region: Text = ""
    connect_timeout_s: Seconds = 2.0
    # Until a GET's headers, and between two chunks of its body: a bucket that hangs counts
    # as down this soon, and requests go to the upstreams instead.
    read_timeout_s: Seconds = 10.0
    # After a failure the bucket is not asked again for this long (a down bucket must not
    # cost every miss a timeout).
    retry_s: Period = 5.0
    # A replica fetching a key from upstream for the cluster holds a lease this long, renewed
    # while it works; one that dies loses it then, and another takes the fetch over.
    lease_s: Period = 15.0
    # How long a replica waits for another's fetch of a key before fetching it itself.
    wait_s: Seconds = 300.0
    # Period of the catch-up (local files the bucket lacks are uploaded) and of eviction.
    sync_s: Period = 30.0
    # The bucket's budget (0: none), and the oldest read an object may have (0: none).
    max_bytes: Size = 0
    max_age_s: Seconds = 0.0
    # Objects no catalogue row names (a replica died between an object and its row, a purge
    # met an upload, a deletion the bucket failed, tables of an older format) are deleted
    # once written this long ago; the bucket is looked through for them as often (0: never).
    orphan_grace_s: Seconds = 3600.0


@dataclass(frozen=True, config=_SECTION)
class TenantConfig:
    """Per X-Scope-OrgID settings; a tenant not listed gets the defaults."""

    symbolize: Flag = True
    # This tenant's [symbolize] fallback, where it differs from the global one.
    fallback: Fallback | None = None
    # Upstreams for this tenant's symbolization, instead of the global list.
    upstreams: Annotated[tuple[UpstreamConfig, ...], BeforeValidator(_servers)] = ()
    # Bearer tokens that name this tenant, for sites without a gateway that sets the header.
    tokens: Annotated[tuple[Text, ...], BeforeValidator(_tokens)] = field(
        default=(), repr=False)

    @model_validator(mode="after")
    def _servers_only(self) -> TenantConfig:
        # A local directory needs starting and stopping with the app; only [[upstreams]] get it.
        for i, u in enumerate(self.upstreams):
            if u.path is not None:
                raise _Invalid(("upstreams", i, "path"),
                               "a tenant's upstreams are servers (url); put directories in "
                               "[[upstreams]]")
        return self


@dataclass(frozen=True, config=_SECTION)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    negative: NegativeConfig = field(default_factory=NegativeConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    symbolize: SymbolizeConfig = field(default_factory=SymbolizeConfig)
    upload: UploadConfig = field(default_factory=UploadConfig)
    upstreams: tuple[UpstreamConfig, ...] = (UpstreamConfig(url=DEFAULT_UPSTREAM),)
    tenants: Mapping[str, TenantConfig] = field(default_factory=dict)
    # Unset: a single node, or replicas that share only the database.
    storage: StorageConfig | None = None

    @model_validator(mode="after")
    def _nameless_tenant_serverless(self) -> Config:
        # Requests that name no tenant are the nameless tenant's, whose scope is the shared
        # one (proxy.artifacts.scope.SHARED): what a server of its own gave would be cached
        # where every tenant sees it, and fetched under flights they join.
        if (nameless := self.tenants.get("")) is not None and nameless.upstreams:
            raise _Invalid(("tenants", "", "upstreams"),
                           "requests that name no tenant share what they fetch with every "
                           "tenant: their servers are the global [[upstreams]]")
        return self

    @model_validator(mode="after")
    def _tenants_storable(self) -> Config:
        # A tenant named by its token (as X-Scope-OrgID cannot name it) is one the scope column
        # must take: PostgreSQL refused each of its rows, and its uploads were a 503 "retry
        # later" for good.
        for name in self.tenants:
            if (why := tenant_name_fault(name)) is not None:
                raise _Invalid(("tenants",), f"tenant {shown_name(name)}: {why}")
        return self

    @model_validator(mode="after")
    def _one_tenant_per_token(self) -> Config:
        # Admins' tokens are nobody's: None, where "" is the nameless tenant's ([tenants.""]),
        # whose token listed as an admin's too was taken for the admin's.
        owner: dict[str, str | None] = dict.fromkeys(self.upload.admin_tokens, None)
        for name, tenant in self.tenants.items():
            for token in tenant.tokens:
                if (first := owner.setdefault(token, name)) != name:
                    raise _Invalid(("tenants", name, "tokens"),
                                   (f"a token of tenant {first!r}" if first is not None
                                    else "an upload.admin_tokens token") + " is listed here "
                                   "too; a token may belong to one tenant only")
        return self

    @property
    def cache_dir(self) -> Path:
        return self.cache.dir if self.cache.dir is not None else self.server.data_dir / "cache"

    @property
    def database_url(self) -> str:
        if self.database.url:
            return self.database.url
        return f"sqlite+aiosqlite:///{self.server.data_dir / 'symgate.sqlite'}"

    def with_overrides(
        self, *, listen: str | None = None, data_dir: Path | None = None
    ) -> Config:
        server = self.server
        if listen is not None:
            parse_listen(listen, "--listen")
            server = replace(server, listen=listen)
        if data_dir is not None:
            server = replace(server, data_dir=data_dir)
        return replace(self, server=server)


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "symgate"


def parse_size(value: object, key: str) -> int:
    """Bytes from an int or a string such as "20GiB" or "500 MB"."""
    try:
        return _size(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def parse_listen(value: str, key: str) -> tuple[str, int]:
    try:
        return _host_port(value)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def upstreams_from_env(value: str) -> tuple[UpstreamConfig, ...]:
    """DEBUGINFOD_URLS is a space-separated list, as elfutils' client reads it: a URL given
    again (with or without its trailing slash) is skipped, as that client skips it (a
    profile.d script that appends what is there already): each would be asked on every miss."""
    urls: dict[str, str] = {}
    try:
        for u in value.split():
            if u.startswith("ima:"):
                # elfutils 0.190's policy tags (ima:enforcing ...), which Fedora's
                # /etc/debuginfod/*.urls write: the client's to apply to what symgate relays
                # (its X-DEBUGINFOD-IMASIGNATURE), not an upstream.
                continue
            urls.setdefault(_url(u).rstrip("/"), u)
        return tuple(UpstreamConfig(url=u) for u in urls.values())
    except ValueError as e:
        raise ConfigError(f"DEBUGINFOD_URLS: {e}") from None


_REASONS = {
    "unexpected_keyword_argument": "unknown key",
    "extra_forbidden": "unknown key",
    "bool_type": "expected true or false, got {input!r}",
    "int_type": "expected a non-negative integer, got {input!r}",
    "float_type": "expected a non-negative number, got {input!r}",
    "finite_number": "expected a finite number, got {input!r}",
    "string_type": "expected a string, got {input!r}",
    "tuple_type": "expected an array, got {input!r}",
    "dataclass_type": "expected a table, got {input!r}",
    "dict_type": "expected a table, got {input!r}",
    "mapping_type": "expected a table, got {input!r}",
}


def _one_line(error: ErrorDetails) -> str:
    loc, kind, ctx = error["loc"], error["type"], error.get("ctx", {})
    if kind == "value_error":
        reason = str(ctx["error"])
        loc += getattr(ctx["error"], "loc", ())
    elif kind == "greater_than_equal":
        reason = "must not be negative" if ctx["ge"] == 0 else f"must be at least {ctx['ge']:g}"
        reason += f", got {error['input']!r}"
    elif kind == "greater_than":
        reason = f"must be more than {ctx['gt']:g}, got {error['input']!r}"
    elif kind == "less_than_equal":
        reason = f"must be at most {ctx['le']:.0f}, got {error['input']!r}"
    elif kind == "literal_error":
        expected = ctx["expected"].replace("'", '"')  # TOML's quotes, as the file has them
        reason = f"expected {expected}, got {error['input']!r}"
    elif kind in _REASONS:
        reason = _REASONS[kind].format(input=error["input"])
    else:
        reason = error["msg"]
    key = "".join(f"[{p}]" if isinstance(p, int) else f".{_toml_key(p)}" for p in loc)
    return f"{key.lstrip('.')}: {reason}"


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(part: str) -> str:
    """A key as the file spells it: quoted where TOML needs it (the nameless tenant's "")."""
    return part if _BARE_KEY.match(part) else json.dumps(part, ensure_ascii=False)


_CONFIG = TypeAdapter(Config)


def load_config(
    path: Path | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Read the TOML file at `path` (or nothing) into a Config.

    DEBUGINFOD_URLS from `environ` gives the upstream list when the file has none, and
    SYMGATE_DATABASE_URL the database when the file names none. Relative paths in the file
    are relative to its directory.
    """
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except OSError as e:
            raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from e
        except UnicodeDecodeError as e:  # TOML is UTF-8: saved as Latin-1, say
            raise ConfigError(f"{path}: not valid TOML: not UTF-8 (byte {e.start})") from None
    # A secret is better kept out of a file that a ConfigMap holds (deploy/k8s).
    # (Into a table only: a [database] that is none is for validation to name.)
    database = raw.setdefault("database", {})
    url_from_env = bool(env.get("SYMGATE_DATABASE_URL")) and isinstance(database, dict) \
        and not database.get("url")
    if url_from_env:
        database["url"] = env["SYMGATE_DATABASE_URL"]
    upstreams_from_environ = "upstreams" not in raw and bool(env.get("DEBUGINFOD_URLS", "").strip())
    if upstreams_from_environ:
        raw["upstreams"] = upstreams_from_env(env["DEBUGINFOD_URLS"])
    # Not resolved through links: a ConfigMap's file is a link into a directory that each
    # update replaces.
    config_dir = None if path is None else path.absolute().parent
    try:
        cfg = _CONFIG.validate_python(
            raw, context=None if config_dir is None else {"config_dir": config_dir})
    except ValidationError as e:
        error = e.errors()[0]
        variable = "SYMGATE_DATABASE_URL" if url_from_env and error["loc"][:2] == (
            "database", "url") else "DEBUGINFOD_URLS" if upstreams_from_environ and \
            error["loc"][:1] == ("upstreams",) else None
        if variable is None:
            raise ConfigError(_one_line(error), path) from None
        # Named by its variable, not by a key of the file that the file does not have.
        raise ConfigError(f"{variable} ({_one_line(error)})") from None
    if config_dir is not None and cfg.database.url is not None and not url_from_env:
        cfg = replace(cfg, database=replace(
            cfg.database, url=_sqlite_beside(cfg.database.url, config_dir)))
    return cfg
