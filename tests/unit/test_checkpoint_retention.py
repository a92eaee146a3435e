"""Retention rules of `baton bench checkpoints` on small hand-made streams (no engine, milliseconds).

Block size 4: prompt tokens are small ints, a block key names tokens [0, (k+1)·4).
"""
from __future__ import annotations

import math
import random

from baton.bench.checkpoint_online import score, summary
from baton.bench.checkpoint_retention import Arrival, BranchPoints, Planned, VllmDefault, VllmInterval
from baton.bench.checkpoint_sim import StreamRequest, block_keys, replay, simulate_keyed
from baton.bench.checkpoint_workloads import Timed, family_key
from baton.engine.checkpoints.config import CheckpointConfig
from baton.engine.checkpoints.depth import PrefixDepthTracker
from baton.engine.checkpoints.policy import CheckpointPolicy

B = 4


def req(prompt: list[int], output: list[int] = (), family: bytes | None = None, now: float = 0.0) -> StreamRequest:  # type: ignore[assignment]
    seq = [*prompt, *output][: len(prompt) + max(len(output) - 1, 0)]
    return StreamRequest(tuple(block_keys(seq, B)), len(prompt), len(output), family, now)


def arrival(prompt_len: int, computed: int, match: int, hit: int) -> Arrival:
    return Arrival(keys=tuple(range(computed // B)), prompt_len=prompt_len, computed_len=computed, match=match, hit=hit, conversation=None, now=0.0)


def test_vllm_default_keeps_the_replay_boundary_and_the_junction() -> None:
    a = list(range(10))  # L = 10: replay boundary ⌊9/4⌋·4 = 8
    b = [0, 1, 2, 3, 4, 5, 100, 101, 102, 103, 104, 105]  # shares one block with a
    c = [0, 1, 2, 3, 200, 201, 202, 203, 204]
    res = replay(VllmDefault(B), B, [req(a), req(a), req(b), req(c)])
    assert [(r.match, r.hit) for r in res.requests] == [(0, 0), (8, 8), (4, 0), (4, 4)]
    # a: {8}; the resend adds nothing; b: its replay boundary 8 and the junction at 4; c: its boundary 8
    assert res.states_held == 4
    assert res.recomputed_tokens == 4


def test_vllm_default_on_a_conversation_resumes_from_the_previous_prompts_boundary() -> None:
    t1 = list(range(10))
    out1 = [50, 51, 52, 53, 54, 55]  # computed = 10 + 5: blocks up to 12 hold attention KV
    t2 = [*t1, *out1, 60, 61, 62, 63, 64]  # L = 21
    res = replay(VllmDefault(B), B, [req(t1, out1), req(t2, [70, 71])])
    assert [(r.match, r.hit) for r in res.requests] == [(0, 0), (12, 8)]  # state at 8 (t1's boundary), KV to 12
    br = replay(BranchPoints(B), B, [req(t1, out1), req(t2, [70, 71])])
    assert [(r.match, r.hit) for r in br.requests] == [(0, 0), (12, 12)]  # SGLang keeps the leaf (12)


def test_branch_points_keep_the_leaf_and_where_a_request_leaves_the_cached_path() -> None:
    rule = BranchPoints(B)
    assert sorted(rule.keep(arrival(prompt_len=10, computed=15, match=8, hit=4))) == [8, 12]
    assert rule.keep(arrival(prompt_len=10, computed=15, match=8, hit=8)) == [12]  # no branch: a state was there


def test_vllm_interval_keeps_multiples_only_where_a_chunk_ends() -> None:
    rule = VllmInterval(B, interval=8, chunk=16)
    a = arrival(prompt_len=40, computed=49, match=0, hit=0)
    assert rule.chunk_ends(a) == [16, 32, 36, 40]  # every 16 tokens, then the replay boundary 36, then the prompt's end
    # chunk ends on a multiple of 8: 16, 32, 40; the replay boundary 36; decode block ends 44, 48 → 48
    assert sorted(set(rule.keep(a))) == [16, 32, 36, 40, 48]
    # an interval the chunks never land on keeps only what vLLM's default keeps (+ decode multiples)
    assert sorted(set(VllmInterval(B, interval=12, chunk=16).keep(a))) == [36, 48]


def test_planned_rule_replays_as_the_engine_checked_simulator() -> None:
    rng = random.Random(3)
    heads = [[rng.randrange(1000) for _ in range(4 * B)] for _ in range(3)]
    prompts = [[*rng.choice(heads)[: rng.randrange(1, 5) * B], *(rng.randrange(1000) for _ in range(rng.randrange(1, 9)))] for _ in range(40)]
    cfg = CheckpointConfig(strategy="dp", budget=2, half_life_s=1e6)
    ref = simulate_keyed(cfg, B, [(block_keys(p, B), len(p)) for p in prompts])
    got = replay(Planned(cfg, B), B, [req(p, now=float(i)) for i, p in enumerate(prompts)])
    assert [(r.match, r.hit) for r in got.requests] == [(r.match, r.hit) for r in ref.requests]
    assert got.states_held == ref.states_held


def test_conversation_families_split_one_shared_system_prompt() -> None:
    system = list(range(8))
    first_a, first_b = [*system, 100, 101, 102], [*system, 200, 201, 202]
    stream = [req(first_a, family=family_key(first_a)), req(first_b, family=family_key(first_b), now=1.0)]
    by_block = Planned(CheckpointConfig(strategy="dp", budget=2), B, "first_block")
    by_conv = Planned(CheckpointConfig(strategy="dp", budget=2), B, "conversation")
    replay(by_block, B, stream)
    replay(by_conv, B, stream)
    assert len(by_block.policy.families) == 1 and len(by_conv.policy.families) == 2
    assert family_key(first_a) != family_key(first_b) and family_key(first_a) == family_key(list(first_a))


def test_depth_tracker_reports_the_earlier_tail_a_prompt_reaches() -> None:
    t = PrefixDepthTracker(B)
    p1 = list(range(10))  # tail (replay boundary) at 8
    assert t.observe(block_keys(p1, B), 10).reached_tail is None
    p2 = [*range(16), 99]  # extends p1: matches 12 (capped by p1's 2 full blocks → 8), reaches p1's tail at 8
    m = t.observe(block_keys(p2, B), len(p2))
    assert (m.depth, m.reached_tail) == (8, 8)
    other = [0, 1, 2, 3, 7, 7, 7, 7, 7]
    assert t.observe(block_keys(other, B), len(other)).reached_tail is None  # shares block 0: no tail there


def test_continuation_plans_the_next_turn_and_stays_in_budget() -> None:
    pol = CheckpointPolicy(CheckpointConfig(strategy="dp", budget=1), B)
    pol.observe("conv", 0, 10, 0.0)  # tail 8
    pol.observe("conv", 12, 21, 1.0, reached_tail=8)  # reached 8, went one block past it
    assert pol.continuation_rate() == 1 / 3 and pol.offsets == {4: 1}  # 1 of 2 requests reached a tail, shrunk: 1 / (2 + 1)
    plan = pol.observe("conv", 20, 30, 2.0, reached_tail=20)
    assert pol.offsets == {4: 1, 0: 1}
    assert len(plan.positions) == 1 and plan.positions[0] in (28, 32)  # the new tail (28) or one block past it
    pol.check_integrity()
    off = CheckpointPolicy(CheckpointConfig(strategy="dp", budget=1, continuation=False), B)
    for d, L, now, r in [(0, 10, 0.0, None), (12, 21, 1.0, 8), (20, 30, 2.0, 20)]:
        plan = off.observe("conv", d, L, now, r)
    assert plan.positions[0] <= 20  # observed depths only: the next turn's depth is never planned


def test_decay_weighs_recent_depths() -> None:
    cfg = CheckpointConfig(strategy="dp", budget=1, half_life_s=10.0, freeze_min_weight=1e9, continuation=False)
    pol = CheckpointPolicy(cfg, B)
    for i in range(3):
        pol.observe("f", 8, 40, float(i))
    plan = pol.observe("f", 24, 40, 100.0)  # ten half-lives later: the old mode is worth ~1/1000
    assert plan.positions == (24,)


def test_replay_scores_only_held_out_requests() -> None:
    prompts = [list(range(10))] * 4
    res = replay(VllmDefault(B), B, [req(p) for p in prompts], score_from=2)
    assert len(res.scored) == 2 and res.match_tokens == 16 and res.recomputed_tokens == 0


def test_online_score_can_fail_and_names_the_losses() -> None:
    rows = [
        {"strategy": "none", "param": None, "states_held": 0, "recomputed": 1000},
        {"strategy": "vllm_default", "param": None, "states_held": 10, "recomputed": 100},
        {"strategy": "dp", "param": 1, "states_held": 5, "recomputed": 100},
        {"strategy": "dp", "param": 2, "states_held": 12, "recomputed": 20},
    ]
    good = score(rows)
    assert good["dp_dominates_online"] and good["states_ratio_vs_vllm_default_same_saving"] == 0.5
    assert good["recompute_ratio_vs_vllm_default_same_states"] == 1.0
    rows[2] = {"strategy": "dp", "param": 1, "states_held": 11, "recomputed": 150}
    bad = score(rows)
    assert not bad["dp_dominates_online"] and bad["dp_loses_to"][0]["strategy"] == "vllm_default"
    assert bad["states_ratio_vs_vllm_default_same_saving"] == 1.2 and bad["recompute_ratio_vs_vllm_default_same_states"] == 10.0
    s = summary({"a": good, "b": bad})
    assert not s["dp_dominates_online"] and s["states_ratio_workload"] == "b"
    unreached = score([{**r, "recomputed": 500} if r["strategy"] == "dp" else r for r in rows])
    assert unreached["states_ratio_vs_vllm_default_same_saving"] is None
    assert summary({"u": unreached})["states_ratio_vs_vllm_default_same_saving"] is None
    assert math.isfinite(unreached["recompute_ratio_vs_vllm_default_same_states"])


def test_timed_stream_keys_cover_prompt_and_output_but_the_last_token() -> None:
    from baton.bench.checkpoint_online import to_stream

    t = Timed(prompt=tuple(range(10)), output=(50, 51, 52), family=b"f", now=0.0, conversation="c")
    (r,) = to_stream([t], B)
    assert r.computed_len == 12 and len(r.keys) == 3


def test_engine_phase_plumbing_with_a_stand_in_engine(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The bench's engine phase on a fake engine that answers the replays' hits: every run recorded,
    vLLM's own default compared with its replay, the DP run at vLLM default's state count."""
    from baton.bench import checkpoints as bench

    rng = random.Random(5)
    head = [rng.randrange(1000) for _ in range(3 * bench.B)]
    prompts = [[*head[: rng.randrange(1, 4) * bench.B], *(rng.randrange(1000) for _ in range(rng.randrange(5, 200)))] for _ in range(12)]
    keyed = [(block_keys(p, bench.B), len(p)) for p in prompts]

    def fake_engine(mode: str, ps: list[list[int]], *, ckpt=None, max_tokens: int = 8, max_model_len: int = 4096):  # type: ignore[no-untyped-def]
        if mode == "baton":
            sim = simulate_keyed(CheckpointConfig.model_validate(ckpt), bench.B, keyed)
            hits, metrics = [r.hit for r in sim.requests], {"recomputed_tokens": sim.recomputed_tokens, "checkpoints_held": sim.states_held,
                                                           "state_bytes": sim.states_held * 512 * 1024}
        else:
            hits = [r.hit for r in bench._vllm_default_replay(keyed, max_tokens).requests] if mode == "vllm" else [0] * len(ps)
            metrics = None
        rows = [{"tokens": [1, 2], "cached": h, "ttft_s": 0.01} for h in hits]
        return {"rows": rows, **({"metrics": metrics} if metrics else {})}

    monkeypatch.setattr(bench, "run_engine", fake_engine)
    out = bench.engine_phase(prompts, 2, ["none", "dp"], max_tokens=4)
    assert out["exact_outputs"] and out["engine_matches_simulator"] and out["vllm_default_matches_replay"]
    assert {"nocache", "none", "dp", "dp_same_states_as_vllm", "vllm_default"} <= set(out["runs"])
    vd_states = out["dp_same_states"]["vllm_default_states"]
    assert out["runs"]["dp_same_states_as_vllm"]["checkpoints_held"] <= vd_states or out["dp_same_states"]["budget"] == 1


class CharTokenizer:
    """A stand-in tokenizer: ChatML template, one id per character."""

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):  # type: ignore[no-untyped-def]
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):  # type: ignore[no-untyped-def]
        return {"input_ids": [ord(c) for c in text]}


def test_conversation_stream_appends_each_turn_to_the_previous_prompt_and_reply() -> None:
    from baton.bench.checkpoint_workloads import conversation_stream
    from baton.traces.format import Conversation, Turn

    convs = [Conversation(conversation_id=f"c{j}", system="tools", turns=[Turn(role="user", content=f"q{j}"), Turn(role="tool", content="r"),
                                                                           Turn(role="user", content="again", think_time_s=1.0)])
             for j in range(2)]
    stream = conversation_stream(CharTokenizer(), convs, reply_tokens=5, gap_s=0.5, service_s=1.0)
    assert len(stream) == 6 and [r.now for r in stream] == sorted(r.now for r in stream)
    last: dict[str, Timed] = {}
    for r in stream:
        if r.conversation in last:
            prev = last[r.conversation]
            assert r.prompt[: len(prev.prompt) + len(prev.output)] == prev.prompt + prev.output and r.family == prev.family
        last[r.conversation] = r
    assert last["c0"].family != last["c1"].family  # same system prompt, different first user message


def test_simulator_holds_plan_positions_the_decode_reaches() -> None:
    from baton.bench.checkpoint_sim import simulate

    long_, short = list(range(17)), list(range(7))  # one family (block 0); block-dense plans 4, 8, 12, 16
    cfg = CheckpointConfig(strategy="block_dense")
    assert simulate(cfg, B, [long_, short]).states_held == 4
    # the short prompt's decode (7 + 2 tokens computed) passes 8, a planned position: the engine keeps it
    assert simulate(cfg, B, [long_, short], output_len=3).states_held == 5
