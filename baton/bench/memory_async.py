"""`baton bench memory`'s load-stall phase: what a KV-injected request's load costs the requests
already running on the same engine, with the segment connector's loads on the engine thread
(`sync`) and on its loader thread (`async`, kv_transfer/segment_loader.py).

Per trial: one decode stream (a greedy request that runs for the whole trial) is started; once it
has produced its first tokens, the KV-mode cases are sent one after another (each to its first
token, max_tokens 1). The stream's inter-token gaps while a case is in flight are the stall: with
the load on the engine thread, the step that admits a case also writes its KV before computing;
with the load in the background, that step only computes while the write runs on the other
thread. Figures per mode: the stream's gap p50 / p95 / max during the cases (and before them, the
baseline), the cases' TTFT p50 / p95. Trials interleave the modes (sync, async, sync, ...) so drift
on a shared machine hits both alike; the mode is the segment scheduler's `async_min_tokens` (None:
sync, 0: async), switched between trials on the one engine (each request keeps the mode it was
matched under) and put back afterwards.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any

from baton.bench.stats import quantile

MODES = ("sync", "async")
STREAM_PROMPT_TOKENS = 256
WARM_TOKENS = 6  # stream tokens before the first case (the baseline gaps)


def _side(runner: Any) -> Any:
    from kv_transfer.segment_scheduler import segment_scheduler_of

    side = segment_scheduler_of(runner.scheduler)
    if side is None:
        raise RuntimeError("the bench engine runs no segment connector: nothing to compare")
    return side


async def _trial(runner: Any, cases: Sequence[Any], stream_ids: Sequence[int], request: Any) -> dict[str, Any]:
    from baton.engine.types import GenerationRequest, SamplingSpec

    arrivals: list[float] = []
    started = asyncio.Event()
    stop = asyncio.Event()
    req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tuple(stream_ids),
                            sampling=SamplingSpec(max_tokens=4000, temperature=0.0, ignore_eos=True),
                            cache_salt=uuid.uuid4().hex)

    async def stream() -> None:
        async for d in runner.generate(req):
            now = time.perf_counter()
            arrivals.extend(now for _ in d.token_ids)
            if len(arrivals) >= WARM_TOKENS:
                started.set()
            if stop.is_set() or d.finished:
                return

    kvs = [c.prepared_kv for c in cases]  # prepared before the stream starts: no preparation in any gap measured
    task = asyncio.create_task(stream())
    await started.wait()
    windows: list[tuple[float, float]] = []
    ttfts: list[float] = []
    for c, kv in zip(cases, kvs, strict=True):
        t0 = time.perf_counter()
        ttft, _, _ = await request(runner, c.prompt.token_ids, kv, 1)
        windows.append((t0, time.perf_counter()))
        ttfts.append(ttft)
    stop.set()
    await task
    if len(arrivals) < WARM_TOKENS + 2:
        raise RuntimeError(f"the decode stream produced {len(arrivals)} tokens: it ended before the cases did")
    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:], strict=False)]
    first = windows[0][0]
    during = [g for t, g in gaps if any(s <= t <= e for s, e in windows)]
    before = [g for t, g in gaps if t < first]
    return {"during": during, "before": before, "ttft": ttfts}


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50_ms": float("nan"), "p95_ms": float("nan"), "max_ms": float("nan")}
    return {"n": len(values), "p50_ms": 1000 * quantile(values, 0.5), "p95_ms": 1000 * quantile(values, 0.95),
            "max_ms": 1000 * max(values)}


async def measure(runner: Any, cases: Sequence[Any], stream_ids: Sequence[int], request: Any,
                  trials: int) -> dict[str, Any]:
    """`trials` trials per mode over the same cases; `request(runner, ids, kv, max_tokens)` -> (ttft, ...)."""
    if len(stream_ids) < 1 or not cases:
        raise ValueError("the stall phase needs a stream prompt and at least one case")
    pooled: dict[str, dict[str, list[float]]] = {m: {"during": [], "before": [], "ttft": []} for m in MODES}
    per_trial: dict[str, list[float]] = {m: [] for m in MODES}
    side = _side(runner)
    configured = side.async_min_tokens
    try:
        for _ in range(trials):
            for mode in MODES:
                side.async_min_tokens = 0 if mode == "async" else None
                r = await _trial(runner, cases, stream_ids, request)
                for key in pooled[mode]:
                    pooled[mode][key].extend(r[key])
                per_trial[mode].append(1000 * quantile(r["during"], 0.95) if r["during"] else float("nan"))
    finally:
        side.async_min_tokens = configured
    out: dict[str, Any] = {"trials": trials, "cases": len(cases), "stream_prompt_tokens": len(stream_ids)}
    for mode in MODES:
        p = pooled[mode]
        out[mode] = {"stream_gap_during": _summary(p["during"]), "stream_gap_before": _summary(p["before"]),
                     "case_ttft": _summary(p["ttft"]), "stream_gap_p95_ms_per_trial": per_trial[mode]}
    return out


def stall_ratio(report: dict[str, Any]) -> float:
    """Pure: the decode stream's gap p95 during the cases, async over sync (< 1: the background load
    stalls the running stream less)."""
    return report["async"]["stream_gap_during"]["p95_ms"] / report["sync"]["stream_gap_during"]["p95_ms"]
