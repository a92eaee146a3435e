"""Re-pin constraints.txt to the packages the set-up's .venv now holds.

    python -m baton.tools.lock        (make lock)

scripts/setup.sh installs every step with `-c constraints.txt`, so a fresh clone resolves to
exactly the set this project was tested with, not whatever PyPI holds that day. Run this after
changing a dependency in pyproject.toml and re-running the set-up, then commit the file.
Local version labels (`torch==2.13.0+cpu`) are dropped: the same pin then matches the CPU
wheel here and the index's build elsewhere. The project itself (editable) is never pinned.
"""
from __future__ import annotations

import subprocess
import sys

from baton.paths import REPO_ROOT

CONSTRAINTS = REPO_ROOT / "constraints.txt"
HEADER = (
    "# Every package of the CPU stack, pinned as resolved by scripts/setup.sh (so a fresh clone"
    " gets the same set).\n# Regenerate after changing a dependency: make lock\n"
)


def render(freeze_lines: list[str]) -> str:
    """constraints.txt's text from `pip freeze --exclude-editable` output (pure)."""
    pins: dict[str, str] = {}
    for raw in freeze_lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "==" not in line:
            raise ValueError(f"not a pinned release, cannot lock it: {line!r}")
        name, version = line.split("==", 1)
        if name.lower() == "baton":
            continue
        pins[name] = version.split("+", 1)[0]
    return HEADER + "".join(f"{n}=={pins[n]}\n" for n in sorted(pins, key=str.lower))


def parse(text: str) -> dict[str, str]:
    """Package name (normalized) -> pinned version, from constraints.txt's text."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            name, version = line.split("==", 1)
            out[normalize(name)] = version
    return out


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def main() -> int:
    freeze = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        check=True, capture_output=True, text=True,
    ).stdout.splitlines()
    CONSTRAINTS.write_text(render(freeze))
    print(f"[lock] {CONSTRAINTS}: {len(parse(CONSTRAINTS.read_text()))} packages pinned")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
