"""The project's shape, checked: dependencies only point down, product files stay small, and
tests never skip over a broken import of the project's own code.

Layers, low to high (README "Layout"):
  kv_transfer/, router/            import no other project package
  baton/engine/                    + kv_transfer
  memory_store/                    + kv_transfer
  deployments/                     + everything above (the Serve application)
  baton/bench, baton/traces, baton/cli   top: benchmarks, traces, command line
baton/paths.py and baton/tools/ (set-up tooling) stand alone.
Every import counts, including ones inside functions (lazy imports are still dependencies)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from baton.paths import REPO_ROOT

PACKAGES = ("kv_transfer", "router", "memory_store", "deployments", "baton")

# package (dotted prefix) -> project packages it may import (its own prefix is always allowed)
ALLOWED: dict[str, frozenset[str]] = {
    "kv_transfer": frozenset(),
    "router": frozenset(),
    "baton.engine": frozenset({"kv_transfer"}),
    "memory_store": frozenset({"kv_transfer"}),
    "deployments": frozenset({"kv_transfer", "router", "baton.engine", "memory_store"}),
    "baton.tools": frozenset({"baton.paths"}),  # set-up tooling
    "baton.paths": frozenset(),
}
PRODUCT = ("kv_transfer", "router", "memory_store", "deployments", "baton/engine", "baton/tools", "baton/paths.py")
MAX_LINES = 350


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).with_suffix("")
            out.append((".".join(p for p in rel.parts if p != "__init__"), path))
    return out


def _project_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in PACKAGES}


def _layer(module: str) -> str | None:
    for prefix in sorted(ALLOWED, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    return None


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_every_project_module_is_found() -> None:
    mods = dict(_modules())
    assert "baton.engine.runner" in mods and "router.policy" in mods and "kv_transfer.segments" in mods


@pytest.mark.parametrize("module,path", [m for m in _modules() if _layer(m[0]) is not None], ids=lambda v: str(v))
def test_imports_point_down(module: str, path: Path) -> None:
    layer = _layer(module)
    assert layer is not None
    allowed = ALLOWED[layer] | {layer}
    bad = sorted(n for n in _project_imports(path) if not any(_within(n, a) for a in allowed))
    assert not bad, f"{module} ({layer}) imports {bad}; allowed: {sorted(allowed)}"


def test_product_files_stay_small() -> None:
    big = []
    for root in PRODUCT:
        p = REPO_ROOT / root
        for f in [p] if p.is_file() else sorted(p.rglob("*.py")):
            n = len(f.read_text().splitlines())
            if n > MAX_LINES:
                big.append(f"{f.relative_to(REPO_ROOT)}: {n}")
    assert not big, f"product files over {MAX_LINES} lines: {big}"


def test_tests_never_skip_over_the_projects_own_imports() -> None:
    """`pytest.importorskip("kv_transfer...")` would turn a broken import into a skip."""
    offenders = []
    for f in sorted((REPO_ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "importorskip"
                    and node.args and isinstance(node.args[0], ast.Constant)
                    and str(node.args[0].value).split(".")[0] in PACKAGES):
                offenders.append(f"{f.relative_to(REPO_ROOT)}:{node.lineno} {node.args[0].value}")
    assert not offenders, offenders


def test_no_top_level_package_outside_the_layout() -> None:
    """pip installs exactly these top-level names (pyproject's package list)."""
    import tomllib

    cfg = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    include = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(p.rstrip("*") for p in include) == sorted(PACKAGES)
