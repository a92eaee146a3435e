"""The ingress's prompt preparation per turn of a conversation, whole vs incremental tokenization
(deployments/token_prefix.py), in this process on the model's real tokenizer and template.

The bundled agentic trace's conversations (BFCL-shaped: a long tool preamble as the system
prompt, then user and tool turns), each replayed `rounds` times over so the history grows the way
a long agentic session's does; after every turn a fixed assistant reply is appended (no engine
here). For each turn both renderers prepare the same messages, alternating which goes first; the
ids must be equal (a difference fails the bench) and each call is timed. Reported: per-turn ms
p50 / p95 of each, by prompt length (tokens, bucketed), and the ratio of the p50s."""
from __future__ import annotations

import statistics
import time
from typing import Any

from baton.bench.stats import quantile
from baton.paths import SAMPLE_TRACES

REPLY = "Here is what I found: the function returned the values listed above, and the next step is clear. " * 2


def _conversations(rounds: int) -> list[tuple[str, list[dict[str, str]]]]:
    """(id, messages as the client sends them at each turn: one list per turn) per conversation."""
    from baton.traces.format import load_trace

    out = []
    for conv in load_trace(SAMPLE_TRACES / "agentic_small.jsonl"):
        base = [{"role": "system", "content": conv.system}] if conv.system else []
        turns = []
        for _ in range(rounds):
            for t in conv.turns:
                base = [*base, {"role": "user", "content": t.content}]  # tool results as user text: one template path for all
                turns.append(base)
                base = [*base, {"role": "assistant", "content": REPLY}]
        out.append((conv.conversation_id, turns))
    return out


def measure(model_path: str, rounds: int = 3) -> dict[str, Any]:
    from deployments.chat import PromptRenderer
    from deployments.protocol import ChatMessage

    whole = PromptRenderer.from_path(model_path)
    incremental = PromptRenderer.from_path(model_path, incremental=True)
    if not incremental.incremental:
        raise RuntimeError("the probe turned incremental tokenization off on this tokenizer")
    rows: list[tuple[int, float, float]] = []  # (prompt tokens, whole ms, incremental ms)
    for n, (cid, turns) in enumerate(_conversations(rounds)):
        for k, raw in enumerate(turns):
            msgs = [ChatMessage.model_validate(m) for m in raw]
            timed = {}
            for name in (("whole", "incremental") if (n + k) % 2 == 0 else ("incremental", "whole")):
                t0 = time.perf_counter()
                ids = whole.chat_tokens(msgs) if name == "whole" else incremental.chat_tokens(msgs, key=f"bench\x00{cid}")
                timed[name] = ((time.perf_counter() - t0) * 1000, ids)
            if timed["whole"][1] != timed["incremental"][1]:
                raise AssertionError(f"incremental tokenization differs from whole at turn {k} of {cid}")
            rows.append((len(timed["whole"][1]), timed["whole"][0], timed["incremental"][0]))
    w, i = [r[1] for r in rows], [r[2] for r in rows]
    buckets: dict[str, dict[str, float]] = {}
    for lo, hi in ((0, 2048), (2048, 4096), (4096, 8192), (8192, 1 << 30)):
        sel = [r for r in rows if lo <= r[0] < hi]
        if len(sel) >= 5:
            buckets[f"{lo}-{hi if hi < 1 << 30 else 'max'}"] = {"turns": len(sel), "whole_ms_p50": statistics.median(r[1] for r in sel),
                                                                "incremental_ms_p50": statistics.median(r[2] for r in sel)}
    return {"turns": len(rows), "max_prompt_tokens": max(r[0] for r in rows), "whole_ms_p50": statistics.median(w),
            "whole_ms_p95": quantile(w, 0.95), "incremental_ms_p50": statistics.median(i), "incremental_ms_p95": quantile(i, 0.95),
            "ratio_p50": statistics.median(i) / statistics.median(w), "by_prompt_tokens": buckets,
            "cache": incremental.prefix_snapshot()}
