"""Adaptive chat admission (router/chat_admission.py): the limit grows under the TTFT target while
it binds, shrinks multiplicatively over it, stays in [min_limit, cap], judges a windowed
percentile, and holds where it must (too few samples, idle, draining, pool queueing). Pure; no
clock but the one passed in."""
from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from deployments.config import IngressConfig
from router.chat_admission import ChatAdmissionConfig, ChatLimiter, nearest_rank, released_sample

CFG = ChatAdmissionConfig(mode="adaptive", ttft_target_s=1.0, initial_limit=4, min_limit=1, additive_step=1,
                          multiplicative_factor=0.5, control_period_s=1.0, window_s=10.0, min_samples=3)


def limiter(cap: int = 16, **changes: object) -> ChatLimiter:
    return ChatLimiter(CFG.model_copy(update=changes), cap, now=0.0)


def period(c: ChatLimiter, now: float, ttft: float, n: int = 3, inflight: int | None = None, queueing: bool = False,
           others: int = 0) -> str:
    """One control period under load: the limit binds, n requests report `ttft` (each sharing the
    engines with this ingress's `busy` and `others` of other ingresses), the law runs."""
    busy = c.limit if inflight is None else inflight
    c.admit(c.limit)  # one more client than the limit lets in: refused, so the limit binds
    for _ in range(n):
        c.observe(ttft, now - 0.5, max(1, busy + others), others)
    d = c.update(now, busy, queueing)
    c.check_integrity()
    return f"{d.action}:{d.reason}:{d.limit_before}->{d.limit_after}"


def test_the_limit_grows_additively_while_on_target_and_binding() -> None:
    c = limiter()
    assert [period(c, t, 0.4) for t in (1.0, 2.0, 3.0)] == [
        "increase:on_target:4->5", "increase:on_target:5->6", "increase:on_target:6->7"]


def test_the_limit_shrinks_multiplicatively_over_target() -> None:
    c = limiter(initial_limit=12)
    assert period(c, 1.0, 1.5) == "decrease:overshoot:12->6"
    assert period(c, 2.0, math.inf) == "decrease:overshoot:6->3"


def test_never_below_the_floor_nor_above_the_cap() -> None:
    c = limiter(initial_limit=5, min_limit=2)
    assert [period(c, t, 9.0) for t in (1.0, 2.0, 3.0)] == [
        "decrease:overshoot:5->2", "hold:at_limit:2->2", "hold:at_limit:2->2"]
    c = limiter(cap=6)
    assert [period(c, t, 0.1) for t in (1.0, 2.0, 3.0)] == [
        "increase:on_target:4->5", "increase:on_target:5->6", "hold:at_limit:6->6"]
    assert ChatLimiter(CFG.model_copy(update={"initial_limit": 50}), 8).limit == 8  # the initial limit is clipped to the cap
    with pytest.raises(ValueError, match="below min_limit"):
        ChatLimiter(CFG.model_copy(update={"min_limit": 4}), 3)


def test_an_idle_ingress_does_not_raise_its_limit() -> None:
    c = limiter()
    for _ in range(3):
        c.observe(0.1, 0.5)
    c.admit(1)  # 1 in flight, limit 4: far from binding
    assert c.update(1.0, 1).reason == "not_binding" and c.limit == 4
    assert c.admit(3)  # this request takes the last slot: admitted, and no demand beyond the limit yet
    for _ in range(3):
        c.observe(0.1, 1.5, 4)
    assert c.update(2.0, 3).reason == "not_binding" and c.limit == 4
    assert not c.admit(4)  # refused: there was more demand than the limit let in
    for _ in range(3):
        c.observe(0.1, 2.5, 4)
    assert c.update(3.0, 4).action == "increase" and c.limit == 5


def test_one_request_at_a_time_never_raises_a_limit_of_one() -> None:
    """A sequential client (a calibration, a lone user) takes the last slot of a limit of 1 on
    every request, but never asks for a second: the limit stays 1."""
    c = limiter(initial_limit=1)
    for t in range(1, 11):
        assert c.admit(0)
        c.observe(0.1, t - 0.5, 1)
        assert c.update(float(t), 0).reason in ("not_binding", "too_few_samples")
    assert c.limit == 1


def test_too_few_samples_and_an_unfinished_period_hold() -> None:
    c = limiter()
    assert period(c, 1.0, 5.0, n=2) == "hold:too_few_samples:4->4"
    c.observe(5.0, 1.2)
    assert c.update(1.5, 4).reason == "period_not_elapsed"
    assert c.update(2.0, 4).action == "decrease"  # three misses in the window now


def test_the_window_drops_old_samples_and_resets_when_the_limit_moves() -> None:
    c = limiter(window_s=5.0)
    c.admit(3)
    for t in (0.2, 0.3, 0.4):
        c.observe(3.0, t)  # misses, but they expire before the next evaluation
    assert c.window(1.0) == [3.0, 3.0, 3.0]
    for t in (6.0, 6.1, 6.2):
        c.observe(0.2, t, 4)
    c.admit(4)  # refused: binding
    assert c.update(6.5, 4).action == "increase"  # the misses at t < 1.5 are out of the 5 s window
    assert c.window(6.5) == []  # the change reset the window: the next decision sees only the new limit
    c.observe(9.0, 6.4)  # reported late, observed before the reset: ignored
    assert c.window(6.6) == []


@pytest.mark.parametrize("percentile,action", [(0.5, "increase"), (0.99, "decrease")])
def test_the_judged_latency_is_the_windows_percentile(percentile: float, action: str) -> None:
    c = limiter(percentile=percentile)
    c.admit(4)  # refused: binding
    for ttft in (0.2, 0.3, 0.4, 0.5, 4.0):  # one slow request in five, each beside the 3 others in flight
        c.observe(ttft, 0.5, 4)
    assert c.update(1.0, 4).action == action
    assert nearest_rank([0.2, 0.3, 0.4, 0.5, 4.0], 0.5) == 0.4 and nearest_rank([1.0, math.inf], 0.99) == math.inf


def test_draining_holds_while_more_are_in_flight_than_the_limit() -> None:
    c = limiter(initial_limit=8)
    assert period(c, 1.0, 3.0) == "decrease:overshoot:8->4"
    assert period(c, 2.0, 3.0, inflight=7) == "hold:draining:4->4"  # the 8 admitted before are still running
    assert period(c, 3.0, 3.0, inflight=4) == "decrease:overshoot:4->2"


def test_a_queueing_pool_stops_growth_but_not_shrinking() -> None:
    c = limiter()
    assert period(c, 1.0, 0.3, queueing=True) == "hold:pool_queueing:4->4"
    assert period(c, 2.0, 0.3, queueing=False) == "increase:on_target:4->5"
    assert period(c, 3.0, 2.0, queueing=True) == "decrease:overshoot:5->2"


def test_latencies_from_before_a_burst_do_not_justify_growing_in_it() -> None:
    """Requests sent one at a time (fast: nothing shares the engines) and then a burst: the first
    decision under the burst's refusals must not grow on the quiet requests' TTFTs."""
    c = limiter(initial_limit=1)
    for t in range(1, 6):
        c.admit(0)
        c.observe(0.3, t - 0.5, 1)
        c.update(float(t), 0)
    assert not c.admit(1)  # the burst: refused
    d = c.update(6.0, 1)
    assert (d.action, d.reason) == ("hold", "too_few_samples") and c.limit == 1
    for _ in range(3):
        c.observe(0.45, 6.5, 1)  # at the limit, under the burst: 0.45 x 2 = 0.9 <= 1
    c.admit(1)
    assert c.update(7.0, 1).action == "increase"


def test_refused_requests_give_no_sample() -> None:
    c = limiter(initial_limit=2)
    assert c.admit(0) and c.admit(1)  # the second takes the last slot
    assert not c.admit(2) and not c.admit(2)  # refused: only the binding flag changes (twice: still one flag)
    assert c.window(1.0) == []
    assert c.update(1.0, 2).reason == "too_few_samples"


def run_curve(c: ChatLimiter, periods: int = 60) -> tuple[list[int], list[float]]:
    """TTFT = 0.3 s x requests in flight (a CPU shared by every admitted prefill), the limit
    always binding, three requests per period; returns the limit and the TTFT of each period."""
    limits, ttfts = [], []
    for t in range(1, periods + 1):
        ttft = 0.3 * c.limit
        period(c, float(t), ttft)
        limits.append(c.limit)
        ttfts.append(ttft)
    return limits, ttfts


def test_with_headroom_the_limit_settles_under_the_knee_and_stays_on_target() -> None:
    """Target 1.0 s: the knee is N* = 3 (0.9 s; 4 would be 1.2 s). Started at the cap it halves
    down to 2, grows to 3 (0.6 x 3/2 = 0.9 predicted), and holds there: 0.9 x 4/3 = 1.2 > 1."""
    limits, ttfts = run_curve(limiter(cap=32, initial_limit=32))
    assert limits[:6] == [16, 8, 4, 2, 3, 3] and set(limits[5:]) == {3}
    assert all(t <= 1.0 for t in ttfts[4:])


def test_without_headroom_it_probes_over_the_knee_in_a_sawtooth() -> None:
    limits, ttfts = run_curve(limiter(cap=32, initial_limit=32, growth_headroom=False))
    assert set(limits[5:]) == {2, 3, 4}  # 2 -> 3 -> 4 (over: 1.2 s) -> 2 ...
    over = sum(t > 1.0 for t in ttfts[5:]) / len(ttfts[5:])
    assert 0.25 <= over <= 0.4  # one period in three runs over the target


def test_another_ingresss_requests_count_against_the_headroom() -> None:
    """Two ingress replicas share engines where TTFT = 0.3 s x every request in flight; target
    1.0 s, so the pools' knee is 3. The other ingress holds 2: this one, at 1, stays there
    (0.3 x (1 + 1 + 2) = 1.2 > 1)."""
    c = limiter(cap=8, initial_limit=1)
    for t in range(1, 11):
        assert period(c, float(t), 0.3 * (c.limit + 2), others=2) == "hold:no_headroom:1->1"


@pytest.mark.parametrize("beside_another", [True, False])
def test_a_busy_other_ingress_seen_once_in_the_window_holds_growth(beside_another: bool) -> None:
    """0.4 s per request in flight, target 1.0 s. Two samples ran alone (the other ingress was
    idle then); if a third ran beside one of the other ingress's requests, the other ingress is
    known to send requests: 0.4 x (1 + 1 + 1) = 1.2 > 1, hold. Without it, 0.4 x 2 = 0.8: grow."""
    c = limiter(cap=8, initial_limit=1)
    c.admit(1)  # refused: binding
    c.observe(0.4, 0.2, 1, 0)
    c.observe(0.4, 0.3, 1, 0)
    c.observe(0.8, 0.4, 2, 1) if beside_another else c.observe(0.4, 0.4, 1, 0)
    d = c.update(1.0, 1)
    assert (d.action, d.reason) == (("hold", "no_headroom") if beside_another else ("increase", "on_target"))
    c.check_integrity()


def test_a_sample_needs_a_concurrency_of_at_least_one() -> None:
    with pytest.raises(ValueError):
        limiter().observe(0.1, 0.5, 0)
    with pytest.raises(ValueError):
        limiter().observe(0.1, 0.5, 1, -1)


def test_headroom_does_not_slow_growth_far_under_the_target() -> None:
    c = limiter(cap=64, initial_limit=1)
    for t in range(1, 21):
        period(c, float(t), 0.05)  # a GPU below its knee: TTFT flat and small
    assert c.limit == 21


def test_released_sample_rules() -> None:
    assert released_sample(0.4, 200, 1.0) == 0.4  # an empty answer: served, with no token
    assert released_sample(0.4, 400, 1.0) is None and released_sample(0.1, 404, 1.0) is None  # the request's own fault
    assert released_sample(0.1, 503, 1.0) == math.inf and released_sample(0.1, 500, 1.0) == math.inf  # a failure is a miss
    assert released_sample(0.1, 429, 1.0) == math.inf
    assert released_sample(0.5, 499, 1.0) is None and released_sample(0.5, None, 1.0) is None  # client left early: unknown
    assert released_sample(2.5, 499, 1.0) == 2.5 and released_sample(2.5, None, 1.0) == 2.5  # client left late: a miss


def test_config_forbids_unknown_fields_and_checks_bounds() -> None:
    assert ChatAdmissionConfig().mode == "fixed"
    with pytest.raises(ValidationError, match="ttft_target"):
        ChatAdmissionConfig(ttft_target=1.0)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="min_limit"):
        ChatAdmissionConfig(min_limit=5, initial_limit=2)
    with pytest.raises(ValidationError, match="window_s"):
        ChatAdmissionConfig(window_s=1.0, control_period_s=2.0)
    with pytest.raises(ValidationError, match="multiplicative_factor"):
        ChatAdmissionConfig(multiplicative_factor=1.0)
    with pytest.raises(ValidationError, match="min_limit"):
        IngressConfig(max_inflight_requests=2, admission={"mode": "adaptive", "min_limit": 3, "initial_limit": 3})
    cfg = IngressConfig(max_inflight_requests=8, admission={"mode": "adaptive", "ttft_target_s": 2.5})
    assert cfg.admission.mode == "adaptive" and cfg.admission.ttft_target_s == 2.5
