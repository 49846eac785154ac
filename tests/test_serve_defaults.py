"""`symgate serve` with no configuration file runs on its embedded defaults: its data under
XDG_DATA_HOME, its upstreams from DEBUGINFOD_URLS."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

from tests.elfs import ElfSet
from tests.harness import Debuginfod, free_port


def test_serve_on_embedded_defaults(elfs: ElfSet, debuginfod: Debuginfod, tmp_path: Path) -> None:
    """`symgate serve` with no config: data under XDG_DATA_HOME, upstreams from the env."""
    port = free_port()
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg"),
           "DEBUGINFOD_URLS": debuginfod.url}
    proc = subprocess.Popen(["symgate", "serve", "--listen", f"127.0.0.1:{port}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/buildid/{elfs.prog.build_id}/debuginfo"
        for _ in range(100):
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    assert r.read() == elfs.prog.debug.read_bytes()
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("symgate serve did not answer")
        assert (tmp_path / "xdg" / "symgate" / "symgate.sqlite").exists()
        objects = tmp_path / "xdg" / "symgate" / "cache" / "objects"
        for _ in range(100):  # committed just after the client's last byte
            if any(objects.rglob("debuginfo")):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the fetched file was never cached")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out.decode()
