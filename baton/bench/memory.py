"""`baton bench memory`: InferScale on LoCoMo — KV injection vs prompt injection of memories.

One real engine (SmolLM2 on vLLM CPU, the segment connector, in this process), the real memory
store logic (SQLite + all-MiniLM-L6-v2 retrieval, memory_store/store.py) and the replica's
resolver (memory_store/resolver.py). Facts are a LoCoMo conversation's dialog turns (one user
per conversation), questions its `qa` items. Both modes send the same token ids (the layout of
memory_store/layout.py); prompt injection computes every token, KV injection loads the anchor
and the facts from precomputed segments and computes the rest. Every timed request carries a
fresh cache salt, so no measured request is served from vLLM's prefix cache unless it is meant to.

Measured, for k in {5, 10, 20, 50}:
- engine TTFT (engine submit -> first token, concurrency 1, max_tokens 1) p50/p95 per mode:
  prompt, kv, and hit -- the physical floor: the same prompt with its whole memory prefix
  [0, injection.end) already resident as exact cached KV (a prefix-cache hit primed by an
  unmeasured request with the same salt), only the suffix computed (and the prefix's last
  partial block: hits are whole blocks, 32 tokens here);
- throughput (requests/s and output tokens/s) at a fixed concurrency, max_tokens 16 (KV mode
  prepares each request's KV inside the timed run, as a replica does);
- fidelity at k = 10 and k = 50 (baton/bench/memory_fidelity.py): top-1 agreement with prompt
  injection and mean per-position KL(prompt || kv) over the whole vocabulary, top-1 accuracy along
  the reference answer, for the default window w (MemoryConfig.context_window) and each window of
  COMPARED_WINDOWS (w = 0: each fact encoded alone); answers' token-F1 at k = 10;
- the recompute tail (MemoryConfig.recompute_tail_tokens) for R in RECOMPUTE_TAILS: the same
  prompts with their last facts (>= R tokens) computed instead of injected, as the ingress lays
  them out; engine TTFT at k = 5 and 50 (interleaved with the modes above) and fidelity at k = 50,
  so what R buys and what it costs come from the same run;
- the load stall (baton/bench/memory_async.py): a running decode stream's inter-token gaps while
  k = 50 KV-mode requests arrive, with their loads on the engine thread vs on the connector's
  loader thread (interleaved trials on the one engine);
- the service path (baton/bench/memory_service.py): question text -> first token through the
  memory-store actor's recall, the layout, the resolver (warm replica LRU, pulled from the store,
  or encoded), the prepare (rotation and cast) and the engine, at concurrency 1 and 16, for k = 5 and 50.
Segments are encoded before the engine timings (InferScale precomputes them when facts are added);
the time to encode is reported separately, and as the service path's encode tier. They are also
prepared before the engine timings, as the replica prepares them after resolving: keys rotated to
their prompt positions and cast to the model dtype in the pull path (kv_transfer/prepared.py), so
engine TTFT in KV mode excludes the rotation (reported as prepare_s, per k); the engine thread
only writes the prepared KV into the paged cache. The service path's TTFT includes it (its
prepare stage).
"""
from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from baton.bench.stats import quantile
from baton.paths import REPO_ROOT
from memory_store.config import MemoryConfig

ROOT = REPO_ROOT
LOCOMO = ROOT.parent / "shared" / "data" / "locomo"
KS = (5, 10, 20, 50)
FIDELITY_K = 10  # the headline k of fidelity_ratio and of answers' F1
FIDELITY_KS = (10, 50)
SERVICE_KS = (5, 50)
SERVICE_CONCURRENCY = 16
DEFAULT_WINDOW: int = MemoryConfig.model_fields["context_window"].default  # what a served replica encodes with
COMPARED_WINDOWS = tuple(w for w in (0, 2, 4) if w != DEFAULT_WINDOW)  # fidelity beside the default's
HIT_BLOCK_SIZE = 32
STALL_TRIALS = 5  # per mode, interleaved
RECOMPUTE_TAILS = (128, 512)  # tokens of the memory block computed instead of injected (kv_tail<R>)
HEADLINE_TAIL = 512  # the tail whose figures the RESULT line carries
TAIL_KS = (5, 50)  # the ks whose cases carry tail variants (TTFT growth; fidelity at 50)


def _runner(model_path: str, dtype: str = "auto") -> Any:
    from baton.bench.local_engine import local_engine

    # max_logprobs -1: fidelity reads each position's distribution over the whole vocabulary.
    # block_size 32 (CPU's default is 128): a prefix-cache hit is whole blocks, so the hit floor
    # computes the suffix plus the memory prefix's last partial block; 32 is the smallest block the
    # CPU attention kernel takes (multiples of 32), GPUs use 16. Both modes run on this engine.
    return local_engine(model_path, max_model_len=4096, kv_cache_gib=1.0, cpu_threads=2, max_num_seqs=16,
                        extra_engine_args={"max_logprobs": -1}, block_size=HIT_BLOCK_SIZE, dtype=dtype)


async def _request(runner: Any, ids: Sequence[int], segs: Any, max_tokens: int,
                   salt: str | None = None) -> tuple[float, list[int], int]:
    """(TTFT s, output tokens, cached prompt tokens) of one greedy request (a fresh salt unless given)."""
    from baton.engine.types import GenerationRequest, SamplingSpec

    req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tuple(ids),
                            sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0), cache_salt=salt or uuid.uuid4().hex)
    t0 = time.perf_counter()
    ttft, toks, cached = None, [], 0
    async for d in runner.generate(req, injection=segs):
        if ttft is None and d.token_ids:
            ttft = time.perf_counter() - t0
        toks.extend(d.token_ids)
        cached = max(cached, d.cached_tokens)
    return ttft or (time.perf_counter() - t0), toks, cached


class _Case:
    """One question of one user at one k and window: its prompt, its resolved segments (None: no
    injection) and answer. `prepared_kv` is the KV handed to the engine: the segments prepared as
    the pull path prepares them (a PreparedInjection; the plain segments when the engine cannot
    rotate them), made anew on each access and never held by the case, so a run's cases hold only
    their segments, which the resolver's cache shares between questions (a held k = 50 preparation
    is ~100-300 MB; a full float32 run keeping one per case swapped on a 24 GB host). `tails`: the
    same question laid out with a recompute tail of R tokens, per R."""

    def __init__(self, prompt: Any, segments: Any, answer: str, tails: dict[int, _Case] | None = None):
        self.prompt, self.segments, self.answer = prompt, segments, answer
        self.tails = tails or {}

    @property
    def prepared_kv(self) -> Any:
        from kv_transfer.segment_worker import prepare_injection

        return None if self.segments is None else prepare_injection(self.segments)


async def _build_cases(runner: Any, renderer: Any, svc: Any, user: str, qas: Sequence[Any], k: int, window: int,
                       resolver: Any, tails: Sequence[int] = ()) -> tuple[list[_Case], float, float]:
    """The cases (with a variant per recompute tail in `tails`), the seconds spent resolving
    (encoding) their segments and preparing them (the plain cases' only)."""
    from kv_transfer.segment_worker import prepare_injection
    from memory_store.layout import memory_prompt

    cases, enc_s, prep_s = [], 0.0, 0.0
    for qa in qas:
        recall = svc.recall(user, qa.question, k, window)

        def layout(tail: int, question: str = qa.question, facts: Any = recall.facts) -> Any:
            return memory_prompt(renderer, [{"role": "user", "content": question}], facts,
                                 user=user, model="smollm2", window=window, inject=True, recompute_tail=tail)

        p = layout(0)
        t0 = time.perf_counter()
        segs = await resolver.resolve(p.token_ids, p.injection)
        t1 = time.perf_counter()
        await asyncio.to_thread(prepare_injection, segs)  # timed once here; a case prepares again when used
        enc_s, prep_s = enc_s + t1 - t0, prep_s + time.perf_counter() - t1
        variants = {}
        for tail in tails:
            tp = layout(tail)
            variants[tail] = _Case(tp, None if tp.injection is None else await resolver.resolve(tp.token_ids, tp.injection), qa.answer)
        cases.append(_Case(p, segs, qa.answer, variants))
    return cases, enc_s, prep_s


async def _ttft(runner: Any, cases: Sequence[_Case], reps: int) -> dict[str, Any]:
    """Engine TTFT per mode: prompt, kv, hit, and kv_tail<R> for each recompute tail the cases carry."""
    modes = ["prompt", "kv", "hit", *(f"kv_tail{t}" for t in cases[0].tails)]
    out: dict[str, list[float]] = {m: [] for m in modes}
    cached: dict[str, list[int]] = {m: [] for m in modes}
    for _ in range(reps):
        for c in cases:  # interleave the modes so drift on a shared machine hits all alike
            runs = [("prompt", c.prompt, None), ("kv", c.prompt, c.prepared_kv), ("hit", c.prompt, None)]
            runs += [(f"kv_tail{t}", v.prompt, v.prepared_kv) for t, v in c.tails.items()]
            for mode, prompt, segs in runs:
                salt = None
                if mode == "hit":  # prime: the memory prefix computed once under this salt (not timed)
                    salt = uuid.uuid4().hex
                    await _request(runner, prompt.token_ids[: prompt.injection.end], None, 1, salt)
                t, _, n = await _request(runner, prompt.token_ids, segs, 1, salt)
                out[mode].append(t)
                cached[mode].append(n)
    prompt_len = sum(len(c.prompt.token_ids) for c in cases) / len(cases)
    return {m: {"p50_s": quantile(v, 0.5), "p95_s": quantile(v, 0.95), "n": len(v), "mean_cached_tokens": sum(cached[m]) / len(v)}
            for m, v in out.items()} | {"mean_prompt_tokens": prompt_len}


async def _throughput(runner: Any, cases: Sequence[_Case], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """Requests/s and output tokens/s at `concurrency`, per mode; KV mode prepares each request's KV
    inside the timed run."""
    res = {}
    for mode in ("prompt", "kv"):
        sem = asyncio.Semaphore(concurrency)
        toks = 0

        async def one(c: _Case, sem: asyncio.Semaphore, inject: bool) -> None:
            nonlocal toks
            async with sem:
                # prepared here, in a thread, as a replica pays it per request: it competes with the engine for the cores
                kv = await asyncio.to_thread(lambda: c.prepared_kv) if inject else None
                _, out, _ = await _request(runner, c.prompt.token_ids, kv, max_tokens)
                toks += len(out)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, sem, mode == "kv") for c in cases))
        wall = time.perf_counter() - t0
        res[mode] = {"requests_per_s": len(cases) / wall, "output_tok_per_s": toks / wall, "wall_s": wall}
    return res


class _Renderer:
    """PromptRenderer plus decode (for F1 of generated answers)."""

    def __init__(self, model_path: str):
        from transformers import AutoTokenizer

        from deployments.chat import PromptRenderer

        self._tok = AutoTokenizer.from_pretrained(model_path)
        self._r = PromptRenderer(self._tok)

    def chat_text(self, messages: list[dict[str, Any]]) -> str:
        return self._r.chat_text(messages)

    def text_tokens(self, text: str) -> list[int]:
        return self._r.text_tokens(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


async def _main(quick: bool, out_dir: Path, dtype: str, fidelity_only: bool = False) -> dict[str, Any]:
    from baton.engine.args import resolve_model_path
    from memory_store.db import FactStore
    from memory_store.embedder import MiniLMEmbedder
    from memory_store.ingest import load_locomo, locomo_facts, locomo_qa
    from memory_store.store import MemoryService

    if not LOCOMO.is_dir():
        raise SystemExit(f"LoCoMo data not found at {LOCOMO}")
    model_path = resolve_model_path("SmolLM2-135M-Instruct", str(ROOT / ".cache" / "models"))
    convs = ["conv-26"] if quick else ["conv-26", "conv-30", "conv-41"]
    n_q, reps, concurrency = (10, 2, 4) if quick else (12, 2, 8)
    renderer = _Renderer(model_path)
    tmp = Path(tempfile.mkdtemp(prefix="baton-bench-memory-"))
    cfg = MemoryConfig(max_k=64, segment_capacity_mb=2048)  # the store holds every segment of a question (LRU)
    svc = MemoryService(cfg, FactStore(tmp / "facts.sqlite3"), MiniLMEmbedder())
    users: list[tuple[str, list[Any]]] = []
    for name in convs:
        sample = load_locomo(LOCOMO / f"{name}.json")
        batch = locomo_facts(sample, name, "dialog")
        for i in range(0, len(batch.texts), 200):  # the store takes at most max_facts_per_request per call
            svc.add(name, list(batch.texts[i:i + 200]), batch.source)
        qas = [q for q in locomo_qa(sample) if q.answer][:n_q]
        users.append((name, qas))
        print(f"[memory] {name}: {len(batch.texts)} facts, {len(qas)} questions")
    t0 = time.perf_counter()
    from baton.engine.args import engine_dtype
    from baton.engine.vllm_engine import native_cpu_bf16

    dtype = engine_dtype(dtype, on_gpu=False, cpu_bf16=native_cpu_bf16())  # as the engine resolves it
    runner = _runner(model_path, dtype)
    print(f"[memory] engine up in {time.perf_counter() - t0:.1f}s ({dtype})")
    try:
        if fidelity_only:
            report = await _fidelity_only(runner, renderer, svc, users, quick, convs, n_q)
        else:
            report = await _measure(runner, renderer, svc, users, quick, convs, n_q, reps, concurrency)
            report["service"] = await _service(runner, renderer, cfg, tmp / "facts.sqlite3", users, reps)
        report["dtype"] = dtype
    finally:
        runner.shutdown()
    if fidelity_only:
        report["result"] = fidelity_result(report["fidelity"])
    else:
        report["result"] = run_result(report["by_k"], report["fidelity"], report["service"], report["load_stall"])
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "memory.json").write_text(json.dumps(report, indent=2))
    if not fidelity_only:
        _plot(report, out_dir / "memory.png")
    print(f"[memory] wrote {out_dir / 'memory.json'}" + ("" if fidelity_only else f" and {out_dir / 'memory.png'}"))
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in report["result"].items()))
    return report


async def _service(runner: Any, renderer: Any, cfg: Any, db_path: Path, users: list[tuple[str, list[Any]]],
                   reps: int) -> dict[str, Any]:
    """The service path (baton/bench/memory_service.py) with the memory-store actor on a local Ray
    head of its own (stopped afterwards, and only it)."""
    import ray

    from baton.bench import memory_service
    from baton.bench.ray_session import stop_ray_session
    from memory_store.deployment import MemoryStore

    temp = tempfile.mkdtemp(prefix="bray-mem-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
    try:
        store = ray.remote(num_cpus=0)(MemoryStore).remote(cfg, str(db_path))
        questions = [memory_service.Question(user, qa.question) for user, qas in users for qa in qas]
        return await memory_service.measure(runner, renderer, store, questions, SERVICE_KS, DEFAULT_WINDOW, reps,
                                            SERVICE_CONCURRENCY)
    finally:
        ray.shutdown()
        stop_ray_session(temp)


def run_result(by_k: dict[str, Any], fidelity: dict[str, Any], service: dict[str, Any],
               load_stall: dict[str, Any] | None = None) -> dict[str, float]:
    """Pure: the RESULT line's figures, in its order, from the report's parts."""
    from baton.bench.memory_async import stall_ratio

    def p50(k: int, mode: str) -> float:
        return by_k[str(k)]["ttft"][mode]["p50_s"]

    kv_growth, hit_growth = p50(50, "kv") / p50(5, "kv"), p50(50, "hit") / p50(5, "hit")
    pull = {k: service[str(k)]["concurrency_1"]["pull"]["p50_s"] for k in SERVICE_KS}
    ray = {k: service[str(k)]["concurrency_1"]["pull_ray"]["p50_s"] for k in SERVICE_KS}
    fid = fidelity_result(fidelity)
    headline = ("top1_agreement_k50", "kl_k50", "fidelity_ratio")
    return {
        "kv_ttft_growth_k50_over_k5": kv_growth,
        "hit_ttft_growth_k50_over_k5": hit_growth,
        "kv_over_hit_growth": kv_growth / hit_growth,
        "prompt_ttft_growth_k50_over_k5": p50(50, "prompt") / p50(5, "prompt"),
        "ttft_speedup_k50": p50(50, "prompt") / p50(50, "kv"),
    } | {key: fid[key] for key in headline} | {
        "service_ttft_growth_k50_over_k5": pull[50] / pull[5],
        "service_ray_ttft_growth_k50_over_k5": ray[50] / ray[5],
    } | {key: v for key, v in fid.items() if key not in headline and "_tail" not in key} | _tail_result(
        by_k, fidelity, hit_growth) | ({} if load_stall is None else {
            "load_stall_gap_p95_ratio_async_over_sync": stall_ratio(load_stall),
            "load_stall_case_ttft_ratio_async_over_sync": (load_stall["async"]["case_ttft"]["p50_ms"]
                                                           / load_stall["sync"]["case_ttft"]["p50_ms"]),
        })


def fidelity_result(fidelity: dict[str, Any]) -> dict[str, float]:
    """Pure: the fidelity figures of the RESULT line (all of `--fidelity-only`'s): the default
    window's at k = 50 and its accuracy ratio at FIDELITY_K, the same for each compared window, and
    the headline recompute tail's at k = 50 when it was measured."""
    def fid(k: int, mode: str, key: str) -> float:
        return fidelity[str(k)][mode][key]

    base = fid(FIDELITY_K, "prompt", "top1_accuracy") or float("nan")
    out = {}
    for o, suffix in ((DEFAULT_WINDOW, ""), *((o, f"_w{o}") for o in _compared_windows(fidelity))):
        out |= {f"top1_agreement_k50{suffix}": fid(50, f"kv_w{o}", "top1_agreement_with_prompt"),
                f"kl_k50{suffix}": fid(50, f"kv_w{o}", "kl_to_prompt_mean"),
                f"fidelity_ratio{suffix}": fid(FIDELITY_K, f"kv_w{o}", "top1_accuracy") / base}
    tail = fidelity["50"].get(f"kv_w{DEFAULT_WINDOW}_tail{HEADLINE_TAIL}")
    if tail is not None:
        out |= {f"top1_agreement_k50_tail{HEADLINE_TAIL}": tail["top1_agreement_with_prompt"],
                f"kl_k50_tail{HEADLINE_TAIL}": tail["kl_to_prompt_mean"]}
    return out


def _compared_windows(fidelity: dict[str, Any]) -> list[int]:
    """Pure: the windows besides the default that the report's fidelity at k = 50 measured, ascending."""
    found = (m.removeprefix("kv_w") for m in fidelity["50"] if m.startswith("kv_w") and "_" not in m.removeprefix("kv_w"))
    return sorted(w for w in map(int, found) if w != DEFAULT_WINDOW)


def _tail_result(by_k: dict[str, Any], fidelity: dict[str, Any], hit_growth: float) -> dict[str, float]:
    """Pure: the headline recompute tail's figures (none in a report measured without tails): its
    fidelity at k = 50, its TTFT growth over a cache hit's, and its TTFT at k = 50 over plain KV's."""
    t = HEADLINE_TAIL
    mode = f"kv_tail{t}"
    if mode not in by_k["50"]["ttft"]:
        return {}
    kv50, tail5, tail50 = (by_k[k]["ttft"][m]["p50_s"] for k, m in (("50", "kv"), ("5", mode), ("50", mode)))
    fid = fidelity_result(fidelity)
    return {
        f"top1_agreement_k50_tail{t}": fid[f"top1_agreement_k50_tail{t}"],
        f"kl_k50_tail{t}": fid[f"kl_k50_tail{t}"],
        f"tail{t}_over_hit_growth": tail50 / tail5 / hit_growth,
        f"tail{t}_ttft_k50_over_kv": tail50 / kv50,
    }


async def _measure(runner: Any, renderer: Any, svc: Any, users: list[tuple[str, list[Any]]], quick: bool,
                   convs: list[str], n_q: int, reps: int, concurrency: int) -> dict[str, Any]:
    from baton.bench import memory_async
    from kv_transfer.segment_stats import segment_stats
    from memory_store.resolver import SegmentResolver

    resolver = SegmentResolver(runner, store=None, local_capacity_bytes=4 << 30)
    # warm-up (unmeasured): one request of each mode
    warm, _, _ = await _build_cases(runner, renderer, svc, users[0][0], users[0][1][:1], 5, DEFAULT_WINDOW, resolver)
    await _ttft(runner, warm, 1)

    by_k: dict[int, Any] = {}
    cases_k: dict[int, list[_Case]] = {}
    for k in KS:
        cases, enc_s, prep_s = [], 0.0, 0.0
        for user, qas in users:
            cs, e, pr = await _build_cases(runner, renderer, svc, user, qas, k, DEFAULT_WINDOW, resolver,
                                           RECOMPUTE_TAILS if k in TAIL_KS else ())
            cases += cs
            enc_s, prep_s = enc_s + e, prep_s + pr
        if k in (KS[0], KS[-1]):  # kept for throughput and the stall phase (a case holds its segments, prepared when used)
            cases_k[k] = cases
        before = segment_stats()
        ttft = await _ttft(runner, cases, reps)
        after = segment_stats()
        load_ms = 1000 * (after.load_seconds - before.load_seconds) / max(1, after.injections - before.injections)
        prepared = (after.prepared_loads - before.prepared_loads) / max(1, after.injections - before.injections)
        by_k[k] = {"ttft": ttft, "encode_s": enc_s, "mean_load_ms": load_ms, "prepare_s": prep_s,
                   "mean_prepare_ms": 1000 * prep_s / max(1, len(cases)), "prepared_load_fraction": prepared}
        print(f"[memory] k={k:>2}: prompt {ttft['mean_prompt_tokens']:.0f} tokens; TTFT p50 prompt {ttft['prompt']['p50_s'] * 1000:.0f} ms "
              f"vs kv {ttft['kv']['p50_s'] * 1000:.0f} ms vs hit {ttft['hit']['p50_s'] * 1000:.0f} ms "
              f"(p95 {ttft['prompt']['p95_s'] * 1000:.0f} / {ttft['kv']['p95_s'] * 1000:.0f} / {ttft['hit']['p95_s'] * 1000:.0f}); "
              f"cached kv {ttft['kv']['mean_cached_tokens']:.0f}, hit {ttft['hit']['mean_cached_tokens']:.0f}; "
              f"load {load_ms:.0f} ms ({prepared:.0%} prepared; prepare {1000 * prep_s / max(1, len(cases)):.0f} ms each); "
              f"encode {enc_s:.1f}s", flush=True)
        for t in (RECOMPUTE_TAILS if k in TAIL_KS else ()):
            m = ttft[f"kv_tail{t}"]
            print(f"[memory] k={k:>2}: recompute tail {t}: TTFT p50 {m['p50_s'] * 1000:.0f} ms (p95 {m['p95_s'] * 1000:.0f}); "
                  f"cached {m['mean_cached_tokens']:.0f} of {ttft['mean_prompt_tokens']:.0f} tokens", flush=True)
    for k in (KS[0], KS[-1]):
        by_k[k]["throughput"] = await _throughput(runner, cases_k[k], concurrency, 16)
        t = by_k[k]["throughput"]
        print(f"[memory] k={k}: throughput at concurrency {concurrency}: prompt {t['prompt']['requests_per_s']:.2f} req/s, "
              f"kv {t['kv']['requests_per_s']:.2f} req/s", flush=True)
    stall = await memory_async.measure(runner, cases_k[KS[-1]], cases_k[KS[-1]][0].prompt.token_ids[:memory_async.STREAM_PROMPT_TOKENS],
                                       _request, trials=STALL_TRIALS)
    for mode in memory_async.MODES:
        g, b, t = stall[mode]["stream_gap_during"], stall[mode]["stream_gap_before"], stall[mode]["case_ttft"]
        print(f"[memory] load stall k={KS[-1]} {mode:>5}: decode gap during loads p50 {g['p50_ms']:.0f} / p95 {g['p95_ms']:.0f} / "
              f"max {g['max_ms']:.0f} ms (before: p50 {b['p50_ms']:.0f} ms); case TTFT p50 {t['p50_ms']:.0f} ms, "
              f"p95 {t['p95_ms']:.0f} ms; gap p95 per trial {', '.join(f'{x:.0f}' for x in stall[mode]['stream_gap_p95_ms_per_trial'])}",
              flush=True)
    fidelity = await _fidelity(runner, renderer, svc, users, resolver)
    return {"quick": quick, "conversations": convs, "questions_per_conversation": n_q, "reps": reps,
            "window": DEFAULT_WINDOW, "compared_windows": list(COMPARED_WINDOWS), "recompute_tails": list(RECOMPUTE_TAILS),
            "by_k": {str(k): v for k, v in by_k.items()}, "fidelity_k": FIDELITY_K,
            "fidelity": fidelity, "load_stall": stall}


async def _fidelity(runner: Any, renderer: Any, svc: Any, users: list[tuple[str, list[Any]]], resolver: Any) -> dict[str, Any]:
    """Fidelity at each k of FIDELITY_KS: prompt injection, the default window's KV (with its
    recompute tails at the ks of TAIL_KS), and KV of each window of COMPARED_WINDOWS. One question
    at a time: its cases are built, scored and dropped (a k = 50 case holds its prepared KV, ~128 MB
    in float32, and a full run has 36 questions of six modes)."""
    from baton.bench import memory_fidelity

    fidelity: dict[str, Any] = {}
    for k in FIDELITY_KS:
        tally = memory_fidelity.Tally()
        tails = RECOMPUTE_TAILS if k in TAIL_KS else ()
        for user, qas in users:
            for qa in qas:
                (case,), _, _ = await _build_cases(runner, renderer, svc, user, [qa], k, DEFAULT_WINDOW, resolver, tails)
                modes = {"prompt": case, f"kv_w{DEFAULT_WINDOW}": case}
                for w in COMPARED_WINDOWS:
                    (modes[f"kv_w{w}"],), _, _ = await _build_cases(runner, renderer, svc, user, [qa], k, w, resolver)
                modes |= {f"kv_w{DEFAULT_WINDOW}_tail{t}": case.tails[t] for t in tails}
                await memory_fidelity.measure_question(runner, renderer, modes, tally, with_f1=k == FIDELITY_K)
                del case, modes
        scores = tally.scores()
        fidelity[str(k)] = {m: f.as_json() for m, f in scores.items()}
        for m, f in scores.items():
            f1 = f" answer F1 {f.answer_f1:.3f}," if f.answer_f1 is not None else ""
            print(f"[memory] fidelity k={k} {m:>13}: top-1 agreement with prompt {f.top1_agreement_with_prompt:.3f}, "
                  f"KL {f.kl_to_prompt_mean:.4f} nats (p95 {f.kl_to_prompt_p95:.4f}),{f1} top-1 along reference "
                  f"{f.top1_accuracy:.3f} ({f.positions} positions)", flush=True)
    return fidelity


async def _fidelity_only(runner: Any, renderer: Any, svc: Any, users: list[tuple[str, list[Any]]], quick: bool,
                         convs: list[str], n_q: int) -> dict[str, Any]:
    """Only the fidelity phase (`--fidelity-only`): the same cases and scores as a whole run's, in
    minutes instead of the TTFT sweep's hours on a slow CPU; no timing is claimed."""
    from memory_store.resolver import SegmentResolver

    resolver = SegmentResolver(runner, store=None, local_capacity_bytes=4 << 30)
    fidelity = await _fidelity(runner, renderer, svc, users, resolver)
    return {"quick": quick, "fidelity_only": True, "conversations": convs, "questions_per_conversation": n_q,
            "window": DEFAULT_WINDOW, "compared_windows": list(COMPARED_WINDOWS), "recompute_tails": list(RECOMPUTE_TAILS),
            "fidelity_k": FIDELITY_K, "fidelity": fidelity}


def run(quick: bool, out_dir: Path, dtype: str = "auto", fidelity_only: bool = False) -> dict[str, Any]:
    """dtype: the engine's (auto, as a replica's: bfloat16 where the CPU computes it natively, else
    float32; the JSON records which). fidelity_only: only the fidelity phase (its RESULT carries
    fidelity_result's figures)."""
    return asyncio.run(_main(quick, out_dir, dtype, fidelity_only))


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_k, fidelity, service = report["by_k"], report["fidelity"], report["service"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    ks = sorted(int(k) for k in by_k)
    for mode, style in (("prompt", "o-"), ("kv", "s-"), ("hit", "^-")):
        p50 = [by_k[str(k)]["ttft"][mode]["p50_s"] * 1000 for k in ks]
        p95 = [by_k[str(k)]["ttft"][mode]["p95_s"] * 1000 for k in ks]
        axes[0].plot(ks, p50, style, label=f"{mode} p50")
        axes[0].fill_between(ks, p50, p95, alpha=0.15)
    axes[0].set_xlabel("memories recalled (k)")
    axes[0].set_ylabel("engine TTFT (ms)")
    axes[0].set_yscale("log")
    axes[0].set_title("engine TTFT vs k (band: p50..p95)")
    axes[0].legend()
    sks = sorted(int(k) for k in service)
    for tier, style in (("warm", "s-"), ("pull", "o-"), ("pull_ray", "v-"), ("encode", "^-")):
        axes[1].plot(sks, [service[str(k)]["concurrency_1"][tier]["p50_s"] * 1000 for k in sks], style, label=f"{tier} (c=1)")
    loaded = next(c for c in service[str(sks[0])] if c != "concurrency_1")
    axes[1].plot(sks, [service[str(k)][loaded]["warm"]["p50_s"] * 1000 for k in sks], "s--", label=f"warm ({loaded})")
    axes[1].set_xlabel("memories recalled (k)")
    axes[1].set_ylabel("service TTFT p50 (ms)")
    axes[1].set_title("question text -> first token")
    axes[1].legend()
    fks = sorted(fidelity, key=int)
    modes = list(fidelity[fks[0]])
    width = 0.8 / len(fks)
    for i, k in enumerate(fks):
        axes[2].bar([j + i * width for j in range(len(modes))], [fidelity[k][m]["top1_agreement_with_prompt"] for m in modes],
                    width, label=f"k={k}")
    axes[2].set_xticks([j + width / 2 for j in range(len(modes))], modes)
    axes[2].set_title("top-1 agreement with prompt injection")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
