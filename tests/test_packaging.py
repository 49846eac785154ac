"""The wheel that `pip install .` and the Dockerfile build carries every module of the tree.

The tests import the source tree through an editable install, so a package the wheel leaves
out (symbolize.pprof once was) would pass every other test and break `symgate serve` for users.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("proxy", "symbolize", "migrations")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [name for name in out.stdout.decode().split("\0") if name]


def test_the_wheel_holds_every_module_and_data_file_of_the_packages(tmp_path: Path) -> None:
    # Built from a copy of the tracked files, so a stale build/ directory cannot fill gaps.
    src = tmp_path / "src"
    tracked = tracked_files()
    for name in tracked:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("symgate-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt")))
    packaged = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    wanted = {name for name in tracked
              if name.split("/")[0] in PACKAGES
              and (name.endswith((".py", ".pyi")) or name == "migrations/script.py.mako")}
    assert wanted, "no package files found"
    assert wanted - packaged == set()
    assert {"symbolize/pprof/profile_pb2.py", "migrations/versions/__init__.py"} <= packaged
    assert "symgate = proxy.tools.entry:main" in entry_points.decode()
