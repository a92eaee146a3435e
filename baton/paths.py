"""Where the project's own files are, resolved once from this file (never from the cwd)."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout: cluster_configs/, .cache/, runs/
SAMPLE_TRACES = Path(__file__).resolve().parent / "traces" / "samples"
SHARED = REPO_ROOT.parent / "shared"  # the team's shared material (data sets read in place)
