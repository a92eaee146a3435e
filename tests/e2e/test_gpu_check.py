"""scripts/gpu_check.sh on this CPU (`--device cpu`): the GPU check builds its engine from
gpu_example.yaml's decode settings, injects exactly and prints its RESULT line, so the script a GPU
session runs is the one the suite keeps working; asked for CUDA where there is none, it says so."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_the_gpu_check_runs_on_cpu_and_injects_exactly(tmp_path: Path) -> None:
    done = subprocess.run([str(SCRIPT), "--device", "cpu", "--reps", "1", "--questions", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(result) == 1 and "device=cpu exact_injection=ok" in result[0], done.stdout[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    ex = report["exact_injection"]
    assert ex["ok"] and ex["plain"] == ex["injected"] and ex["cached_tokens"] >= ex["inject_end"] > 0
    ttft = report["by_k"]["50"]["ttft_p50_s"]
    assert all(v > 0 for v in ttft.values())
    assert report["by_k"]["50"]["prompt_tokens"] > report["by_k"]["5"]["prompt_tokens"]
    assert report["result"]["ttft_speedup_k50"] > 0


def test_the_gpu_check_asked_for_cuda_without_a_gpu_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    done = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
