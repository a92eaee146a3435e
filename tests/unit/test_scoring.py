"""The one load score (router/scoring.py), and that it scores exactly as the two scorers it
replaced did at their call sites: the Serve router's ranking (KV, queue, queued prefill tokens;
no pins, no prompt) and the directory's decoder choice (projected KV + pins + queue; KV weight 1,
no queued prefill tokens)."""
from __future__ import annotations

import random

import pytest

from router.scoring import LoadWeights, ReplicaLoad, load_score, projected_kv

W = LoadWeights()


def test_the_score_weighs_every_signal() -> None:
    w = LoadWeights(kv_weight=2.0, queue_weight=0.25, pin_weight=0.1, prefill_token_weight=0.001)
    r = ReplicaLoad("a", kv_usage=0.25, kv_capacity_tokens=4_000, in_flight=4, pending_prefill_tokens=3_000, pinned=2)
    assert load_score(r, w, 1_000) == pytest.approx(2 * (0.25 + 1_000 / 4_000) + 0.1 * 2 + 0.25 * 4 + 0.001 * 3_000)


def test_projected_kv_adds_the_prompt_only_when_the_capacity_is_known() -> None:
    assert projected_kv(ReplicaLoad("a", kv_usage=0.25, kv_capacity_tokens=4_000), 1_000) == 0.5
    assert projected_kv(ReplicaLoad("a", kv_usage=0.4), 1_000_000) == 0.4
    assert load_score(ReplicaLoad("a", kv_usage=0.4), LoadWeights(pin_weight=0, queue_weight=0), 1_000_000) == pytest.approx(0.4)


def test_default_weights_make_one_8k_prefill_weigh_one_full_kv_pool() -> None:
    assert load_score(ReplicaLoad("a", pending_prefill_tokens=8192), W) == pytest.approx(load_score(ReplicaLoad("b", kv_usage=1.0), W))
    assert load_score(ReplicaLoad("a"), W) == 0.0


def test_default_weights_are_the_routing_config_defaults() -> None:
    from deployments.config import RoutingConfig

    r = RoutingConfig()
    assert (W.kv_weight, W.queue_weight, W.pin_weight, W.prefill_token_weight) == (
        r.kv_weight, r.queue_weight, r.pin_weight, r.prefill_token_weight)


@pytest.mark.parametrize("seed", range(10))
def test_the_serve_router_call_site_scores_as_before(seed: int) -> None:
    """Bit-for-bit the old router/placement.py load_score: kv*usage + queue*in_flight + prefill*tokens."""
    rng = random.Random(seed)
    for _ in range(200):
        w = LoadWeights(kv_weight=rng.choice([0.0, 1.0, 2.0, 0.3]), queue_weight=rng.choice([0.0, 0.05, 0.25]),
                        pin_weight=rng.choice([0.0, 0.02, 1.0]), prefill_token_weight=rng.choice([0.0, 1 / 8192, 0.001]))
        r = ReplicaLoad("r", kv_usage=rng.random(), in_flight=rng.randint(0, 50), pending_prefill_tokens=rng.randint(0, 20_000))
        old = w.kv_weight * r.kv_usage + w.queue_weight * r.in_flight + w.prefill_token_weight * r.pending_prefill_tokens
        assert load_score(r, w) == old


@pytest.mark.parametrize("seed", range(10))
def test_the_decoder_choice_call_site_scores_as_before(seed: int) -> None:
    """Bit-for-bit the old router/policy.py decoder_score: projected + pin*pinned + queue*in_flight."""
    rng = random.Random(seed)
    for _ in range(200):
        w = LoadWeights(pin_weight=rng.choice([0.0, 0.02, 0.1]), queue_weight=rng.choice([0.0, 0.05, 0.01]), kv_weight=1.0,
                        prefill_token_weight=rng.choice([0.0, 1 / 8192]))
        d = ReplicaLoad("d", kv_usage=rng.random(), kv_capacity_tokens=rng.choice([0, 4_096, 16_384]),
                        in_flight=rng.randint(0, 30), pinned=rng.randint(0, 40))
        prompt = rng.choice([0, 100, 4_000, 77_777])
        projected = d.kv_usage + (prompt / d.kv_capacity_tokens if d.kv_capacity_tokens else 0.0)
        old = projected + w.pin_weight * d.pinned + w.queue_weight * d.in_flight
        assert load_score(d, w, prompt) == old
