"""Summaries of a replay: percentiles, token totals, per-turn-index stats; table, JSON, plot."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from baton.traces.records import ReplayResult, TurnRecord


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); None if empty."""
    xs = sorted(values)
    if not xs:
        return None
    rank = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True)
class TurnIndexStats:
    turn_index: int
    turns: int  # successful turns at this index
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    mean_prompt_tokens: float | None
    mean_cached_tokens: float | None


@dataclass(frozen=True)
class Summary:
    model: str
    concurrency: int
    duration_s: float
    conversations: int
    conversations_failed: int
    turns: int  # sent
    errors: int  # turns that failed
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    ttfet_p50_s: float | None
    ttfet_p95_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    output_tokens_per_s: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cached_fraction_followup: float | None  # cached / prompt tokens over turns with index >= 1
    by_turn: list[TurnIndexStats] = field(default_factory=list)
    tool_calls: int = 0  # native function calling: calls the model made
    tool_calls_parseable: int = 0  # JSON-object arguments naming an offered tool
    tool_calls_ok: int = 0  # executed without an error
    tool_calls_parseable_share: float | None = None  # parseable / made; None without calls


def _by_turn(ok: list[TurnRecord]) -> list[TurnIndexStats]:
    stats = []
    for index in sorted({r.turn_index for r in ok}):
        rs = [r for r in ok if r.turn_index == index]
        ttfts = [r.ttft_s for r in rs if r.ttft_s is not None]
        stats.append(TurnIndexStats(
            turn_index=index, turns=len(rs),
            ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
            mean_prompt_tokens=_mean([r.prompt_tokens for r in rs if r.prompt_tokens is not None]),
            mean_cached_tokens=_mean([r.cached_tokens for r in rs if r.cached_tokens is not None])))
    return stats


def summarize(result: ReplayResult) -> Summary:
    """Latency percentiles are over successful turns; token totals count what usage reported."""
    ok = [r for r in result.turns if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2es = [r.e2e_s for r in ok]
    ttfets = [c.ttfet_s for c in result.conversations if c.ttfet_s is not None]
    completion = sum(r.completion_tokens or 0 for r in result.turns)
    followup = [r for r in ok if r.turn_index >= 1 and r.prompt_tokens]
    followup_prompt = sum(r.prompt_tokens or 0 for r in followup)
    calls = sum(r.tool_calls for r in result.turns)
    parseable = sum(r.tool_calls_parseable for r in result.turns)
    return Summary(
        model=result.model, concurrency=result.concurrency, duration_s=result.duration_s,
        conversations=len(result.conversations),
        conversations_failed=sum(c.error is not None for c in result.conversations),
        turns=len(result.turns), errors=len(result.turns) - len(ok),
        ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
        ttft_p99_s=percentile(ttfts, 99),
        ttfet_p50_s=percentile(ttfets, 50), ttfet_p95_s=percentile(ttfets, 95),
        e2e_p50_s=percentile(e2es, 50), e2e_p95_s=percentile(e2es, 95),
        output_tokens_per_s=completion / result.duration_s if result.duration_s > 0 else None,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in result.turns),
        cached_tokens=sum(r.cached_tokens or 0 for r in result.turns),
        completion_tokens=completion,
        cached_fraction_followup=(sum(r.cached_tokens or 0 for r in followup) / followup_prompt
                                  if followup_prompt else None),
        by_turn=_by_turn(ok), tool_calls=calls, tool_calls_parseable=parseable,
        tool_calls_ok=sum(r.tool_calls_ok for r in result.turns),
        tool_calls_parseable_share=parseable / calls if calls else None)


def _fmt(value: float | int | None, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value}{unit}"
    return f"{value:.{digits}f}{unit}"


def format_table(s: Summary) -> str:
    """A plain-text table: the headline numbers, then TTFT and cached tokens by turn index."""
    rows = [
        ("model", s.model), ("concurrency", str(s.concurrency)),
        ("duration", _fmt(s.duration_s, " s", 1)),
        ("conversations (failed)", f"{s.conversations} ({s.conversations_failed})"),
        ("turns (errors)", f"{s.turns} ({s.errors})"),
        ("TTFT p50 / p95 / p99", " / ".join(_fmt(v, " s") for v in
                                           (s.ttft_p50_s, s.ttft_p95_s, s.ttft_p99_s))),
        ("TTFET p50 / p95", " / ".join(_fmt(v, " s") for v in (s.ttfet_p50_s, s.ttfet_p95_s))),
        ("E2E p50 / p95", " / ".join(_fmt(v, " s") for v in (s.e2e_p50_s, s.e2e_p95_s))),
        ("output tokens/s", _fmt(s.output_tokens_per_s, "", 1)),
        ("prompt / cached / completion tokens",
         f"{s.prompt_tokens} / {s.cached_tokens} / {s.completion_tokens}"),
        ("cached fraction (turns >= 1)", _fmt(s.cached_fraction_followup)),
        ("tool calls made / parseable / ok",
         f"{s.tool_calls} / {s.tool_calls_parseable} / {s.tool_calls_ok}"),
        ("parseable tool-call share", _fmt(s.tool_calls_parseable_share)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if s.by_turn:
        lines += ["", f"{'turn':>4}  {'n':>4}  {'TTFT p50':>9}  {'TTFT p95':>9}  "
                      f"{'prompt':>8}  {'cached':>8}"]
        for t in s.by_turn:
            lines.append(f"{t.turn_index:>4}  {t.turns:>4}  {_fmt(t.ttft_p50_s):>9}  "
                         f"{_fmt(t.ttft_p95_s):>9}  {_fmt(t.mean_prompt_tokens, '', 0):>8}  "
                         f"{_fmt(t.mean_cached_tokens, '', 0):>8}")
    return "\n".join(lines)


def write_json(result: ReplayResult, path: str | Path) -> Path:
    """The run, its summary and every conversation and turn record, as one JSON file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "run": {k: v for k, v in asdict(result).items() if k not in ("conversations", "turns")},
        "summary": asdict(summarize(result)),
        "conversations": [asdict(c) for c in result.conversations],
        "turns": [asdict(t) for t in result.turns],
    }
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path


def plot(result: ReplayResult, path_png: str | Path) -> Path:
    """Two panels by turn index: TTFT p50/p95, and mean cached vs prompt tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = summarize(result).by_turn
    xs = [t.turn_index for t in stats]
    nan = float("nan")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, key in (("p50", "ttft_p50_s"), ("p95", "ttft_p95_s")):
        ys = [getattr(t, key) if getattr(t, key) is not None else nan for t in stats]
        ax1.plot(xs, ys, marker="o", label=f"TTFT {label}")
    ax1.set(xlabel="turn index", ylabel="seconds", title="TTFT by turn index")
    ax1.legend()
    width = 0.4
    prompt = [t.mean_prompt_tokens or 0 for t in stats]
    cached = [t.mean_cached_tokens or 0 for t in stats]
    ax2.bar([x - width / 2 for x in xs], prompt, width, label="prompt tokens (mean)")
    ax2.bar([x + width / 2 for x in xs], cached, width, label="cached tokens (mean)")
    ax2.set(xlabel="turn index", ylabel="tokens", title="Prompt and cached tokens by turn index")
    ax2.legend()
    fig.suptitle(f"{result.model} @ concurrency {result.concurrency}")
    fig.tight_layout()
    path = Path(path_png)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
