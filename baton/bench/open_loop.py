"""Open-loop load for `bench overhead`: requests arrive at set times (a seeded Poisson process),
whatever the server is doing, and the bare engine and every served phase get the same arrivals.

Why the closed loop alone misleads at concurrency > 1: the bare loop is its own client, so when a
wave of requests finishes in one step, their replacements are all added before the next step and
prefilled together in one batch. A served engine sees the same replacements arrive one by one, a
few milliseconds apart (the response's and the next request's way through HTTP), starts a step
with the first, and the others wait for it. Measured (2026-12-07, AVX-512 host, quick prompts):
the bare loop's warm waves are single steps of 4 prefills (TTFT ~0.17 s), the served phases' are
split (TTFT ~0.37 s, `vllm serve` and Baton alike). Under open-loop arrivals neither side can
batch by construction, and a request that arrives mid-step waits for the step on both: what is
left between them is the server's own cost.

TTFT is measured from each request's scheduled arrival on both sides (a client late to send
counts against the served phase, never for it). A failed request raises: nothing is dropped.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from baton.bench.stats import RequestTiming

OPEN_LOOP_SEED = 20261207
# the offered load: this fraction of a second of single-request service per second (requests/s =
# UTILIZATION / the bare engine's c1 end-to-end p50), so the rate follows the host's engine speed
OPEN_LOOP_UTILIZATION = 0.6


def poisson_arrivals(n: int, rate_per_s: float, seed: int = OPEN_LOOP_SEED) -> list[float]:
    """n arrival offsets (s from the start, the first at 0) with exponential gaps of mean 1/rate. Pure."""
    if n < 1 or rate_per_s <= 0:
        raise ValueError(f"need n >= 1 and a positive rate, got n={n}, rate={rate_per_s}")
    rng = random.Random(seed)
    out, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate_per_s)
        out.append(t)
    return out


def offered_rate(c1_e2e_p50_s: float, utilization: float = OPEN_LOOP_UTILIZATION) -> float:
    """Requests/s that keep one engine `utilization` busy if each request ran alone. Pure."""
    if c1_e2e_p50_s <= 0 or not 0 < utilization < 1:
        raise ValueError(f"need a positive service time and 0 < utilization < 1, got {c1_e2e_p50_s}, {utilization}")
    return utilization / c1_e2e_p50_s


def bare_open_loop(engine: Any, params: Any, prompts: list[list[int]], arrivals: list[float], max_tokens: int,
                   tag: str = "o") -> tuple[list[RequestTiming], float]:
    """vLLM's LLMEngine as a zero-cost server: between steps it adds every request whose arrival has
    passed; idle, it sleeps until the next arrival."""
    if len(prompts) != len(arrivals):
        raise ValueError("one arrival per prompt")
    t0 = time.monotonic()
    due = {f"{tag}{i}": t0 + a for i, a in enumerate(arrivals)}
    first: dict[str, float] = {}
    timings: list[RequestTiming] = []
    nxt = 0
    while len(timings) < len(prompts):
        now = time.monotonic()
        while nxt < len(prompts) and t0 + arrivals[nxt] <= now:
            engine.add_request(f"{tag}{nxt}", {"prompt_token_ids": prompts[nxt]}, params)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, t0 + arrivals[nxt] - time.monotonic()))
            continue
        record_step(engine.step(), due, first, timings, max_tokens)
    return timings, time.monotonic() - t0


def record_step(outputs: Any, since: dict[str, float], first: dict[str, float], timings: list[RequestTiming], max_tokens: int) -> None:
    """One engine step's outputs into the loop's books: a request's first token time (`first`), and
    its timing from `since[request id]` once it finished."""
    for o in outputs:
        now = time.monotonic()
        if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
            first[o.request_id] = now
        if o.finished:
            timings.append(RequestTiming(first[o.request_id] - since[o.request_id], now - since[o.request_id], max_tokens))


async def stream_completion(http: Any, url: str, ids: list[int], max_tokens: int, started: float) -> tuple[RequestTiming, dict[str, float]]:
    """One streamed /v1/completions request, timed from `started` (monotonic); its Server-Timing
    hops, with `outside` = the client's TTFT minus the server's `total`."""
    from deployments.hop_timing import parse_server_timing

    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    ttft = None
    async with http.stream("POST", url, json=body) as r:
        r.raise_for_status()
        hops = parse_server_timing(r.headers.get("server-timing", ""))
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"text":""' not in line:
                ttft = time.monotonic() - started
    if ttft is None:
        raise RuntimeError(f"{url}: the stream ended without a token")
    if "total" in hops:
        hops["outside"] = ttft - hops["total"]
    return RequestTiming(ttft, time.monotonic() - started, max_tokens), hops


async def http_open_loop(url: str, prompts: list[list[int]], arrivals: list[float],
                         max_tokens: int) -> tuple[list[RequestTiming], float, list[dict[str, float]]]:
    """Each request sent at its arrival time from one client, timed from that time."""
    import httpx

    if len(prompts) != len(arrivals):
        raise ValueError("one arrival per prompt")
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.monotonic()

        async def one(ids: list[int], at: float) -> tuple[RequestTiming, dict[str, float]]:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            return await stream_completion(http, url, ids, max_tokens, started=t0 + at)

        results = await asyncio.gather(*(one(ids, at) for ids, at in zip(prompts, arrivals, strict=True)))
        return [t for t, _ in results], time.monotonic() - t0, [h for _, h in results]
