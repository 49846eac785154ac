"""Configuration: TOML to typed dataclasses, with errors that name the key."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from proxy.config import (
    DEFAULT_UPSTREAM,
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
    for f in dataclasses.fields(UpstreamConfig):  # path excludes url: shown commented out
        assert f.name in raw["upstreams"][0] or f"# {f.name} =" in text, f.name
    for f in dataclasses.fields(TenantConfig):
        assert f"# {f.name} =" in text, f.name


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
    ("[server\n", "not valid TOML"),
])
def test_bad_values_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(write(tmp_path, text), environ={})


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


def test_cli_reports_config_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from proxy.tools.cli import main

    rc = main(["serve", "--config", str(write(tmp_path, "[cache]\nmax_bytes = 'x'\n"))])
    assert rc == 2
    assert "configuration error: cache.max_bytes" in capsys.readouterr().err
