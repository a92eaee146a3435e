"""baton/engine/realtime/session.py: the pure rule that composes a real-time session's ticks.

Segments are FakeSeg (token ids only; nbytes 4/token) built as the segment connector builds
captures: one per requested range, holding exactly prompt[a:b]. Every plan is also checked the
way the connector checks it: the injected segments, laid end to end from position 0, must hold
exactly the prompt's first tokens, and the captured ranges must lie inside the prompt.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import pytest
import torch

from baton.engine.realtime.session import (
    SessionSpec,
    SessionState,
    TickPlan,
    after_lost_kv,
    after_tick,
    open_session,
    plan_tick,
)
from kv_transfer.segments import KVSegment


@dataclass(frozen=True)
class FakeSeg:
    token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return 4 * len(self.token_ids)

    def slice(self, a: int, b: int) -> FakeSeg:
        return FakeSeg(self.token_ids[a:b])


def spec(mode: str = "bounded", s: int = 4, w: int = 8, max_tokens: int = 3) -> SessionSpec:
    return SessionSpec(session_id="s1", mode=mode, sink_tokens=s, window_tokens=w, max_tokens=max_tokens, salt="rt-x")  # type: ignore[arg-type]


def captured_for(plan: TickPlan, make=FakeSeg) -> tuple:
    """What the connector captures: one segment per range, holding exactly those prompt tokens."""
    return tuple(make(plan.prompt[a:b]) for a, b in plan.capture)


def check_plan_like_the_connector(plan: TickPlan) -> None:
    injected = tuple(t for seg in plan.inject for t in seg.token_ids)
    assert plan.prompt[: len(injected)] == injected, "injected KV must hold the prompt's first tokens"
    assert len(injected) < len(plan.prompt), "at least one prompt token is computed"
    assert plan.computed_tokens == len(plan.prompt) - len(injected)
    for a, b in plan.capture:
        assert 0 <= a < b <= len(plan.prompt)


class Tokens:
    """Distinct token ids, so a window that holds the wrong tokens cannot pass by accident."""

    def __init__(self) -> None:
        self._next = itertools.count(100)

    def take(self, n: int) -> tuple[int, ...]:
        return tuple(next(self._next) for _ in range(n))


def run_tick(state: SessionState, new_input: tuple[int, ...], reply: tuple[int, ...]) -> tuple[TickPlan, SessionState]:
    plan = plan_tick(state, new_input)
    check_plan_like_the_connector(plan)
    nxt = after_tick(state, plan, captured_for(plan), reply)
    nxt.check_integrity()
    return plan, nxt


# ---- bounded ------------------------------------------------------------------------------------


def test_open_session_splits_the_preamble_into_sink_and_pending() -> None:
    st = open_session(spec(s=4), (1, 2, 3, 4, 5, 6))
    assert st.sink == (1, 2, 3, 4) and st.pending == (5, 6) and st.window == () and st.ticks == 0
    assert st.sink_kv is None and st.window_kv is None
    short = open_session(spec(s=4), (1, 2))
    assert short.sink == (1, 2) and short.pending == ()
    st.check_integrity()


def test_first_bounded_tick_computes_everything_and_captures_sink_and_rest() -> None:
    st = open_session(spec(s=4, w=8), (1, 2, 3, 4, 5, 6))
    plan = plan_tick(st, (7, 8, 9))
    assert plan.prompt == (1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert plan.inject == ()
    assert plan.computed_tokens == 9
    assert plan.capture == ((0, 4), (4, 9))
    assert plan.new_tokens == (5, 6, 7, 8, 9)
    nxt = after_tick(st, plan, captured_for(plan), (50, 51))
    assert nxt.sink_kv.token_ids == (1, 2, 3, 4)
    assert nxt.window == (5, 6, 7, 8, 9) and nxt.window_kv.token_ids == (5, 6, 7, 8, 9)
    assert nxt.pending == (50, 51) and nxt.ticks == 1
    nxt.check_integrity()


def test_later_ticks_inject_sink_and_window_and_compute_only_pending_plus_input() -> None:
    st = open_session(spec(s=4, w=8), (1, 2, 3, 4, 5, 6))
    _, st = run_tick(st, (7, 8, 9), (50, 51))
    plan = plan_tick(st, (60, 61, 62))
    assert plan.inject == (st.sink_kv, st.window_kv)
    assert plan.prompt == (1, 2, 3, 4) + (5, 6, 7, 8, 9) + (50, 51, 60, 61, 62)
    assert plan.new_tokens == (50, 51, 60, 61, 62)
    assert plan.computed_tokens == 5  # pending (last reply) + this tick's input only
    assert plan.capture == ((4, len(plan.prompt)),)  # the sink is not captured again
    check_plan_like_the_connector(plan)
    nxt = after_tick(st, plan, captured_for(plan), (70,))
    assert nxt.sink_kv is st.sink_kv  # kept from the first tick
    # the window is the last W=8 tokens of window + new, and its KV is the matching slice
    assert nxt.window == (5, 6, 7, 8, 9, 50, 51, 60, 61, 62)[-8:]
    assert nxt.window_kv.token_ids == nxt.window
    assert nxt.pending == (70,)


def test_window_slice_comes_from_the_tail_of_the_capture_with_real_kv_segments() -> None:
    """With real KVSegments: the window's keys are the capture's last W rows, not its first."""
    st = open_session(spec(s=2, w=3), (1, 2, 3))

    def seg(ids: tuple[int, ...]) -> KVSegment:
        k = torch.tensor(ids, dtype=torch.float32).view(1, len(ids), 1, 1)
        return KVSegment(tuple(ids), k, k.clone())

    plan = plan_tick(st, (4, 5, 6, 7))
    st = after_tick(st, plan, captured_for(plan, seg), ())
    assert st.window == (5, 6, 7)
    assert st.window_kv.keys.flatten().tolist() == [5.0, 6.0, 7.0]
    assert st.sink_kv.keys.flatten().tolist() == [1.0, 2.0]
    st.check_integrity()


def test_prompt_stays_bounded_for_200_ticks() -> None:
    S, W, reply_len, input_len = 4, 16, 3, 5
    tok = Tokens()
    st = open_session(spec(s=S, w=W, max_tokens=reply_len), tok.take(10))
    sink = st.sink
    prompts, computed = [], []
    for _ in range(200):
        new_count = len(st.pending) + input_len
        plan, st = run_tick(st, tok.take(input_len), tok.take(reply_len))
        assert len(plan.prompt) <= S + W + new_count
        assert len(st.window) <= W
        assert st.sink == sink  # the true first tokens, kept for life
        assert st.history == ()
        prompts.append(len(plan.prompt))
        computed.append(plan.computed_tokens)
    # constant work per tick once the window is full
    assert set(prompts[5:]) == {S + W + reply_len + input_len}
    assert set(computed[1:]) == {reply_len + input_len}
    assert st.ticks == 200


def test_sink_zero_never_captures_or_injects_a_sink() -> None:
    st = open_session(spec(s=0, w=6), (1, 2, 3))
    assert st.sink == () and st.pending == (1, 2, 3)
    plan = plan_tick(st, (4, 5))
    assert plan.capture == ((0, 5),) and plan.inject == () and plan.computed_tokens == 5
    st = after_tick(st, plan, captured_for(plan), (9,))
    assert st.sink_kv is None and st.window == (1, 2, 3, 4, 5)
    for i in range(20):
        plan, st = run_tick(st, (10 + i, 40 + i), (80 + i,))
        assert plan.inject == (plan.inject[0],) and plan.inject[0].token_ids == plan.prompt[: len(plan.inject[0].token_ids)]
        assert plan.capture == ((0, len(plan.prompt)),)
        assert plan.computed_tokens == 3
        assert st.sink_kv is None and len(st.window) <= 6


def test_bounded_tick_without_new_tokens_raises() -> None:
    st = open_session(spec(s=4, w=8), (1, 2, 3, 4))  # the whole preamble is sink: nothing pending
    with pytest.raises(ValueError, match="at least one new token"):
        plan_tick(st, ())
    _, st = run_tick(st, (5,), ())  # an empty reply leaves nothing pending
    with pytest.raises(ValueError):
        plan_tick(st, ())


def test_lost_kv_makes_the_next_tick_recompute_and_capture_again() -> None:
    st = open_session(spec(s=4, w=8), (1, 2, 3, 4, 5, 6))
    _, st = run_tick(st, (7, 8), (20,))
    plan = plan_tick(st, (30, 31))
    assert plan.inject  # the normal path injects
    lost = after_lost_kv(st, plan, (40,))
    lost.check_integrity()
    assert lost.sink_kv is None and lost.window_kv is None
    assert lost.window == (5, 6, 7, 8, 20, 30, 31) and lost.pending == (40,)
    # the tokens moved on exactly as after a successful tick
    ok = after_tick(st, plan, captured_for(plan), (40,))
    assert (lost.sink, lost.window, lost.pending) == (ok.sink, ok.window, ok.pending)
    again = plan_tick(lost, (50,))
    assert again.inject == ()
    assert again.computed_tokens == len(again.prompt) == 4 + 7 + 2
    assert again.capture == ((0, 4), (4, len(again.prompt)))
    recovered = after_tick(lost, again, captured_for(again), (60,))
    recovered.check_integrity()
    assert recovered.sink_kv.token_ids == (1, 2, 3, 4) and recovered.window_kv.token_ids == recovered.window
    nxt = plan_tick(recovered, (70,))
    assert nxt.inject == (recovered.sink_kv, recovered.window_kv)  # back on the injecting path


def test_each_tick_has_its_own_prefix_cache_salt_even_after_lost_kv() -> None:
    """Bounded ticks inject re-rotated (approximate) KV; per-tick salts keep one tick's cached
    blocks from ever serving another tick. A lost capture must not restart the numbering."""
    st = open_session(spec(s=2, w=4), (1, 2, 3))
    salts = []
    for i in range(6):
        plan = plan_tick(st, (10 + i,))
        salts.append(plan.salt)
        if i == 2:
            st = after_lost_kv(st, plan, (20 + i,))
        else:
            st = after_tick(st, plan, captured_for(plan), (20 + i,))
    assert all(s.startswith("rt-x") for s in salts)
    assert len(set(salts)) == len(salts), salts


# ---- unbounded ----------------------------------------------------------------------------------


def test_unbounded_sends_the_whole_history_and_grows() -> None:
    st = open_session(spec("unbounded"), (1, 2, 3, 4, 5, 6))
    assert st.sink == () and st.pending == (1, 2, 3, 4, 5, 6)
    seen: tuple[int, ...] = ()
    lengths = []
    for i in range(10):
        inp, reply = (100 + i, 200 + i), (300 + i,)
        plan = plan_tick(st, inp)
        assert plan.inject == () and plan.capture == ()
        assert plan.salt == "rt-x"  # one salt for the session: the prefix cache keeps the past
        assert plan.prompt == seen + st.pending + inp
        assert plan.computed_tokens == len(st.pending) + len(inp)
        st = after_tick(st, plan, (), reply)
        st.check_integrity()
        seen = plan.prompt
        lengths.append(len(plan.prompt))
    assert lengths == [8] + [8 + 3 * i for i in range(1, 10)]
    assert st.history == seen and st.pending == (309,)
    lost = after_lost_kv(st, plan_tick(st, (1,)), (2,))
    assert lost.history == st.history + (309, 1) and lost.pending == (2,)


# ---- integrity ----------------------------------------------------------------------------------


def test_check_integrity_catches_broken_states() -> None:
    st = open_session(spec(s=2, w=3), (1, 2))
    good = replace(st, window=(5, 6, 7), window_kv=FakeSeg((5, 6, 7)), sink_kv=FakeSeg((1, 2)))
    good.check_integrity()
    with pytest.raises(AssertionError, match="bound"):
        replace(good, window=(4, 5, 6, 7), window_kv=FakeSeg((4, 5, 6, 7))).check_integrity()
    with pytest.raises(AssertionError, match="bound"):
        replace(good, sink=(1, 2, 3), sink_kv=None).check_integrity()
    with pytest.raises(AssertionError, match="KV"):
        replace(good, window_kv=FakeSeg((5, 6, 8))).check_integrity()
    with pytest.raises(AssertionError, match="KV"):
        replace(good, sink_kv=FakeSeg((2, 1))).check_integrity()
    with pytest.raises(AssertionError, match="history"):
        replace(good, history=(1,)).check_integrity()


def test_lost_kv_with_sink_zero_recomputes_the_window() -> None:
    st = open_session(spec(s=0, w=4), (1, 2))
    _, st = run_tick(st, (3,), (4,))
    plan = plan_tick(st, (5,))
    assert plan.inject == (st.window_kv,)
    lost = after_lost_kv(st, plan, (6,))
    again = plan_tick(lost, (7,))
    assert again.inject == () and again.capture == ((0, len(again.prompt)),)
    assert again.prompt == (2, 3, 4, 5, 6, 7) and again.computed_tokens == 6
    st = after_tick(lost, again, captured_for(again), ())
    st.check_integrity()
    assert st.window == (4, 5, 6, 7) and st.window_kv.token_ids == (4, 5, 6, 7)
