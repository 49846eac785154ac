"""The dependency direction, as a test rather than a hope:
web -> symbols -> artifacts -> bucket -> sources / store -> the foundation modules, and tools
above all;
symbolize/ never imports proxy/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each layer may import the foundation, itself and the layers listed.
ALLOWED: dict[str, set[str]] = {
    "store": set(),
    "sources": set(),
    "bucket": {"store", "sources"},
    "artifacts": {"bucket", "store", "sources"},
    "symbols": {"artifacts", "bucket", "store", "sources"},
    "web": {"symbols", "artifacts", "bucket", "store", "sources"},
    "tools": {"web", "symbols", "artifacts", "bucket", "store", "sources"},
}


def imports_of(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
    """The proxy layer of a module, "foundation", or None outside proxy/."""
    parts = module.split(".")
    if parts[0] != "proxy":
        return None
    if len(parts) > 1 and parts[1] in ALLOWED:
        return parts[1]
    return "foundation"


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / "proxy").rglob("*.py")):
        me = module_name(path, root)
        mine = layer_of(me)
        assert mine is not None
        for imported in imports_of(path):
            theirs = layer_of(imported)
            if theirs in (None, mine, "foundation"):
                continue
            if mine == "foundation" or theirs not in ALLOWED[mine]:
                found.append(f"{me} ({mine}) imports {imported} ({theirs})")
    return sorted(found)


def test_proxy_layers_import_downwards_only() -> None:
    assert violations() == []


def test_relative_imports_are_not_used_across_packages() -> None:
    """Absolute imports make every dependency visible to the check above."""
    for path in (ROOT / "proxy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not node.level, f"{path}: relative import"


def test_symbolize_never_imports_proxy() -> None:
    for path in (ROOT / "symbolize").rglob("*.py"):
        assert not any(m == "proxy" or m.startswith("proxy.") for m in imports_of(path)), path


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    (tmp_path / "proxy" / "store").mkdir(parents=True)
    (tmp_path / "proxy" / "keys.py").write_text("from proxy.sources.base import Source\n")
    (tmp_path / "proxy" / "store" / "disk.py").write_text(
        "from proxy.web.app import create_app\nfrom proxy.keys import ArtifactKey\n")
    assert violations(tmp_path) == [
        "proxy.keys (foundation) imports proxy.sources.base (sources)",
        "proxy.keys (foundation) imports proxy.sources.base.Source (sources)",
        "proxy.store.disk (store) imports proxy.web.app (web)",
        "proxy.store.disk (store) imports proxy.web.app.create_app (web)",
    ]
