"""Configuration: a TOML file parsed into typed, validated dataclasses.

Every key has a default, so an empty file (or no file) is a complete configuration.
Unknown keys and bad values raise ConfigError naming the offending key, because a typo in a
cache budget or a TTL should stop the server at start, not silently use a default.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

DEFAULT_UPSTREAM = "https://debuginfod.elfutils.org/"
DEFAULT_LISTEN = "127.0.0.1:8002"

FetchPolicy = Literal["in_order", "race"]
LogFormat = Literal["text", "json"]
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration key is unknown or has a value that cannot be used."""


@dataclass(frozen=True)
class UpstreamConfig:
    # Exactly one of url (a debuginfod server) and path (a local directory of debug files).
    url: str = ""
    path: Path | None = None
    # For a path: seconds between re-indexing walks of the directory (0: only at start).
    rescan_s: float = 60.0
    connect_timeout_s: float = 5.0
    # Until the response headers arrive: a server that accepts but never answers.
    first_byte_timeout_s: float = 30.0
    # Longest silence between two body chunks: a server that hangs mid-body.
    read_timeout_s: float = 30.0
    total_timeout_s: float = 900.0
    retries: int = 2
    retry_backoff_s: float = 0.25
    retry_backoff_max_s: float = 4.0
    max_redirects: int = 3
    breaker_failures: int = 5
    breaker_cooldown_s: float = 30.0
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ServerConfig:
    listen: str = DEFAULT_LISTEN
    data_dir: Path = field(default_factory=lambda: default_data_dir())
    # Chained caches append themselves to X-Forwarded-For; past this many hops a request is
    # answered locally, like elfutils' --forwarded-ttl-limit, so a loop cannot amplify.
    forwarded_ttl_limit: int = 8
    access_log: bool = True
    # "text" for people, "json" for one JSON object a line (access and event logs alike).
    log_format: LogFormat = "text"
    retry_after_s: int = 30
    # On SIGTERM: stop accepting, let responses under way finish for this long, then stop.
    shutdown_grace_s: float = 30.0


@dataclass(frozen=True)
class CacheConfig:
    dir: Path | None = None
    max_bytes: int = 20 * 1024**3
    # In-flight fetches at once across all clients; further misses wait for a slot.
    max_concurrent_fetches: int = 32


@dataclass(frozen=True)
class DatabaseConfig:
    url: str | None = None
    migrate_on_start: bool = True


@dataclass(frozen=True)
class NegativeConfig:
    # The first 404 is remembered briefly (some upstreams publish minutes after a first miss);
    # each repeated miss doubles the TTL up to not_found_ttl_s, elfutils' cache_miss_s default.
    not_found_initial_ttl_s: float = 60.0
    not_found_ttl_s: float = 600.0
    # How long this process trusts its in-memory copy of a SQL negative before asking SQL
    # again; bounds how stale a negative cleared by another replica can be.
    memo_s: float = 1.0


@dataclass(frozen=True)
class FetchConfig:
    policy: FetchPolicy = "in_order"


@dataclass(frozen=True)
class SymbolizeConfig:
    enabled: bool = True
    # Trees laid out like /usr/lib/debug: .build-id/xx/rest.debug (and .build-id/xx/rest for the
    # executable), searched before the upstreams: a site's own binaries.
    debug_dirs: tuple[Path, ...] = ()
    max_request_bytes: int = 32 * 1024**2
    # A gzip bomb is refused once it inflates past this, not after.
    max_decompressed_bytes: int = 256 * 1024**2
    # Distinct build IDs one request may make symgate fetch or build; more is a 422.
    max_mappings: int = 256
    # Past this, the profile is answered with what is symbolized so far; fetches go on.
    deadline_s: float = 30.0
    # Worker processes that build symbol tables.
    build_workers: int = 2


@dataclass(frozen=True)
class TenantConfig:
    """Per X-Scope-OrgID settings; a tenant not listed gets the defaults."""

    symbolize: bool = True
    # Upstream URLs for this tenant's symbolization, instead of the global list.
    upstreams: tuple[str, ...] = ()


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    negative: NegativeConfig = field(default_factory=NegativeConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    symbolize: SymbolizeConfig = field(default_factory=SymbolizeConfig)
    upstreams: tuple[UpstreamConfig, ...] = (UpstreamConfig(url=DEFAULT_UPSTREAM),)
    tenants: Mapping[str, TenantConfig] = field(default_factory=dict)

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


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: object, key: str) -> int:
    """Bytes from an int or a string such as "20GiB" or "500 MB"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key}: must not be negative")
        return value
    if isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = (m.group(2) or "b").lower()
        return int(float(m.group(1)) * _SIZE_UNITS[unit])
    raise ConfigError(f"{key}: expected a size such as 20GiB, got {value!r}")


def parse_listen(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise ConfigError(f"{key}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def upstreams_from_env(value: str) -> tuple[UpstreamConfig, ...]:
    """DEBUGINFOD_URLS is a space-separated list, as elfutils' client reads it."""
    return tuple(UpstreamConfig(url=_check_url(u, "DEBUGINFOD_URLS")) for u in value.split())


def _check_url(url: object, key: str) -> str:
    if not isinstance(url, str) or not re.match(r"^https?://[^/\s]+", url):
        raise ConfigError(f"{key}: expected an http:// or https:// URL, got {url!r}")
    return url


def _coerce(value: object, annotation: str, key: str) -> Any:
    """Check one scalar against its dataclass annotation (annotations are strings here)."""
    if annotation == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if annotation == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{key}: expected a non-negative integer, got {value!r}")
        return value
    if annotation == "float":
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{key}: expected a non-negative number, got {value!r}")
        return float(value)
    if annotation == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if annotation in ("Path", "Path | None"):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: expected a path, got {value!r}")
        return Path(value).expanduser()
    if annotation == "str | None":
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value or None
    if annotation == "LogFormat":
        if value not in ("text", "json"):
            raise ConfigError(f"{key}: expected \"text\" or \"json\", got {value!r}")
        return value
    if annotation == "FetchPolicy":
        if value not in ("in_order", "race"):
            raise ConfigError(f"{key}: expected \"in_order\" or \"race\", got {value!r}")
        return value
    if annotation in ("tuple[Path, ...]", "tuple[str, ...]"):
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{key}: expected an array of strings")
        if annotation == "tuple[Path, ...]":
            return tuple(Path(v).expanduser() for v in value)
        return tuple(_check_url(v, key) for v in value)
    if annotation == "Mapping[str, str]":
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError(f"{key}: expected a table of string values")
        return dict(value)
    raise AssertionError(f"no coercion for {annotation}")  # a new field needs a case above


_SIZE_KEYS = {"max_bytes", "max_request_bytes", "max_decompressed_bytes"}


def _build(cls: type[T], table: object, prefix: str, **fixed: Any) -> T:
    if not isinstance(table, dict):
        raise ConfigError(f"{prefix}: expected a table")
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = dict(fixed)
    for name, value in table.items():
        key = f"{prefix}.{name}"
        if name not in known or name in fixed:
            raise ConfigError(f"{key}: unknown key")
        if name in _SIZE_KEYS:
            kwargs[name] = parse_size(value, key)
        else:
            kwargs[name] = _coerce(value, str(known[name].type), key)
    return cls(**kwargs)


def _upstream(table: object, index: int) -> UpstreamConfig:
    prefix = f"upstreams[{index}]"
    if not isinstance(table, dict) or ("url" in table) == ("path" in table):
        raise ConfigError(f"{prefix}.url: required (or path, for a local directory; not both)")
    if "path" in table:
        return _build(UpstreamConfig, table, prefix)
    rest = {k: v for k, v in table.items() if k != "url"}
    return _build(UpstreamConfig, rest, prefix, url=_check_url(table["url"], f"{prefix}.url"))


def load_config(
    path: Path | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Read the TOML file at `path` (or nothing) into a Config.

    DEBUGINFOD_URLS from `environ` gives the upstream list when the file has none.
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
    sections: dict[str, type[Any]] = {
        "server": ServerConfig, "cache": CacheConfig, "database": DatabaseConfig,
        "negative": NegativeConfig, "fetch": FetchConfig, "symbolize": SymbolizeConfig,
    }
    for name in raw:
        if name not in sections and name not in ("upstreams", "tenants"):
            raise ConfigError(f"{name}: unknown key")
    built = {name: _build(cls, raw.get(name, {}), name) for name, cls in sections.items()}
    if "upstreams" in raw:
        if not isinstance(raw["upstreams"], list):
            raise ConfigError("upstreams: expected an array of tables ([[upstreams]])")
        upstreams = tuple(_upstream(t, i) for i, t in enumerate(raw["upstreams"]))
    elif env.get("DEBUGINFOD_URLS", "").strip():
        upstreams = upstreams_from_env(env["DEBUGINFOD_URLS"])
    else:
        upstreams = Config().upstreams
    parse_listen(built["server"].listen, "server.listen")
    negative: NegativeConfig = built["negative"]
    if negative.not_found_initial_ttl_s > negative.not_found_ttl_s:
        raise ConfigError("negative.not_found_initial_ttl_s: must not exceed not_found_ttl_s")
    if built["cache"].max_concurrent_fetches < 1:
        raise ConfigError("cache.max_concurrent_fetches: must be at least 1")
    if built["symbolize"].build_workers < 1:
        raise ConfigError("symbolize.build_workers: must be at least 1")
    tenants_raw = raw.get("tenants", {})
    if not isinstance(tenants_raw, dict):
        raise ConfigError("tenants: expected a table of [tenants.NAME] tables")
    tenants = {name: _build(TenantConfig, t, f"tenants.{name}")
               for name, t in tenants_raw.items()}
    return Config(upstreams=upstreams, tenants=tenants, **built)
