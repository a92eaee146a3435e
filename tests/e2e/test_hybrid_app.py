"""The hybrid model through the running application (Ray + Serve + vLLM, tiny LFM2 with sparse
recurrent checkpoints), as `serve run cluster_configs/local_hybrid.yaml` starts it: repeated
prompts sharing a long prefix are served, greedy outputs repeat exactly, and the replica reports
its checkpoints in /baton/stats."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import start_app, stop_app

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    if not (ROOT / ".cache" / "models" / "tiny-lfm2" / "config.json").exists():
        pytest.fail("tiny-lfm2 not provisioned: run `make setup`")
    args = yaml.safe_load((ROOT / "cluster_configs" / "local_hybrid.yaml").read_text())["applications"][0]["args"]
    args["decode"]["resources"] = {"num_cpus": 0.5, "custom": {"decode_slot": 1}}
    u = start_app(args)
    try:
        yield u
    finally:
        stop_app()


def test_shared_prefix_requests_resume_from_checkpoints(url: str) -> None:
    doc = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog near the river bank." for i in range(60))
    outs = []
    for q in ("Who jumps?", "Where is the dog?", "Who jumps?"):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": doc + "\nQuestion: " + q, "max_tokens": 8, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        outs.append(r.json())
    assert outs[0]["choices"][0]["text"] == outs[2]["choices"][0]["text"]  # exact resume: same greedy tokens
    assert outs[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    deadline = time.monotonic() + 30
    while True:  # the replica reports every routing-stats period
        reps = httpx.get(f"{url}/baton/stats", timeout=10).json()["replicas"]
        held = [r.get("checkpoints_held") for r in reps.values() if r["pool"] == "decode"]
        if held and held[0]:
            break
        assert time.monotonic() < deadline, reps
        time.sleep(1)
    assert held[0] > 0
