"""The ConServe bench's load and layout (baton/bench/conserve_load.py, baton/bench/conserve.py):
Poisson arrivals, the interleaved order, distinct conversations per level, the duration
estimate, the open-loop driver against a fake OpenAI server (httpx.MockTransport), and the
equal-hardware layouts as valid Baton configs. No engine, no Ray."""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton.bench import conserve
from baton.bench.conserve_load import ConversationRun, estimate_level_s, interleaved, poisson_arrivals, run_open_loop, split_levels
from baton.bench.conserve_stats import level_figures
from baton.traces.format import Conversation, Turn
from deployments.config import load_app_config

# ---- arrivals, order, levels ---------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_start_at_zero_and_have_the_rate() -> None:
    a = poisson_arrivals(2000, 2.0, seed=7)
    assert a == poisson_arrivals(2000, 2.0, seed=7) and a != poisson_arrivals(2000, 2.0, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:], strict=False))
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.08)  # mean 1/rate
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.12)  # exponential: sd = mean
    assert poisson_arrivals(0, 1.0, 0) == []
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0, 0)


def test_repetitions_interleave_the_policies() -> None:
    assert interleaved(["A", "B", "C", "D"], 3) == [(r, p) for r in range(3) for p in "ABCD"]
    assert [p for _, p in interleaved(["A", "B"], 2)] == ["A", "B", "A", "B"]
    with pytest.raises(ValueError):
        interleaved(["A", "A"], 1)
    with pytest.raises(ValueError):
        interleaved(["A"], 0)


def conv(cid: str, think: float = 0.0, turns: int = 2) -> Conversation:
    return Conversation(conversation_id=cid, system="SYS", turns=[
        Turn(role="user" if i % 2 == 0 else "tool", content=f"m{i}", effective=i % 2 == 1, think_time_s=think, max_tokens=4)
        for i in range(turns)])


def test_levels_get_distinct_conversations_and_a_tenant_each() -> None:
    convs = [conv(f"c{i}") for i in range(7)]
    levels = split_levels(convs, 3, 2)
    assert [[c.conversation_id for c in lv] for lv in levels] == [["c0", "c1"], ["c2", "c3"], ["c4", "c5"]]
    assert [{c.user for c in lv} for lv in levels] == [{"load0"}, {"load1"}, {"load2"}]
    assert convs[0].user == "anonymous"  # the trace itself is left as it was
    with pytest.raises(ValueError, match="need 8"):
        split_levels(convs, 4, 2)


def test_the_level_estimate_is_the_arrival_span_plus_the_longest_conversation() -> None:
    convs = [conv("a", think=1.0, turns=4), conv("b", think=0.0, turns=2)]
    # span (2-1)/0.5 = 2 s; longest: a, think 4 x 1.0 (the first turn's counts too) + 4 turns x 1.5
    assert estimate_level_s(convs, 0.5, None, 1.5) == pytest.approx(2 + 4 + 6)
    assert estimate_level_s(convs, 0.5, 0.1, 1.5) == pytest.approx(2 + 0.4 + 6)


# ---- the open-loop driver -------------------------------------------------------------------------------


class Server:
    """Streams three content chunks 10 ms apart; fails the requests named in `fail` (session, nth) with 503.
    `counted`: the chunks hold 1, 3 and 2 tokens and carry the usage so far (continuous usage), on the
    requests for which it returns True."""

    def __init__(self, fail: set[tuple[str, int]] | None = None, counted: Any = None):
        self.fail = fail or set()
        self.counted = counted or (lambda sid, nth: False)
        self.sent: list[tuple[str, float, dict]] = []

    async def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        sid = request.headers["x-session-id"]
        nth = sum(s == sid for s, _, _ in self.sent)
        self.sent.append((sid, time.perf_counter(), body))
        if (sid, nth) in self.fail:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self._stream(self.counted(sid, nth)))

    async def _stream(self, counted: bool) -> AsyncIterator[bytes]:
        for piece, done in (("a", 1), ("b", 4), ("c", 6)):
            await asyncio.sleep(0.01)
            chunk: dict[str, Any] = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            if counted:
                chunk["usage"] = {"prompt_tokens": 5, "completion_tokens": done}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}\n\ndata: [DONE]\n\n'


def drive(server: Server, convs: list[Conversation], arrivals: list[float], think_s: float | None = None) -> tuple[list[ConversationRun], float]:
    return asyncio.run(run_open_loop(convs, arrivals, "http://fake", think_s=think_s, transport=httpx.MockTransport(server.handler)))


def test_conversations_start_at_their_arrivals_whatever_the_others_do() -> None:
    # bounds that hold on a loaded machine: never early, and b and c start while a is still in
    # its 1 s think time (a closed loop would have waited for a)
    server = Server()
    runs, wall = drive(server, [conv("a", think=1.0), conv("b"), conv("c")], [0.0, 0.05, 0.1])
    firsts = {sid: t for sid, t, _ in reversed(server.sent)}  # each session's first request
    t0 = firsts["a"]
    assert firsts["b"] - t0 >= 0.05 - 0.01 and firsts["c"] - t0 >= 0.1 - 0.01
    assert [r.conversation_id for r in runs] == ["a", "b", "c"] and not any(r.failed for r in runs)
    a_times = [t for sid, t, _ in server.sent if sid == "a"]
    assert a_times[1] - a_times[0] >= 1.0 + 0.03  # the trace's think time after the first reply (~30 ms)
    assert firsts["b"] < a_times[1] and firsts["c"] < a_times[1]
    assert wall >= 1.0
    # every sent turn streamed 3 chunks ~10 ms apart: 2 gaps each
    assert all(len(g) == 2 and all(0.005 < x < 2.0 for x in g) for r in runs for g in r.gaps)
    history = [b for sid, _, b in server.sent if sid == "a"][1]["messages"]
    assert history == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "m0"},
                       {"role": "assistant", "content": "abc"}, {"role": "tool", "content": "m1"}]


def test_with_tokens_per_chunk_the_gaps_are_per_token() -> None:
    """Chunks of 1, 3 and 2 tokens ~10 ms apart: 3 samples of ~1/3 and 2 of ~1/2 of the chunk gap,
    the chunk gaps kept beside them; one reply without counts puts its whole conversation per chunk."""
    server = Server(counted=lambda sid, nth: sid == "a" or nth == 0)
    runs, _ = drive(server, [conv("a"), conv("b")], [0.0, 0.0], think_s=0.0)
    a, b = runs
    for per_token, per_chunk in zip(a.gaps, a.chunk_gaps, strict=True):
        assert len(per_token) == 5 and len(per_chunk) == 2
        assert per_token[:3] == (pytest.approx(per_chunk[0] / 3),) * 3 and per_token[3:] == (pytest.approx(per_chunk[1] / 2),) * 2
    assert b.chunk_gaps is None and all(len(g) == 2 for g in b.gaps)  # b's second reply had no counts
    figs = level_figures([a], 0)
    assert figs.itl_per_token and figs.chunk_gap_p50_s > figs.itl_p50_s > 0
    assert not level_figures([a, b], 0).itl_per_token


def test_a_fixed_think_time_replaces_the_traces() -> None:
    server = Server()
    drive(server, [conv("a", think=5.0)], [0.0], think_s=0.0)  # would take 5 s with the trace's
    assert len(server.sent) == 2


def test_a_failed_turn_ends_its_conversation_and_counts_in_the_figures() -> None:
    server = Server(fail={("b", 0)})
    runs, _ = drive(server, [conv("a"), conv("b"), conv("c")], [0.0, 0.0, 0.0])
    assert [len(r.records) for r in runs] == [2, 1, 2] and [r.failed for r in runs] == [False, True, False]
    assert len([s for s, _, _ in server.sent if s == "b"]) == 1  # nothing sent after the failure
    f = level_figures(runs)
    assert f.failed_conversations == 1 and f.effective_turns == 3 and f.ttfet_p95_s == float("inf")
    assert f.ttfet_p50_s is not None and f.ttfet_p50_s < 1.0  # two of three effective turns succeeded


# ---- the bench's layouts and sizes ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", conserve.POLICIES)
def test_every_layout_is_a_valid_config_on_two_engines_and_two_cores(policy: str) -> None:
    cfg = load_app_config(conserve.pool_args(policy))
    assert cfg.routing.policy == policy and cfg.routing.ownership_db_path == ":memory:"
    pools = [p for p in (cfg.prefill, cfg.decode) if p is not None]
    assert sum(p.num_replicas for p in pools) == 2
    cores = []
    for p in pools:
        per = p.resources.cpu_cores_per_replica or len(p.resources.cpu_cores or ())
        cores += [tuple(p.resources.cpu_cores[i:i + per]) for i in range(0, p.num_replicas * per, per)]  # type: ignore[index]
    assert sorted(cores) == [(0,), (1,)]  # one engine per core
    if policy == "colocated":
        assert cfg.prefill is None and cfg.decode.num_replicas == 2
    else:
        assert cfg.prefill is not None and cfg.prefill.resources.cpu_cores == (0,) and cfg.decode.resources.cpu_cores == (1,)


def test_workloads() -> None:
    q, f = conserve.QUICK, conserve.FULL
    assert q.reps >= 3 and f.reps >= 3 and len(q.rates) == 2 and len(f.rates) == 4
    assert list(q.rates) == sorted(q.rates) and list(f.rates) == sorted(f.rates)
    assert q.max_tokens == 32 and set(conserve.POLICIES) == {"conversation", "per_turn_pd", "conditional_pd", "colocated"}


def test_the_quick_estimate_stays_under_half_an_hour() -> None:
    levels = [[conv(f"l{k}c{i}", think=1.0, turns=4) for i in range(conserve.QUICK.per_level)] for k in range(2)]
    est = conserve.estimate_s(conserve.QUICK, levels)
    per_rep = est / (conserve.QUICK.reps * len(conserve.POLICIES))
    assert per_rep > conserve.START_S + conserve.STOP_S and est < 30 * 60


def test_the_quick_trace_has_distinct_conversations_for_every_level() -> None:
    pytest.importorskip("bfcl_eval")
    trace = conserve.build_trace(conserve.QUICK)
    levels = split_levels(trace, len(conserve.QUICK.rates), conserve.QUICK.per_level)
    ids = [c.conversation_id for lv in levels for c in lv]
    assert len(ids) == len(set(ids)) == 16
    assert all(any(t.effective for t in c.turns) for lv in levels for c in lv)


def test_the_plot_is_drawn_with_failures_and_missing_levels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from baton.bench.conserve_plot import plot
    from baton.bench.conserve_stats import Cell, over_reps

    server = Server(fail={("b", 0)})
    runs, _ = drive(server, [conv("a"), conv("b")], [0.0, 0.0])
    cells = [Cell(0, "conversation", 0.5, level_figures(runs, 1)), Cell(0, "colocated", 0.5, level_figures(runs[:1], 0)),
             Cell(0, "colocated", 1.0, level_figures(runs[:1], 0))]
    path = plot(over_reps(cells), cells, [0.5, 1.0], 3.0, tmp_path / "c.png")
    assert path.stat().st_size > 1000


def test_the_whole_bench_runs_on_fake_clusters_and_writes_strict_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """run() end to end with the clusters, the counters and the network faked: every repetition
    in interleaved order, every level, the JSON (no bare Infinity) and the RESULT line."""
    pytest.importorskip("matplotlib")
    from baton.bench import cluster

    started: list[str] = []

    class FakeApp:
        def __init__(self, args: dict, **_: object):
            started.append(args["routing"]["policy"])

        def __enter__(self) -> cluster.RunningApp:
            return cluster.RunningApp(url="http://fake", start_seconds=1.0, log_path=tmp_path / "log")

        def __exit__(self, *exc: object) -> None:
            pass

    counts = {"n": 0}

    def settled(url: str) -> dict[str, int]:
        counts["n"] += 1
        return {"transfers": counts["n"], "bytes": 0, "planned_handoffs": 0, "prefill_fallback_local": 0, "placed_without_kv_room": 0}

    server = Server(fail={("l1c0", 0)})
    real = conserve.run_open_loop

    async def open_loop(convs: list[Conversation], arrivals: list[float], url: str, **kw: Any) -> tuple[list[ConversationRun], float]:
        return await real(convs, [a / 100 for a in arrivals], url, transport=httpx.MockTransport(server.handler), **kw)

    monkeypatch.setattr(cluster, "LocalServeApp", FakeApp)
    monkeypatch.setattr(conserve, "_settled", settled)
    monkeypatch.setattr(conserve, "run_open_loop", open_loop)
    monkeypatch.setattr(conserve, "build_trace", lambda w: [conv(f"l{k}c{i}") for k in range(2) for i in range(2)])
    monkeypatch.setattr(conserve, "QUICK", conserve.Workload(reps=3, rates=(0.5, 2.0), per_level=2, user_turns=1, max_system_chars=1,
                                                             max_tokens=4, think_s=0.0))
    result = conserve.run(quick=True, out_dir=tmp_path)
    assert started == list(conserve.POLICIES) * 3
    doc = json.loads((tmp_path / "conserve.json").read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert doc["order"][:5] == ["r0:conversation", "r0:per_turn_pd", "r0:conditional_pd", "r0:colocated", "r1:conversation"]
    assert doc["layout"]["colocated"] == {"decode": {"engines": 2, "cpu_cores": [0, 1], "cpu_cores_per_replica": 1}}
    assert set(doc["summary"]["conversation"]) == {"0.5", "2.0"} and len(doc["reps"]) == 12
    # l1c0's first request ever (rep 0, conversation, the 2/s level) fails: +inf there, kept in the max
    assert doc["summary"]["conversation"]["2.0"]["failed_conversations"] == 1
    assert doc["summary"]["conversation"]["2.0"]["ttfet_p95_s"]["max"] == "inf"
    assert doc["summary"]["colocated"]["2.0"]["failed_conversations"] == 0 and doc["headline"]["failed_conversations"] == 1
    out = capsys.readouterr().out
    assert "expected ~" in out and out.strip().splitlines()[-1] == result["result_line"]
    assert result["result_line"].startswith("RESULT p95_ttfet_ratio_vs_per_turn_pd=")
