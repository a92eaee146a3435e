"""What a replica counts for the cliff predictor (baton/engine/realtime/growth.py and
RealtimeSessions.token_growth): retained history tokens of completed ticks (whole KV blocks
when the engine's block size is known), every block of a tick in flight, and growth
offered (tick period) vs served (measured). Pure, plus the manager over the fake runner."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_realtime_manager import FakeRunner, empty_segment_table

from baton.engine.realtime.growth import STALE_PERIODS, SessionGrowth, in_flight_tokens, retained_tokens, session_growth, total_growth
from baton.engine.realtime.manager import RealtimeSessions
from baton.engine.realtime.messages import RealtimeOpen, RealtimeTick
from baton.engine.realtime.session import SessionSpec, open_session

__all__ = ["empty_segment_table"]  # the fixture, used by name


def test_a_session_keeping_time_grows_at_its_appended_tokens_per_period() -> None:
    # 4 ticks of 40 tokens, one every 8 s, each done 1 s after its send
    points = [(1.0 + 8 * i, 100 + 40 * i) for i in range(5)]
    g = session_growth(points, tick_s=8.0, now=34.0, opened_at=0.0)
    assert g.retained_tokens == 260
    assert g.offered_tokens_per_s == pytest.approx(5.0) and g.served_tokens_per_s == pytest.approx(5.0)


def test_a_session_the_engine_cannot_keep_up_with_is_served_slower_than_it_offers() -> None:
    points = [(0.0, 100), (20.0, 140), (40.0, 180)]  # ticks of period 8 s completing every 20 s
    g = session_growth(points, tick_s=8.0, now=41.0, opened_at=0.0)
    assert g.offered_tokens_per_s == pytest.approx(5.0) and g.served_tokens_per_s == pytest.approx(2.0)


def test_without_a_declared_period_the_measured_one_is_used() -> None:
    g = session_growth([(0.0, 0), (4.0, 20), (8.0, 40)], tick_s=None, now=9.0, opened_at=0.0)
    assert g.offered_tokens_per_s == pytest.approx(5.0) == g.served_tokens_per_s


def test_a_silent_session_keeps_its_tokens_but_does_not_grow() -> None:
    points = [(0.0, 100), (8.0, 140)]
    assert session_growth(points, 8.0, now=8.0 + STALE_PERIODS * 8.0, opened_at=0.0).offered_tokens_per_s > 0
    silent = session_growth(points, 8.0, now=8.0 + STALE_PERIODS * 8.0 + 0.1, opened_at=0.0)
    assert silent == SessionGrowth(140, 0.0, 0.0)


def test_warming_sessions_count_at_the_mean_rate_of_the_growing_ones() -> None:
    growing = [SessionGrowth(200, 5.0, 4.0), SessionGrowth(300, 3.0, 3.0)]
    warming = session_growth([(1.0, 50)], 8.0, now=2.0, opened_at=0.0)  # one tick done: no rate of its own yet
    assert warming.warming and warming.retained_tokens == 50
    total = total_growth([*growing, warming, session_growth((), 8.0, now=2.0, opened_at=1.0)])
    assert total.sessions == 4 and total.growing_sessions == 4 and total.retained_tokens == 550
    assert total.offered_tokens_per_s == pytest.approx(8.0 * 2) and total.served_tokens_per_s == pytest.approx(7.0 * 2)
    alone = total_growth([warming])  # nobody has a rate yet: no growth to borrow
    assert alone.offered_tokens_per_s == 0.0 and alone.growing_sessions == 0
    bounded = session_growth([(1.0, 0)], 8.0, now=2.0, opened_at=0.0, retains=False)
    assert not bounded.warming


def test_the_manager_counts_unbounded_history_and_nothing_for_bounded_sessions() -> None:
    runner = FakeRunner(reply_len=2)
    rs = RealtimeSessions(runner)
    for sid, mode in (("u", "unbounded"), ("b", "bounded")):
        rs.open(RealtimeOpen(sid, mode, (1, 2, 3, 4), sink_tokens=2, window_tokens=6, max_tokens=2, tick_s=8.0))  # type: ignore[arg-type]

    async def ticks() -> None:
        for seq in range(3):
            for sid in ("u", "b"):
                await rs.tick(RealtimeTick(sid, seq, (10 + seq, 20 + seq)))

    asyncio.run(ticks())
    # unbounded history after 3 ticks: preamble 4 + (2 input) + (2 reply + 2 input) x 2 = 14 tokens;
    # the last reply is pending (not in the pool yet)
    assert len(rs._live["u"].state.history) == 14
    g = rs.token_growth()
    assert g.sessions == 2 and g.retained_tokens == 14 and g.growing_sessions == 1
    # 8 tokens over 2 ticks of a declared 8 s period; served: the same tokens over the few ms they took
    assert g.offered_tokens_per_s == pytest.approx(8 / 16)
    assert g.served_tokens_per_s > g.offered_tokens_per_s
    rs.close("u")
    assert rs.token_growth().retained_tokens == 0
    # with the engine's block size known, only whole blocks count: the prefix cache keeps a finished
    # tick's full blocks of prompt + reply (its last token has no KV yet), not its partial tail block
    runner.stats = dataclasses.replace(runner.stats, kv_block_tokens=4)
    assert rs.token_growth().retained_tokens == 0  # "u" closed above; "b" keeps nothing between ticks


def test_retained_tokens_count_whole_blocks_of_what_the_last_tick_computed() -> None:
    spec = SessionSpec(session_id="u", mode="unbounded", sink_tokens=2, window_tokens=6, max_tokens=2, salt="s")
    fresh = open_session(spec, (1, 2, 3, 4))
    assert retained_tokens(fresh, 4) == 0 == retained_tokens(fresh)  # no tick yet: nothing in the pool
    state = dataclasses.replace(fresh, history=tuple(range(14)), pending=(7, 8), ticks=3)
    assert retained_tokens(state) == 14  # block size unknown: the whole history
    assert retained_tokens(state, 4) == 12  # 14 + 2 − 1 = 15 computed tokens: 3 whole blocks of 4
    assert retained_tokens(state, 5) == 15  # exactly 3 blocks of 5
    assert retained_tokens(state, 128) == 0  # all of it in one partial block, which is not kept
    bounded = open_session(dataclasses.replace(spec, mode="bounded"), (1, 2, 3, 4))
    assert retained_tokens(bounded, 4) == 0


def test_the_manager_reports_the_pool_figure_and_keeps_the_rates_of_whole_histories() -> None:
    runner = FakeRunner(reply_len=2)
    rs = RealtimeSessions(runner)
    rs.open(RealtimeOpen("u", "unbounded", (1, 2, 3, 4), sink_tokens=2, window_tokens=6, max_tokens=2, tick_s=8.0))  # type: ignore[arg-type]

    async def ticks() -> None:
        for seq in range(3):
            await rs.tick(RealtimeTick("u", seq, (10 + seq, 20 + seq)))

    asyncio.run(ticks())
    whole = rs.token_growth(block_tokens=0)
    runner.stats = dataclasses.replace(runner.stats, kv_block_tokens=4)
    blocks = rs.token_growth()  # the engine's own block size
    assert (whole.retained_tokens, blocks.retained_tokens) == (14, 12)
    assert rs.token_growth(block_tokens=0).retained_tokens == 14  # an explicit 0 overrides the engine's
    assert blocks.offered_tokens_per_s == pytest.approx(whole.offered_tokens_per_s) == pytest.approx(8 / 16)


def test_a_tick_in_flight_holds_every_block_of_its_request_partial_tail_included() -> None:
    assert in_flight_tokens(0, 128) == 0
    assert in_flight_tokens(1, 128) == 128  # one token still takes a whole block
    assert in_flight_tokens(128, 128) == 128 and in_flight_tokens(129, 128) == 256
    assert in_flight_tokens(129) == 129  # block size unknown: the tokens themselves


def test_the_manager_counts_the_blocks_of_ticks_the_engine_is_running() -> None:
    runner = FakeRunner(reply_len=3, delay_s=0.05)
    rs = RealtimeSessions(runner)  # blocks of 4 tokens (the fake engine's stats do not say)
    for sid, mode in (("u", "unbounded"), ("b", "bounded")):
        rs.open(RealtimeOpen(sid, mode, (1, 2, 3, 4), sink_tokens=2, window_tokens=6, max_tokens=3, tick_s=8.0))  # type: ignore[arg-type]
    seen: dict[str, int] = {}

    async def run() -> None:
        await rs.tick(RealtimeTick("u", 0, (10, 11)))  # u: 6 prompt + 3 reply, the last pending: 8 computed, 2 blocks
        seen["between"] = rs.token_growth(block_tokens=4).retained_tokens
        seen["between_completed"] = rs.token_growth(block_tokens=4, in_flight=False).retained_tokens
        ticks = [asyncio.create_task(rs.tick(RealtimeTick(sid, 1, (20, 21, 22)))) for sid in ("u", "b")]
        await asyncio.sleep(0.09)  # both ticks running, one reply token each so far (the second comes at >= 0.1 s)
        seen["during"] = rs.token_growth(block_tokens=4).retained_tokens
        seen["during_completed"] = rs.token_growth(block_tokens=4, in_flight=False).retained_tokens
        seen["during_whole_tokens"] = rs.token_growth(block_tokens=0).retained_tokens
        await asyncio.gather(*ticks)
        seen["after"] = rs.token_growth(block_tokens=4).retained_tokens

    asyncio.run(run())
    assert seen["between"] == seen["between_completed"] == 8
    u_prompt = 6 + 3 + 3  # history 6 + pending reply 3 + new input 3
    b_prompt = len(runner.calls[-1].request.prompt_token_ids)  # bounded: preamble + its new input
    # running: u's 12-token prompt + 1 reply token = 13 -> 4 blocks of 4; b's prompt + 1 -> its blocks
    assert seen["during"] == 16 + in_flight_tokens(b_prompt + 1, 4)
    assert seen["during_completed"] == 8  # the ablation: completed ticks only, as between ticks
    assert seen["during_whole_tokens"] == u_prompt + 1 + b_prompt + 1
    # both done: u's 12 prompt + 3 reply − 1 pending = 14 computed -> 3 whole blocks; b nothing
    assert seen["after"] == 12
