"""Start-up and command-line faults a new user meets end in one clear line and a non-zero exit,
never a traceback (issue 11, item 17)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.harness import free_port


def _run(tmp_path: Path, *args: str, config: str = "") -> tuple[int, list[str]]:
    """Run the real `symgate` command; its exit code and its non-empty output lines."""
    conf = tmp_path / "symgate.toml"
    conf.write_text(config)
    cmd = ["symgate", *args]
    if args[0] in ("serve", "db", "cache"):
        cmd += ["--config", str(conf)]
    env = {**os.environ, "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "xdg"),
           "DEBUGINFOD_URLS": "http://127.0.0.1:9/"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if ln.strip()]
    return result.returncode, lines


def _one_clear_line(code: int, lines: list[str], *words: str) -> None:
    text = "\n".join(lines)
    assert code != 0, text
    assert "Traceback" not in text, text
    assert 1 <= len(lines) <= 2, text
    for word in words:
        assert word in text, text


def test_port_in_use_is_one_line_and_never_says_listening(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, lines = _run(tmp_path, "serve", config=(
            f'[server]\nlisten = "127.0.0.1:{port}"\ndata_dir = "{tmp_path / "d"}"\n'))
    _one_clear_line(code, lines, f"cannot listen on 127.0.0.1:{port}", "in use")
    assert not any("listening on" in ln for ln in lines), lines


@pytest.mark.parametrize("problem", ["is-a-file", "cannot-create"])
def test_unusable_data_dir_is_one_line(tmp_path: Path, problem: str) -> None:
    if problem == "is-a-file":
        data = tmp_path / "data"
        data.write_text("not a directory")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        data = locked / "data"
        if os.geteuid() == 0:  # root writes anywhere: a file in the way stops it too
            (tmp_path / "file").write_text("")
            data = tmp_path / "file" / "data"
    code, lines = _run(tmp_path, "serve", config=(
        f'[server]\nlisten = "127.0.0.1:{free_port()}"\ndata_dir = "{data}"\n'))
    _one_clear_line(code, lines, "data", str(data))


def test_no_migrate_on_a_fresh_database_says_to_upgrade(tmp_path: Path) -> None:
    code, lines = _run(tmp_path, "serve", "--no-migrate", config=(
        f'[server]\nlisten = "127.0.0.1:{free_port()}"\ndata_dir = "{tmp_path / "d"}"\n'))
    _one_clear_line(code, lines, "symgate db upgrade")


@pytest.mark.parametrize("url", [
    "postgresql+asyncpg://nobody@127.0.0.1:9/none",  # nothing listens on port 9
    "mysql+nosuchdriver://x@127.0.0.1/y",
])
@pytest.mark.parametrize("command", [["serve"], ["db", "upgrade"], ["cache", "stats"]])
def test_unusable_database_at_start_is_one_line(tmp_path: Path, url: str,
                                                command: list[str]) -> None:
    code, lines = _run(tmp_path, *command, config=(
        f'[server]\nlisten = "127.0.0.1:{free_port()}"\ndata_dir = "{tmp_path / "d"}"\n'
        f'[database]\nurl = "{url}"\n'))
    _one_clear_line(code, lines, "database")


def test_symbolize_missing_input_is_one_line(tmp_path: Path) -> None:
    code, lines = _run(tmp_path, "symbolize", str(tmp_path / "absent.pb.gz"),
                       "-o", str(tmp_path / "out.pb.gz"))
    _one_clear_line(code, lines, "absent.pb.gz")


def test_symbolize_output_in_a_missing_folder_is_one_line(tmp_path: Path) -> None:
    import gzip

    from tests.profiles import make_profile

    source = tmp_path / "in.pb.gz"
    source.write_bytes(gzip.compress(make_profile([]).SerializeToString()))
    out = tmp_path / "no" / "such" / "out.pb.gz"
    code, lines = _run(tmp_path, "symbolize", str(source), "-o", str(out),
                       "--debug-dir", str(tmp_path))
    _one_clear_line(code, lines, str(out))


def test_symbolize_unreachable_server_is_one_line(tmp_path: Path) -> None:
    source = tmp_path / "in.pb.gz"
    source.write_bytes(b"whatever: the server is never reached")
    code, lines = _run(tmp_path, "symbolize", str(source), "-o", str(tmp_path / "o"),
                       "--server", "http://127.0.0.1:9")
    _one_clear_line(code, lines, "http://127.0.0.1:9")
    assert not (tmp_path / "o").exists()
