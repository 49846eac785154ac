"""Configuration: TOML to typed dataclasses, with errors that name the key."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import tomllib
from pathlib import Path

import pytest

from proxy.config import (
    DEFAULT_UPSTREAM,
    MAX_PROCESSES,
    Config,
    ConfigError,
    TenantConfig,
    UpstreamConfig,
    load_config,
    parse_size,
)

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "symgate.toml"
    path.write_text(text)
    return path


def test_no_file_gives_the_embedded_defaults() -> None:
    cfg = load_config(None, environ={})
    assert cfg.server.listen == "127.0.0.1:8002"
    assert [u.url for u in cfg.upstreams] == [DEFAULT_UPSTREAM]
    assert cfg.database_url.startswith("sqlite+aiosqlite:///")
    assert cfg.database_url.endswith("symgate/symgate.sqlite")
    assert cfg.cache_dir == cfg.server.data_dir / "cache"


def test_debuginfod_urls_is_the_upstream_list_when_the_file_has_none(tmp_path: Path) -> None:
    env = {"DEBUGINFOD_URLS": "http://a.example:8002  https://b.example/"}
    cfg = load_config(write(tmp_path, "[server]\nlisten = '0.0.0.0:9000'\n"), environ=env)
    assert [u.url for u in cfg.upstreams] == ["http://a.example:8002", "https://b.example/"]
    cfg = load_config(write(tmp_path, "[[upstreams]]\nurl = 'http://c.example'\n"), environ=env)
    assert [u.url for u in cfg.upstreams] == ["http://c.example"]


def test_debuginfod_urls_ima_policy_tags_are_no_upstreams() -> None:
    # debuginfod-client-config(7): policy tags for the client's IMA checks, read left to right.
    env = {"DEBUGINFOD_URLS": "https://foo.example ima:enforcing https://bar.example "
                              "ima:ignore https://baz.example"}
    cfg = load_config(None, environ=env)
    assert [u.url for u in cfg.upstreams] == ["https://foo.example", "https://bar.example",
                                              "https://baz.example"]


def test_debuginfod_urls_given_twice_are_one_upstream() -> None:
    # As elfutils' client reads the list: each would otherwise be asked again on every miss.
    env = {"DEBUGINFOD_URLS": " http://a.example:8002/\thttp://b.example http://a.example:8002"
                              "  http://a.example:8002// http://b.example/x"}
    cfg = load_config(None, environ=env)
    assert [u.url for u in cfg.upstreams] == ["http://a.example:8002/", "http://b.example",
                                              "http://b.example/x"]


def test_an_upper_case_scheme_is_an_upstream_as_elfutils_client_takes_it(tmp_path: Path) -> None:
    # It was refused ("expected an http:// or https:// URL"): a site's DEBUGINFOD_URLS that
    # works for debuginfod-find stopped symgate's start. Written lower-case, as the rest of
    # symgate compares schemes (a redirect from https, the bucket's plain http).
    env = {"DEBUGINFOD_URLS": "HTTP://a.example:8002 Https://b.example/ http://a.example:8002"}
    cfg = load_config(None, environ=env)
    assert [u.url for u in cfg.upstreams] == ["http://a.example:8002", "https://b.example/"]
    toml = tmp_path / "c.toml"
    toml.write_text('[[upstreams]]\nurl = "HTTPS://c.example/"\n')
    assert [u.url for u in load_config(toml, environ={}).upstreams] == ["https://c.example/"]


def test_the_example_file_parses_to_the_defaults_and_documents_every_key() -> None:
    example = ROOT / "config.example.toml"
    cfg = load_config(example, environ={})
    defaults = Config()
    assert cfg.cache == defaults.cache and cfg.negative == defaults.negative
    assert cfg.fetch == defaults.fetch and cfg.database == defaults.database
    assert cfg.symbolize == defaults.symbolize
    assert cfg.upstreams == defaults.upstreams
    text = example.read_text()
    raw = tomllib.loads(text)
    for section in ("server", "cache", "database", "negative", "fetch", "symbolize"):
        cls = type(getattr(defaults, section))
        for f in dataclasses.fields(cls):
            assert f"\n{f.name} =" in text or f"\n# {f.name} =" in text, (section, f.name)
    for f in dataclasses.fields(UpstreamConfig):
        assert f"# {f.name} =" in text, f.name
    for f in dataclasses.fields(TenantConfig):
        assert f"# {f.name} =" in text, f.name
    # Copied as it is, the file leaves the environment's say: an [[upstreams]] table in it
    # sent every miss to the public server whatever DEBUGINFOD_URLS named, and a data_dir
    # put the data in ~/.local/share whatever XDG_DATA_HOME named.
    assert "upstreams" not in raw and "data_dir" not in raw["server"]
    cfg = load_config(example, environ={"DEBUGINFOD_URLS": "http://a.example:8002"})
    assert [u.url for u in cfg.upstreams] == ["http://a.example:8002"]


@pytest.mark.parametrize(("text", "message"), [
    ("[server]\nlisten = 'nowhere'\n", "server.listen: expected HOST:PORT"),
    ("[server]\nlsiten = '127.0.0.1:1'\n", "server.lsiten: unknown key"),
    ("[cahce]\n", "cahce: unknown key"),
    ("[cache]\nmax_bytes = 'lots'\n", "cache.max_bytes: expected a size"),
    ("[cache]\nmax_bytes = -1\n", "cache.max_bytes: must not be negative"),
    ("[cache]\nmax_concurrent_fetches = 0\n", "cache.max_concurrent_fetches: must be at least 1"),
    ("[negative]\nnot_found_ttl_s = 'ten'\n", "negative.not_found_ttl_s: expected a non-negative"),
    ("[negative]\nnot_found_initial_ttl_s = 900\n", "not_found_initial_ttl_s: must not exceed"),
    ("[fetch]\npolicy = 'random'\n", 'fetch.policy: expected "in_order" or "race"'),
    ("[server]\naccess_log = 'yes'\n", "server.access_log: expected true or false"),
    ("[[upstreams]]\nurl = 'ftp://x'\n", "upstreams[0].url: expected an http"),
    ("[[upstreams]]\nurl = 'http://x'\n[[upstreams]]\nretries = 1\n", "upstreams[1].url: required"),
    ("[[upstreams]]\nurl = 'http://x'\npath = '/srv'\n", "upstreams[0].url: required .or path"),
    ("[[upstreams]]\npath = 3\n", "upstreams[0].path: expected a path"),
    ("[[upstreams]]\nurl = 'http://x'\ntimeout = 3\n", "upstreams[0].timeout: unknown key"),
    ("[[upstreams]]\nurl = 'http://x'\nheaders = { A = 1 }\n", "upstreams[0].headers: expected"),
    ("upstreams = 'http://x'\n", "upstreams: expected an array"),
    ("[symbolize]\ndebug_dirs = '/usr/lib/debug'\n", "symbolize.debug_dirs: expected an array"),
    ("[tenants.a]\nsymbolise = false\n", "tenants.a.symbolise: unknown key"),
    ("[tenants.a]\nupstreams = ['ftp://x']\n", "tenants.a.upstreams: expected an http"),
    ("tenants = 3\n", "tenants: expected a table"),
    ("[server]\naccess_flush_s = 0\n", "server.access_flush_s: must be more than 0"),
    ("[server]\naccess_flush_s = 'soon'\n", "server.access_flush_s: expected a non-negative"),
    ("[negative]\nsweep_s = 0\n", "negative.sweep_s: must be more than 0"),
    ("[negative]\nmemo_entries = 0\n", "negative.memo_entries: must be at least 1"),
    ("[negative]\nmemo_entries = 1.5\n", "negative.memo_entries: expected a non-negative integer"),
    ("[negative]\nmemo_s = nan\n", "negative.memo_s: expected a finite number"),
    ("[symbolize]\nopen_tables = 0\n", "symbolize.open_tables: must be at least 1"),
    ("[symbolize]\nno_symbols_retry_s = -1\n", "symbolize.no_symbols_retry_s: must not be neg"),
    ("[symbolize]\nmalformed_retry_s = true\n", "symbolize.malformed_retry_s: expected a non-neg"),
    ("[tenants.a]\ntokens = 'abcdefghijklmnopq'\n", "tenants.a.tokens: expected an array"),
    ("[tenants.a]\ntokens = ['']\n", "tenants.a.tokens: expected strings of at least 16"),
    ("[tenants.a]\ntokens = ['short']\n", "tenants.a.tokens: .* token 0 is 5 characters"),
    ("[tenants.a]\ntokens = [16]\n", "tenants.a.tokens: expected strings"),
    ("[tenants.a]\nupstreams = 'http://x'\n", "tenants.a.upstreams: expected an array"),
    ("[tenants.a]\nupstreams = [3]\n", "tenants.a.upstreams[0]: expected a table"),
    ("[[tenants.a.upstreams]]\nurl = 'http://x'\ntimeout = 3\n",
     "tenants.a.upstreams[0].timeout: unknown key"),
    ("[[tenants.a.upstreams]]\nurl = 'ftp://x'\n", "tenants.a.upstreams[0].url: expected an http"),
    ("[[tenants.a.upstreams]]\nretries = 1\n", "tenants.a.upstreams[0].url: required"),
    ("[[tenants.a.upstreams]]\npath = '/srv'\n", "tenants.a.upstreams[0].path: a tenant's"),
    # Past the scope column (or a NUL, which PostgreSQL's text does not hold), PostgreSQL
    # refused every row of a tenant its token names, and its uploads were a 503 for good.
    ('[tenants."' + "t" * 256 + '"]\ntokens = ["a-token-long-enough-1234"]\n',
     'tenants: tenant "' + "t" * 40 + '...": 256 characters, more than 255$'),
    ('[tenants."a\\u0000b"]\n', 'tenants: tenant "a\\\\u0000b": a NUL character$'),
    ("[server\n", "not valid TOML"),
    # Past what a datetime or a thread's wait holds: every miss was a 500 (its expiry overflowed).
    ("[negative]\nnot_found_initial_ttl_s = 1e12\nnot_found_ttl_s = 1e12\n",
     "negative.not_found_initial_ttl_s: must be at most 1000000000, got 1000000000000.0$"),
    ("[symbolize]\nmalformed_retry_s = 1e300\n", "symbolize.malformed_retry_s: must be at most"),
    ("[server]\nshutdown_grace_s = 10000000000\n", "server.shutdown_grace_s: must be at most"),
    ("[negative]\nsweep_s = 1e10\n", "negative.sweep_s: must be at most"),
    ("[[upstreams]]\nurl = 'http://x'\ntotal_timeout_s = 1e10\n",
     "upstreams[0].total_timeout_s: must be at most"),
    # Past what C holds a size in: every gzipped profile was a 500 (zlib's max_length).
    ("[symbolize]\nmax_decompressed_bytes = '100000000TiB'\n",
     "symbolize.max_decompressed_bytes: must be at most 4611686018427387904 bytes"),
    ("[cache]\nmax_bytes = 4611686018427387905\n", "cache.max_bytes: must be at most"),
    # So many digits that the float is inf: int() of it was a traceback.
    pytest.param(f"[upload]\nmax_file_bytes = '1{'0' * 400}.5KiB'\n",
                 "upload.max_file_bytes: must be at", id="a size of 400 digits"),
])
def test_bad_values_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(write(tmp_path, text), environ={})


def test_the_longest_duration_fits_what_holds_it() -> None:
    import threading
    from datetime import UTC, datetime, timedelta

    from proxy.config import MAX_SECONDS

    # An expiry a miss's row holds, a cutoff a sweep reads, a thread's wait.
    assert datetime.now(UTC) + timedelta(seconds=MAX_SECONDS) > datetime.now(UTC)
    assert datetime.now(UTC) - timedelta(seconds=MAX_SECONDS) < datetime.now(UTC)
    assert MAX_SECONDS <= threading.TIMEOUT_MAX


def test_the_largest_size_fits_what_holds_it(tmp_path: Path) -> None:
    import zlib

    from proxy.config import MAX_BYTES

    cfg = load_config(write(tmp_path, f"[symbolize]\nmax_decompressed_bytes = {MAX_BYTES}\n"),
                      environ={})
    # A profile's inflating asks for one byte past its bound (symbolize.pprof.codec).
    zlib.decompressobj().decompress(b"", cfg.symbolize.max_decompressed_bytes + 1)


_UPSTREAM = "[[upstreams]]\nurl = 'http://x'"


@pytest.mark.parametrize(("table", "key", "most"), [
    ("[server]", "workers", MAX_PROCESSES),
    ("[server]", "retry_after_s", 3600),
    ("[symbolize]", "workers", MAX_PROCESSES),
    ("[symbolize]", "build_workers", MAX_PROCESSES),
    (_UPSTREAM, "retries", 10),
    (_UPSTREAM, "retry_backoff_s", 60),
    (_UPSTREAM, "retry_backoff_max_s", 60),
    (_UPSTREAM, "max_redirects", 20),
    ("[[tenants.a.upstreams]]\nurl = 'http://x'", "retries", 10),
])
def test_counts_and_waits_past_what_is_sane_are_refused(
    tmp_path: Path, table: str, key: str, most: int
) -> None:
    """They had no upper bound: `workers = 100000` forked until the machine ran out, and
    `retries = 1000000` (or a backoff of a year) held a client's request for ever."""
    load_config(write(tmp_path, f"{table}\n{key} = {most}\n"), environ={})  # the bound is fine
    name = {"[server]": "server", "[symbolize]": "symbolize", _UPSTREAM: "upstreams[0]"}.get(
        table, "tenants.a.upstreams[0]")
    for value in (most + 1, 1_000_000):
        with pytest.raises(ConfigError) as e:
            load_config(write(tmp_path, f"{table}\n{key} = {value}\n"), environ={})
        assert str(e.value) == f"{name}.{key}: must be at most {most}, got {value}"


@pytest.mark.parametrize("text", ["database = 3\n", "database = 'postgresql'\n",
                                  "database = []\n"])
def test_a_database_that_is_no_table_is_named_with_the_url_in_the_environment(
    tmp_path: Path, text: str
) -> None:
    # SYMGATE_DATABASE_URL was merged into it as into a table: an AttributeError traceback.
    with pytest.raises(ConfigError, match=r"^database: expected a table"):
        load_config(write(tmp_path, text),
                    environ={"SYMGATE_DATABASE_URL": "sqlite+aiosqlite:////tmp/x.sqlite"})


@pytest.mark.parametrize(("text", "message"), [
    ('headers = { Authorization = "Bearer sesame-secret\\r\\nX-Evil: 1" }\n',
     "upstreams[0].headers: the value of Authorization has a control character"),
    ('headers = { Authorization = "Bearer sesame-secret\\n" }\n',
     "upstreams[0].headers: the value of Authorization has a control character"),
    ('headers = { "X Api" = "sesame-secret" }\n',
     "upstreams[0].headers: 'X Api' is not a header name"),
    ('headers = { "X-Api:" = "sesame-secret" }\n',
     "upstreams[0].headers: 'X-Api:' is not a header name"),
])
def test_headers_no_request_can_carry_are_refused_at_start(
    tmp_path: Path, text: str, message: str
) -> None:
    """Accepted, they made aiohttp refuse every request to the upstream: each miss a 500 with
    a traceback, the server started as if fine."""
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f"[[upstreams]]\nurl = 'http://x'\n{text}"), environ={})
    assert str(e.value).startswith(message)
    assert "sesame" not in str(e.value)  # a credential is never shown


@pytest.mark.parametrize("url", ["http://u:sesame@127.0.0.1:99999/", "http://u:sesame@h:abc/",
                                 "http://[::1/", "https://u:sesame@[::1]x/"])
def test_an_upstream_url_no_request_can_go_to_is_refused_at_start(
    tmp_path: Path, url: str
) -> None:
    """A URL of the right shape that yarl cannot read (a port past 65535, a port that is no
    number, an IPv6 address unclosed) started, then failed the start with a ValueError
    traceback (or inspect's), naming no key."""
    with pytest.raises(ConfigError, match=r"^upstreams\[0\]\.url: ") as e:
        load_config(write(tmp_path, f"[[upstreams]]\nurl = '{url}'\n"), environ={})
    assert "sesame" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^tenants\.a\.upstreams: "):
        load_config(write(tmp_path, f"[tenants.a]\nupstreams = ['{url}']\n"), environ={})


@pytest.mark.parametrize("url", ["postgresql+asyncpg://u:sesame@127.0.0.1:abc/db",
                                 "postgresql+asyncpg://u:sesame@[::1/db"])
def test_a_database_url_whose_port_cannot_be_read_is_named(tmp_path: Path, url: str) -> None:
    """Every command (serve, db, cache) ended in a ValueError traceback from SQLAlchemy's
    URL parser, naming no key. From the environment, it is named by its variable: the key
    alone sent the operator to a file that has none."""
    with pytest.raises(ConfigError, match=r"^database\.url: ") as e:
        load_config(write(tmp_path, f"[database]\nurl = '{url}'\n"), environ={})
    assert "sesame" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^SYMGATE_DATABASE_URL \(database\.url: ") as e:
        load_config(write(tmp_path, "[server]\n"), environ={"SYMGATE_DATABASE_URL": url})
    assert "sesame" not in str(e.value) and e.value.file is None


def test_credentials_in_the_buckets_endpoint_are_refused_unshown(tmp_path: Path) -> None:
    """They were not used (credentials come from AWS_* in the environment) and the start-up
    line "shared bucket ... at ENDPOINT" logged them."""
    text = "[storage]\nurl = 's3://bucket'\nendpoint = 'http://minio:sesame-key@minio:9000'\n"
    with pytest.raises(ConfigError, match=r"^storage\.endpoint: .*AWS_ACCESS_KEY_ID") as e:
        load_config(write(tmp_path, text), environ={})
    assert "sesame" not in str(e.value)


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    """A config saved as Latin-1 (an accented letter in a comment) ended every command in a
    UnicodeDecodeError traceback; TOML is UTF-8."""
    path = tmp_path / "symgate.toml"
    path.write_bytes(b"# caf\xe9\n[server]\n")
    with pytest.raises(ConfigError, match=r"symgate\.toml: not valid TOML: not UTF-8"):
        load_config(path, environ={})


@pytest.mark.parametrize("listen", ["[]:8002", "[::1:8002", "[[::1]:8002", "[::1]]:8002",
                                    "host]:8002", "::1:8002", "127.0.0.1:\u0663",
                                    "127.0.0.1:00000000000008002"])
def test_a_listen_address_that_is_malformed_is_refused(tmp_path: Path, listen: str) -> None:
    """They were read leniently: "[]:8002" bound every address of the host, IPv4 and IPv6
    (a server meant for one interface open to all), unbalanced brackets and an unbracketed
    IPv6 address were guessed at, and a port in other digits than ASCII's was taken."""
    with pytest.raises(ConfigError, match=r"^server\.listen: expected HOST:PORT"):
        load_config(write(tmp_path, f"[server]\nlisten = '{listen}'\n"), environ={})


@pytest.mark.parametrize(("listen", "parsed"), [
    ("[::1]:8002", ("::1", 8002)), ("[::]:0", ("::", 0)), ("0.0.0.0:80", ("0.0.0.0", 80)),
    ("symgate.internal:8002", ("symgate.internal", 8002)),
    ("[fe80::1%eth0]:8002", ("fe80::1%eth0", 8002))])
def test_listen_addresses(listen: str, parsed: tuple[str, int]) -> None:
    from proxy.config import parse_listen

    assert parse_listen(listen, "k") == parsed


def test_new_keys_default_to_the_constants_they_replace() -> None:
    cfg = load_config(None, environ={})
    assert cfg.server.access_flush_s == 5.0
    assert cfg.negative.sweep_s == 300.0 and cfg.negative.memo_entries == 100_000
    assert cfg.symbolize.open_tables == 512
    assert cfg.symbolize.no_symbols_retry_s == 600.0
    assert cfg.symbolize.malformed_retry_s == 86400.0
    assert TenantConfig().tokens == () and TenantConfig().upstreams == ()


def test_new_keys_take_values(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, """
[server]
access_flush_s = 1
[negative]
sweep_s = 60.5
memo_entries = 1
[symbolize]
open_tables = 1
no_symbols_retry_s = 0
malformed_retry_s = 3600
"""), environ={})
    assert cfg.server.access_flush_s == 1.0 and isinstance(cfg.server.access_flush_s, float)
    assert (cfg.negative.sweep_s, cfg.negative.memo_entries) == (60.5, 1)
    assert cfg.symbolize.open_tables == 1
    assert (cfg.symbolize.no_symbols_retry_s, cfg.symbolize.malformed_retry_s) == (0.0, 3600.0)


def test_tenant_upstreams_are_urls_or_tables(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, """
[tenants.plain]
upstreams = ["https://a.example/", { url = "http://b.example", retries = 0 }]
[tenants.acme]
symbolize = true
[[tenants.acme.upstreams]]
url = "https://debuginfod.acme.internal"
headers = { Authorization = "Bearer sesame" }
"""), environ={})
    plain, acme = cfg.tenants["plain"].upstreams, cfg.tenants["acme"].upstreams
    assert plain == (UpstreamConfig(url="https://a.example/"),
                     UpstreamConfig(url="http://b.example", retries=0))
    assert acme == (UpstreamConfig(url="https://debuginfod.acme.internal",
                                   headers={"Authorization": "Bearer sesame"}),)
    # Built in code, a bare URL still stands for an upstream with only that url.
    built = TenantConfig(upstreams=("https://a.example/",))  # type: ignore[arg-type]
    assert built.upstreams == plain[:1]


def test_tokens_name_one_tenant_each(tmp_path: Path) -> None:
    token, other, third = "t" * 16, "u" * 40, "v" * 20
    cfg = load_config(write(tmp_path, f"""
[tenants.a]
tokens = ["{token}", "{other}"]
[tenants.b]
tokens = ["{third}"]
"""), environ={})
    assert cfg.tenants["a"].tokens == (token, other)
    assert token not in repr(cfg)  # a logged config does not give the secrets away
    shared = f'[tenants.a]\ntokens = ["{token}"]\n[tenants.b]\ntokens = ["{other}", "{token}"]\n'
    with pytest.raises(ConfigError, match=r"^tenants\.b\.tokens: a token of tenant 'a'") as e:
        load_config(write(tmp_path, shared), environ={})
    assert token not in str(e.value)
    with pytest.raises(ValueError, match="a token of tenant 'a'"):  # built in code, too
        Config(tenants={"a": TenantConfig(tokens=(token,)), "b": TenantConfig(tokens=(token,))})
    # The nameless tenant's name is "": its token listed as an admin's too was taken for the
    # admin's (it uploaded), where another tenant's was refused.
    both = f'[upload]\nadmin_tokens = ["{token}"]\n[tenants.""]\ntokens = ["{token}"]\n'
    with pytest.raises(ConfigError, match=r'^tenants\.""\.tokens: an upload\.admin_tokens token'):
        load_config(write(tmp_path, both), environ={})


def test_the_nameless_tenant_has_no_servers_of_its_own(tmp_path: Path) -> None:
    """Requests that name no tenant are [tenants.""]'s, whose scope is the shared one: a
    private server there (with its credentials) had its files cached where every tenant saw
    them. Its tokens and settings stay; its servers are the global list."""
    text = '[tenants.""]\nupstreams = [{ url = "https://p.example", headers = { A = "b" } }]\n'
    with pytest.raises(ConfigError, match=r'^tenants\.""\.upstreams: requests that name'):
        load_config(write(tmp_path, text), environ={})
    with pytest.raises(ValueError, match="the global"):  # built in code, too
        Config(tenants={"": TenantConfig(upstreams=(UpstreamConfig(url="http://p"),))})
    cfg = load_config(write(tmp_path, f'[tenants.""]\ntokens = ["{"t" * 16}"]\n'), environ={})
    assert cfg.tenants[""].tokens == ("t" * 16,)


def test_the_tenant_examples_parse(tmp_path: Path) -> None:
    text = (ROOT / "config.example.toml").read_text()
    section = text[text.index("# Per-tenant settings"):text.index("# Upstream debuginfod")]
    toml = "\n".join(line[2:] for line in section.splitlines()
                     if line.startswith(("# [", "# tokens", "# upstreams", "# symbolize",
                                          "# url", "# headers")))
    cfg = load_config(write(tmp_path, toml), environ={})
    assert set(cfg.tenants) == {"team-a", "team-b", "acme"}
    assert cfg.tenants["acme"].upstreams[0].headers == {"Authorization": "Bearer TOKEN"}
    assert len(cfg.tenants["team-b"].tokens) == 1


def test_constructed_sections_stay_dataclasses() -> None:
    up = UpstreamConfig(url="http://x", connect_timeout_s=2)
    assert dataclasses.replace(up, retries=0).retries == 0
    assert [f.name for f in dataclasses.fields(up)][:2] == ["url", "path"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        up.retries = 9  # type: ignore[misc]


def test_sizes() -> None:
    assert parse_size("20GiB", "k") == 20 * 2**30
    assert parse_size("500 MB", "k") == 500 * 10**6
    assert parse_size(1234, "k") == 1234
    assert parse_size("1.5KiB", "k") == 1536


def test_flags_override_the_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "[server]\nlisten = '127.0.0.1:1'\n"), environ={})
    cfg = cfg.with_overrides(listen="[::1]:9", data_dir=tmp_path / "d")
    assert cfg.server.listen == "[::1]:9" and cfg.server.data_dir == tmp_path / "d"
    with pytest.raises(ConfigError, match="--listen"):
        cfg.with_overrides(listen="9")


def _symgate(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["symgate", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd)


@pytest.mark.parametrize(("text", "problem"), [
    ("[cache]\nmax_bytes = 'x'\n", "cache.max_bytes: expected a size such as 20GiB, got 'x'"),
    ("[server\n", "not valid TOML: Expected ']' at the end of a table declaration"),
    ("[server]\nworkers = 100000\n", f"server.workers: must be at most {MAX_PROCESSES}, got"),
    # No path the system can open: a traceback and status 1, as for a fault of the program.
    ("[server]\ndata_dir = '~no-such-user-of-symgate/data'\n",
     "server.data_dir: no such user: '~no-such-user-of-symgate'"),
    ('[symbolize]\ndebug_dirs = ["/usr/lib/debug\\u0000x"]\n',
     "symbolize.debug_dirs[0]: a path holds no NUL character, got '/usr/lib/debug\\x00x'"),
])
def test_a_bad_config_file_exits_ex_config_in_one_line(
    tmp_path: Path, text: str, problem: str
) -> None:
    """It exited 2, argparse's status for a misused command line: a service manager told not
    to restart on EX_CONFIG (systemd's RestartPreventExitStatus=78) restarted it in a loop."""
    config = write(tmp_path, text)
    for command in (["serve", "--listen", "127.0.0.1:1"], ["db", "current"]):
        result = _symgate(*command, "--config", str(config))
        assert result.returncode == 78, result
        assert result.stderr.startswith(f"symgate: configuration error: {config}: {problem}")
        assert result.stderr.count("\n") == 1, result.stderr
    missing = _symgate("serve", "--config", str(tmp_path / "none.toml"))
    assert missing.returncode == 78
    assert missing.stderr == (f"symgate: configuration error: {tmp_path / 'none.toml'}: "
                              "cannot read: No such file or directory\n")


@pytest.mark.parametrize("args", [["--listen", "9"], ["--workers", "0"],
                                  ["--workers", str(MAX_PROCESSES + 1)], ["--lisen", "x:1"]])
def test_a_bad_command_line_is_still_a_usage_error(tmp_path: Path, args: list[str]) -> None:
    result = _symgate("serve", "--data-dir", str(tmp_path / "d"), *args)
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr and "usage: symgate" in result.stderr
    assert not (tmp_path / "d").exists()


def test_more_serving_processes_than_the_bound_are_refused_on_the_command_line(
    tmp_path: Path
) -> None:
    """`symgate serve --workers 100000` forked until the machine ran out."""
    result = _symgate("serve", "--data-dir", str(tmp_path / "d"), "--workers", "100000")
    assert result.returncode == 2
    assert f"--workers: at most {MAX_PROCESSES}, got 100000" in result.stderr


def test_relative_paths_in_the_file_are_the_files_directorys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They were the working directory's: `symgate serve --config /etc/symgate/symgate.toml`
    used other directories (an empty cache, another database) wherever it was started."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "symgate.toml").write_text("""
[server]
data_dir = "data"
[cache]
dir = "../cache"
[database]
url = "sqlite+aiosqlite:///db/symgate.sqlite"
[symbolize]
debug_dirs = ["debug", "/usr/lib/debug", "~/debug"]
[[upstreams]]
path = "srv"
""")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    for given in (etc / "symgate.toml", Path("../etc/symgate.toml")):
        cfg = load_config(given, environ={})
        assert cfg.server.data_dir.resolve() == etc / "data"
        assert cfg.cache_dir.resolve() == tmp_path / "cache"
        assert Path(cfg.database_url.removeprefix("sqlite+aiosqlite:///")).resolve() \
            == etc / "db" / "symgate.sqlite"
        assert [d.resolve() for d in cfg.symbolize.debug_dirs] == [
            etc / "debug", Path("/usr/lib/debug"), Path("~/debug").expanduser().resolve()]
        assert cfg.upstreams[0].path is not None
        assert cfg.upstreams[0].path.resolve() == etc / "srv"
    # What is not in the file stays as it was: the environment's and the command line's.
    env = {"SYMGATE_DATABASE_URL": "sqlite+aiosqlite:///rel.sqlite"}
    cfg = load_config(write(etc, "[server]\nlisten = '127.0.0.1:1'\n"), environ=env)
    assert cfg.database_url == "sqlite+aiosqlite:///rel.sqlite"
    assert cfg.with_overrides(data_dir=Path("d")).server.data_dir == Path("d")
    for url in ("sqlite+aiosqlite:///:memory:", "postgresql+asyncpg://u@db/symgate"):
        cfg = load_config(write(etc, f"[database]\nurl = '{url}'\n"), environ={})
        assert cfg.database_url == url


def test_the_server_finds_its_data_beside_its_config_from_any_directory(
    tmp_path: Path
) -> None:
    """The real command, started elsewhere: the database is made where the file says."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "symgate.toml").write_text("upstreams = []\n[server]\ndata_dir = 'data'\n")
    (tmp_path / "elsewhere").mkdir()
    result = _symgate("db", "upgrade", "--config", "../etc/symgate.toml",
                      cwd=tmp_path / "elsewhere")
    assert result.returncode == 0, result
    assert (etc / "data" / "symgate.sqlite").is_file()
    assert not (tmp_path / "elsewhere" / "data").exists()
    # A directory on the command line is the working directory's, as any argument is.
    result = _symgate("db", "upgrade", "--config", "../etc/symgate.toml", "--data-dir", "d",
                      cwd=tmp_path / "elsewhere")
    assert result.returncode == 0, result
    assert (tmp_path / "elsewhere" / "d" / "symgate.sqlite").is_file()


def test_profile_workers_default_to_the_cores_this_process_may_run_on() -> None:
    # As server.workers does: a container or a unit pinned to one core (a cpuset, taskset)
    # got two profile workers from the machine's count, contending for that one core.
    if os.cpu_count() == 1:
        pytest.skip("needs a machine of more than one core")
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        assert load_config(None, environ={}).symbolize.workers == 1
    finally:
        os.sched_setaffinity(0, allowed)
