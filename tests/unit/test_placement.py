"""Pure load ranking (router/placement.py): what the Serve request router does when a request
carries no target (a prefill, or a turn the directory could not place), and how it honours the
target the conversation directory chose. The score itself: tests/unit/test_scoring.py."""
from __future__ import annotations

import itertools
import random

import pytest

from router.placement import rank_by_load, rank_with_target
from router.scoring import LoadWeights, ReplicaLoad, load_score

W = LoadWeights()
KV_ONLY = LoadWeights(kv_weight=1.0, queue_weight=0.0, prefill_token_weight=0.0)
QUEUE_ONLY = LoadWeights(kv_weight=0.0, queue_weight=1.0, prefill_token_weight=0.0)
PREFILL_ONLY = LoadWeights(kv_weight=0.0, queue_weight=0.0, prefill_token_weight=1.0)


def load(replica_id: str, kv: float = 0.0, queue: int = 0, prefill: int = 0) -> ReplicaLoad:
    return ReplicaLoad(replica_id, kv_usage=kv, in_flight=queue, pending_prefill_tokens=prefill)


def flat(ranks: tuple[tuple[str, ...], ...]) -> list[str]:
    return [r for rank in ranks for r in rank]


# ---- weights --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "w, field", [(KV_ONLY, "kv"), (QUEUE_ONLY, "queue"), (PREFILL_ONLY, "prefill")], ids=["kv", "queue", "prefill"]
)
def test_a_zero_weight_ignores_its_signal(w: LoadWeights, field: str) -> None:
    # each replica is heavy on exactly one signal; only the weighted one counts
    heavy = {"kv": load("kv-heavy", kv=0.9), "queue": load("queue-heavy", queue=9), "prefill": load("prefill-heavy", prefill=9000)}
    ranks = rank_by_load(list(heavy.values()), w)
    assert ranks[-1] == (heavy[field].replica_id,)
    assert len(ranks) == 2 and sorted(ranks[0]) == sorted(r.replica_id for k, r in heavy.items() if k != field)


# ---- rank_by_load --------------------------------------------------------------------------------


def test_rank_by_kv_usage_least_loaded_first() -> None:
    assert rank_by_load([load("a", kv=0.9), load("b", kv=0.1), load("c", kv=0.5)], W) == (("b",), ("c",), ("a",))


def test_rank_by_queue_len() -> None:
    assert rank_by_load([load("a", queue=3), load("b", queue=1), load("c", queue=2)], W) == (("b",), ("c",), ("a",))


def test_rank_by_pending_prefill_tokens() -> None:
    ranks = rank_by_load([load("a", prefill=4096), load("b", prefill=0), load("c", prefill=1024)], W)
    assert ranks == (("b",), ("c",), ("a",))


def test_pending_prefill_outweighs_a_short_queue_with_default_weights() -> None:
    # b holds one request with a 6k-token prompt still to prefill (0.05 + 0.73); a holds 4 short ones (0.2)
    assert rank_by_load([load("a", queue=4), load("b", queue=1, prefill=6000)], W) == (("a",), ("b",))


def test_weights_decide_between_kv_and_queue() -> None:
    candidates = [load("full_kv", kv=0.8), load("long_queue", queue=10)]
    assert rank_by_load(candidates, LoadWeights(kv_weight=1.0, queue_weight=0.05))[0] == ("long_queue",)  # 0.8 vs 0.5
    assert rank_by_load(candidates, LoadWeights(kv_weight=1.0, queue_weight=0.1))[0] == ("full_kv",)  # 0.8 vs 1.0


def test_ties_are_grouped_in_one_rank_in_replica_id_order() -> None:
    candidates = [load("c", kv=0.2), load("a", kv=0.2), load("b", queue=4), load("d", kv=0.5)]
    assert rank_by_load(candidates, W) == (("a", "b", "c"), ("d",))


def test_tie_order_does_not_depend_on_input_order() -> None:
    candidates = [load(r) for r in ("r3", "r1", "r2")]
    for seed in range(5):
        shuffled = candidates[:]
        random.Random(seed).shuffle(shuffled)
        assert rank_by_load(shuffled, W) == (("r1", "r2", "r3"),)


def test_float_noise_does_not_split_a_tie() -> None:
    # 0.1 + 0.2 != 0.3 in floating point; the two replicas carry the same load
    ranks = rank_by_load([load("a", kv=0.1 + 0.2), load("b", kv=0.3), load("c", kv=0.5)], W)
    assert ranks == (("a", "b"), ("c",))


def test_rank_of_nothing_is_empty() -> None:
    assert rank_by_load([], W) == ()


# ---- rank_with_target -----------------------------------------------------------------------------


def test_a_target_among_the_candidates_is_ranked_alone() -> None:
    # the busiest replica: the directory chose it (the conversation's KV lives there)
    candidates = [load("a", kv=0.1), load("b", kv=0.95, queue=8), load("c")]
    assert rank_with_target("b", candidates, W) == (("b",),)


def test_a_target_that_is_not_a_candidate_falls_back_to_load() -> None:
    candidates = [load("a", kv=0.5), load("b", kv=0.1), load("c", kv=0.1)]
    assert rank_with_target("gone", candidates, W) == (("b", "c"), ("a",))


def test_no_target_ranks_by_load() -> None:
    candidates = [load("a", queue=2), load("b")]
    assert rank_with_target(None, candidates, W) == rank_by_load(candidates, W) == (("b",), ("a",))


def test_a_target_with_no_candidates_is_nothing() -> None:
    assert rank_with_target("a", [], W) == ()


# ---- property: ranks partition the candidates in score order --------------------------------------


def random_loads(rng: random.Random) -> list[ReplicaLoad]:
    ids = rng.sample([f"r{i}" for i in range(10)], rng.randint(0, 7))
    # few distinct values so ties are common
    return [
        load(r, kv=rng.choice([0.0, 0.25, 0.5, 1.0]), queue=rng.randint(0, 3), prefill=rng.choice([0, 2048, 8192])) for r in ids
    ]


@pytest.mark.parametrize("seed", range(20))
def test_ranks_partition_the_candidates_by_ascending_score(seed: int) -> None:
    """Property-style (hypothesis is not installed here): 50 random cases per seed."""
    rng = random.Random(seed)
    for _ in range(50):
        candidates = random_loads(rng)
        w = LoadWeights(kv_weight=rng.choice([0.0, 1.0, 2.0]), queue_weight=rng.choice([0.0, 0.05, 0.25]), prefill_token_weight=rng.choice([0.0, 1 / 8192]))
        ranks = rank_by_load(candidates, w)
        case = (candidates, w, ranks)
        assert sorted(flat(ranks)) == sorted(c.replica_id for c in candidates), case
        assert all(ranks), case
        score = {c.replica_id: load_score(c, w) for c in candidates}
        for rank in ranks:
            assert list(rank) == sorted(rank), case  # replica-id order within a rank
            assert all(score[r] == pytest.approx(score[rank[0]]) for r in rank), case
        firsts = [score[rank[0]] for rank in ranks]
        assert all(a < b for a, b in itertools.pairwise(firsts)), case  # strictly ascending between ranks
        target = rng.choice([None, "gone", *score])
        with_target = rank_with_target(target, candidates, w)
        assert with_target == (((target,),) if target in score else ranks), case
