"""Sparse recurrent checkpoints on a real in-process vLLM engine (tiny hybrid LFM2, this CPU).

For every strategy: greedy tokens identical to prefix caching off, and each request's hit depth
(vLLM's cached tokens) equal, request by request, to the simulator of the enforced policy — i.e.
the deepest kept (planned) state at or below the request's match depth.
One engine per strategy, each in its own process (~15 s each).
"""
from __future__ import annotations

import random

import pytest

from baton.bench.checkpoint_engine import TINY_HYBRID, run_engine
from baton.bench.checkpoint_sim import simulate
from baton.engine.checkpoints.config import CheckpointConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

B = 128  # LFM2's mamba block size on CPU (= block size with prefix caching)
# on the engine: no states, every block, and the DP plan. The other baselines (uniform, balanced,
# sqrt, dyadic) place states through the same scheduler seam; their positions are unit-tested and
# checked against the engine-checked simulator (tests/unit), which keeps CI under its time limit
STRATEGIES = ["none", "block_dense", "dp"]


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    doc = [rng.randrange(100, 40000) for _ in range(1100)]
    other = [rng.randrange(100, 40000) for _ in range(520)]
    q = lambda n=5: [rng.randrange(100, 40000) for _ in range(n)]
    cuts = [1100, 650, 400, 650, 900, 650, 400, 1000, 650]
    out = [doc[:c] + q() for c in cuts]
    out[7:7] = [other + q(), other[:300] + q()]  # a second prefix family
    out.append(list(out[1]))  # an exact resend
    return out


def ckpt(strategy: str) -> dict:
    return CheckpointConfig(strategy=strategy, budget=2, resolve_every=1, half_life_s=1e9).model_dump()


@pytest.fixture(scope="module")
def reference() -> dict:
    if not (TINY_HYBRID / "config.json").exists():
        pytest.fail(f"tiny hybrid model not provisioned at {TINY_HYBRID}: run `make setup`")
    return run_engine("nocache", prompts(), max_tokens=6)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_outputs_exact_and_hits_follow_the_plan(reference: dict, strategy: str) -> None:
    ps = prompts()
    res = run_engine("baton", ps, ckpt=ckpt(strategy), max_tokens=6)
    assert [r["tokens"] for r in res["rows"]] == [r["tokens"] for r in reference["rows"]], "greedy tokens differ from no-cache"
    sim = simulate(CheckpointConfig(**ckpt(strategy)), B, ps, output_len=6)  # decode-reached plan positions are held too
    hits = [r["cached"] for r in res["rows"]]
    assert hits == [r.hit for r in sim.requests], f"engine hits {hits} vs planned {[r.hit for r in sim.requests]}"
    assert all(h <= r.match for h, r in zip(hits, sim.requests, strict=True))
    m = res["metrics"]
    assert m["match_tokens"] == sim.match_tokens and m["recomputed_tokens"] == sim.recomputed_tokens
    assert m["checkpoints_held"] == sim.states_held
    assert (m["state_bytes"] > 0) == (sim.states_held > 0)
    if strategy == "block_dense":  # every block kept: every request resumes at its full match
        assert hits == [r.match for r in sim.requests]
    if strategy == "dp":  # once the plan settled, the mode (640) is hit exactly; fewer tokens than vLLM's interval
        assert hits[-2:] == [640, 640] and sim.recomputed_tokens < simulate(CheckpointConfig(**ckpt("uniform")), B, ps).recomputed_tokens
    if strategy == "none":
        assert sum(hits) == 0
