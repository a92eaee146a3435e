"""The whole service path of `baton bench memory`: question text to first token, as a replica serves it.

Per request, timed from the question text:
1. recall: the memory-store actor (memory_store/deployment.py, a Ray actor here) embeds the
   question and takes the top k of the user's facts;
2. layout: the prompt's token ids with the facts in it (memory_store/layout.py), fact lines' ids
   remembered across requests as the ingress remembers them (LineTokens);
3. resolve: the replica's SegmentResolver finds each segment in one of the tiers below;
4. prepare: the segments' keys rotated to their prompt positions and cast, keys and values laid
   end to end in the model dtype, in a thread (kv_transfer/prepared.py), as the replica does;
5. engine: submit with the prepared KV to first token (max_tokens 1, a fresh cache salt); the
   engine thread only writes it into the paged cache.
The total includes the rotation (the prepare stage); `baton bench memory`'s engine TTFT does not.
Tiers (which cache holds the request's segments):
- warm: this replica's own LRU (a user's later turn on the same replica);
- pull: only the memory-store actor (a replica that has not served the user): read over NIXL from
  the store's registered arena by address (kv_transfer/segment_pull.py), as replicas do;
- pull_ray: the same, with the segments copied through Ray instead (a replica without NIXL);
- encode: neither (a user's first request after its facts were added: encoded on this engine).
A pull-tier request that read nothing over NIXL fails the bench (it would time another path).
Concurrency 1 gives the per-stage latencies; concurrency N (warm and pull) how the path holds up
when N users ask at once.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baton.bench.stats import quantile

TIERS = ("warm", "pull", "pull_ray", "encode")
LOCAL_CAPACITY_BYTES = 4 << 30


@dataclass(frozen=True)
class Question:
    user: str
    text: str


@dataclass(frozen=True)
class Timed:
    total_s: float
    recall_s: float
    layout_s: float
    resolve_s: float
    prepare_s: float
    engine_s: float
    injected_tokens: int
    pulled_segments: int = 0  # read over NIXL from the store's arena


async def one(runner: Any, renderer: Any, store: Any, resolver: Any, q: Question, k: int, window: int,
              lines: Any = None) -> Timed:
    """One request along the service path; `resolver` decides the tier."""
    from baton.engine.types import GenerationRequest, SamplingSpec
    from kv_transfer.segment_worker import prepare_injection

    pulled_before = resolver.pulled_segments
    t0 = time.perf_counter()
    recall = await store.recall.remote(q.user, q.text, k, window)
    t1 = time.perf_counter()
    p = _prompt(renderer, q, recall, window, lines)
    t2 = time.perf_counter()
    segs = await resolver.resolve(p.token_ids, p.injection)
    t3 = time.perf_counter()
    prepared = await asyncio.to_thread(prepare_injection, segs)
    t4 = time.perf_counter()
    req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tuple(p.token_ids),
                            sampling=SamplingSpec(max_tokens=1, temperature=0.0), cache_salt=uuid.uuid4().hex)
    cached, first = 0, None
    async for d in runner.generate(req, injection=prepared):
        cached = max(cached, d.cached_tokens)
        if first is None and d.token_ids:
            first = time.perf_counter()
    t5 = first or time.perf_counter()
    return Timed(t5 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, cached, resolver.pulled_segments - pulled_before)


def summarize(rows: Sequence[Timed], wall_s: float | None = None) -> dict[str, Any]:
    """p50/p95 of the total and p50 of each stage; requests/s when the wall time is given."""
    out: dict[str, Any] = {"n": len(rows), "p50_s": quantile([r.total_s for r in rows], 0.5),
                           "p95_s": quantile([r.total_s for r in rows], 0.95)}
    for stage in ("recall_s", "layout_s", "resolve_s", "prepare_s", "engine_s"):
        out[f"{stage[:-2]}_p50_s"] = quantile([getattr(r, stage) for r in rows], 0.5)
    out["mean_injected_tokens"] = sum(r.injected_tokens for r in rows) / max(1, len(rows))
    out["mean_pulled_segments"] = sum(r.pulled_segments for r in rows) / max(1, len(rows))
    if wall_s is not None:
        out["requests_per_s"] = len(rows) / wall_s
    return out


async def measure(runner: Any, renderer: Any, store: Any, questions: Sequence[Question], ks: Sequence[int], window: int,
                  reps: int, concurrency: int) -> dict[str, Any]:
    """Per k: each tier at concurrency 1 (tiers interleaved per question; encode once per question,
    warm and pull `reps` times), then warm and pull at `concurrency`. The encode tier goes first for
    each question: its facts' segments then exist in the store (pull) and in the shared replica LRU
    (warm)."""
    from kv_transfer.segment_pull import process_puller
    from memory_store.layout import LineTokens
    from memory_store.resolver import SegmentResolver

    lines = LineTokens(renderer)  # the ingress's, shared by every request as there
    puller = process_puller()
    if puller is None:
        raise RuntimeError("NIXL cannot run in this process: the pull tier has nothing to measure")

    def fresh(tier: str) -> SegmentResolver:  # a replica that has not served the user
        return SegmentResolver(runner, store, LOCAL_CAPACITY_BYTES, puller=puller if tier == "pull" else None)

    res: dict[str, Any] = {}
    for k in ks:
        warm = SegmentResolver(runner, store=store, local_capacity_bytes=LOCAL_CAPACITY_BYTES)
        rows: dict[str, list[Timed]] = {t: [] for t in TIERS}
        for rep in range(reps):
            for q in questions:
                if rep == 0:  # a user's first request: once per question (at k = 50 it costs seconds)
                    rows["encode"].append(await one(runner, renderer, store, SegmentResolver(runner, None, LOCAL_CAPACITY_BYTES), q, k,
                                                    window, lines))
                    ids, m = await _layout(renderer, store, q, k, window)
                    await warm.resolve(ids, m)  # fills the warm LRU; what it encodes it offers to the store
                    await _stored(store, ids, m)
                for tier in ("pull", "pull_ray"):
                    rows[tier].append(await one(runner, renderer, store, fresh(tier), q, k, window, lines))
                rows["warm"].append(await one(runner, renderer, store, warm, q, k, window, lines))
        by_tier = {t: summarize(v) for t, v in rows.items()}
        _check_pulled(rows["pull"])
        loaded: dict[str, Any] = {}
        for tier in ("warm", "pull"):
            sem = asyncio.Semaphore(concurrency)

            async def go(q: Question, tier: str = tier, sem: asyncio.Semaphore = sem, k: int = k, warm: Any = warm) -> Timed:
                async with sem:
                    r = warm if tier == "warm" else fresh(tier)
                    return await one(runner, renderer, store, r, q, k, window, lines)

            batch = [q for _ in range(max(1, 2 * concurrency // max(1, len(questions)))) for q in questions]
            t0 = time.perf_counter()
            out = await asyncio.gather(*(go(q) for q in batch))
            loaded[tier] = summarize(out, time.perf_counter() - t0)
            if tier == "pull":
                _check_pulled(out)
        res[str(k)] = {"concurrency_1": by_tier, f"concurrency_{concurrency}": loaded}
        print(f"[memory] service k={k:>2}: TTFT p50 warm {by_tier['warm']['p50_s'] * 1000:.0f} ms, pull "
              f"{by_tier['pull']['p50_s'] * 1000:.0f} ms (through Ray {by_tier['pull_ray']['p50_s'] * 1000:.0f} ms), "
              f"encode {by_tier['encode']['p50_s'] * 1000:.0f} ms (recall {by_tier['warm']['recall_p50_s'] * 1000:.0f}, "
              f"pull's resolve {by_tier['pull']['resolve_p50_s'] * 1000:.0f}, through Ray {by_tier['pull_ray']['resolve_p50_s'] * 1000:.0f}, "
              f"prepare {by_tier['warm']['prepare_p50_s'] * 1000:.0f} ms); "
              f"at concurrency {concurrency}: warm p50 {loaded['warm']['p50_s'] * 1000:.0f} ms, "
              f"{loaded['warm']['requests_per_s']:.2f} req/s; pull p50 {loaded['pull']['p50_s'] * 1000:.0f} ms", flush=True)
    return res


def _check_pulled(rows: Sequence[Timed]) -> None:
    """Every pull-tier request must have read its segments over NIXL (else it timed another path)."""
    missed = sum(1 for r in rows if r.pulled_segments == 0)
    if missed:
        raise RuntimeError(f"{missed} of {len(rows)} pull-tier requests read nothing over NIXL (see the resolver's warnings)")


def _prompt(renderer: Any, q: Question, recall: Any, window: int, lines: Any = None) -> Any:
    """The question's prompt with its recalled facts in KV-injection layout (a MemoryPrompt)."""
    from memory_store.layout import memory_prompt

    return memory_prompt(renderer, [{"role": "user", "content": q.text}], recall.facts, user=q.user, model="smollm2",
                         window=window, inject=True, deletions=recall.deletions, line_tokens=lines)


async def _layout(renderer: Any, store: Any, q: Question, k: int, window: int) -> tuple[Any, Any]:
    p = _prompt(renderer, q, await store.recall.remote(q.user, q.text, k, window), window)
    return p.token_ids, p.injection


async def _stored(store: Any, ids: Sequence[int], m: Any, timeout_s: float = 10.0) -> None:
    """Wait until the store holds every segment of `m` (put_segments is fire-and-forget), so the
    pull tier pulls them all; RuntimeError if it does not within timeout_s."""
    from memory_store.resolver import anchor_key, fact_key

    keys = [anchor_key(tuple(ids[: m.anchor_len]), m.model)] + [fact_key(f, m.window, m.model) for f in m.facts]
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if len(await store.get_segments.remote(m.user, keys)) == len(keys):
            return
        await asyncio.sleep(0.02)
    raise RuntimeError(f"the memory store did not hold the {len(keys)} segments of a request within {timeout_s:g} s")
