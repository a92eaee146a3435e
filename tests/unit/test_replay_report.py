"""Summary math on known inputs, the table, the JSON file and the plot."""

import json

import pytest

from baton.traces.records import ConversationRecord, ReplayResult, TurnRecord
from baton.traces.report import format_table, percentile, plot, summarize, write_json


def test_percentile_matches_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 95) == pytest.approx(4.8)
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


def _turn(cid, i, ttft, e2e, prompt, cached, completion=10, error=None):
    return TurnRecord(conversation_id=cid, turn_index=i, role="user", effective=True,
                      send_time_s=float(i), ttft_s=ttft, e2e_s=e2e, prompt_tokens=prompt,
                      completion_tokens=completion, cached_tokens=cached,
                      status=200 if error is None else 500, error=error)


def _result():
    turns = [
        _turn("a", 0, 0.1, 1.0, 100, 0), _turn("a", 1, 0.3, 1.2, 200, 100),
        _turn("b", 0, 0.2, 1.1, 100, 0), _turn("b", 1, 0.5, 1.4, 300, 150),
        _turn("c", 0, None, 9.0, None, None, completion=None, error="HTTP 500: boom"),
    ]
    convs = [ConversationRecord("a", "u", "s", 2, 2, 0.0, 0.4),
             ConversationRecord("b", "u", "s", 2, 2, 0.0, 0.6),
             ConversationRecord("c", "u", "s", 3, 1, 0.0, None, error="HTTP 500: boom")]
    return ReplayResult(url="http://x", model="m", concurrency=2, started_at="now",
                        duration_s=4.0, conversations=convs, turns=turns)


def test_summary_on_known_inputs():
    s = summarize(_result())
    assert (s.conversations, s.conversations_failed, s.turns, s.errors) == (3, 1, 5, 1)
    assert s.ttft_p50_s == pytest.approx(0.25)  # of 0.1, 0.2, 0.3, 0.5
    assert s.ttft_p95_s == pytest.approx(0.47)
    assert s.ttfet_p50_s == pytest.approx(0.5) and s.ttfet_p95_s == pytest.approx(0.59)
    assert s.e2e_p50_s == pytest.approx(1.15)  # the failed turn is left out
    assert (s.prompt_tokens, s.cached_tokens, s.completion_tokens) == (700, 250, 40)
    assert s.output_tokens_per_s == pytest.approx(10.0)
    assert s.cached_fraction_followup == pytest.approx(250 / 500)
    by = {t.turn_index: t for t in s.by_turn}
    assert by[0].turns == 2 and by[0].ttft_p50_s == pytest.approx(0.15)
    assert by[0].mean_cached_tokens == 0 and by[1].mean_cached_tokens == 125
    assert by[1].mean_prompt_tokens == 250


def test_empty_result():
    s = summarize(ReplayResult(url="u", model="m", concurrency=1, started_at="t", duration_s=0.0))
    assert s.turns == 0 and s.ttft_p50_s is None and s.output_tokens_per_s is None
    assert "TTFT p50" in format_table(s)


def test_table_json_and_plot(tmp_path):
    result = _result()
    table = format_table(summarize(result))
    assert "turns (errors)" in table and "5 (1)" in table and "0.250 s" in table
    assert table.splitlines()[-1].split()[:2] == ["1", "2"]  # turn 1, two turns
    doc = json.loads(write_json(result, tmp_path / "out" / "replay.json").read_text())
    assert set(doc) == {"run", "summary", "conversations", "turns"}
    assert doc["run"]["model"] == "m" and len(doc["turns"]) == 5
    assert doc["summary"]["errors"] == 1 and doc["turns"][4]["error"] == "HTTP 500: boom"
    png = plot(result, tmp_path / "out" / "replay.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
