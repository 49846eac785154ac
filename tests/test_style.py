"""The code standards, checked by the same command that runs the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_mypy_strict_on_proxy_and_symbolize() -> None:
    result = run("mypy", "--strict", "proxy", "symbolize")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff() -> None:
    result = run("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr
