"""`baton bench memory`: InferScale on LoCoMo — KV injection vs prompt injection of memories.

One real engine (SmolLM2 on vLLM CPU, the segment connector, in this process), the real memory
store logic (SQLite + all-MiniLM-L6-v2 retrieval, memory_store/store.py) and the replica's
resolver (memory_store/resolver.py). Facts are a LoCoMo conversation's dialog turns (one user
per conversation), questions its `qa` items. Both modes send the same token ids (the layout of
memory_store/layout.py); prompt injection computes every token, KV injection loads the anchor
and the facts from precomputed segments and computes the rest. Every request carries a fresh
cache salt, so no measured request is served from vLLM's prefix cache.

Measured, for k in {5, 10, 20, 50}:
- TTFT (engine submit → first token, concurrency 1, max_tokens 1) p50/p95 per mode;
- throughput (requests/s and output tokens/s) at a fixed concurrency, max_tokens 16;
- fidelity at k=10: teacher-forced top-1 accuracy along the reference answer (the share of
  reference tokens the model predicts as its top token, given the reference prefix), for prompt
  injection, KV injection with the default window w, and with w = 0; plus generated answers'
  token-F1 against the reference, and top-1 agreement between KV and prompt injection.
Segments are encoded before timing (InferScale precomputes them when facts are added); the
time to encode is reported separately.
"""
from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from baton.bench.stats import quantile
from baton.paths import REPO_ROOT

ROOT = REPO_ROOT
LOCOMO = ROOT.parent / "shared" / "data" / "locomo"
KS = (5, 10, 20, 50)
FIDELITY_K = 10
DEFAULT_WINDOW = 2


def _runner(model_path: str) -> Any:
    from baton.bench.local_engine import local_engine

    return local_engine(model_path, max_model_len=4096, kv_cache_gib=1.0, cpu_threads=2, max_num_seqs=16)


async def _request(runner: Any, ids: Sequence[int], segs: Any, max_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT s, output tokens, cached prompt tokens) of one greedy request with a fresh salt."""
    from baton.engine.types import GenerationRequest, SamplingSpec

    req = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=tuple(ids),
                            sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0), cache_salt=uuid.uuid4().hex)
    t0 = time.perf_counter()
    ttft, toks, cached = None, [], 0
    async for d in runner.generate(req, injection=segs):
        if ttft is None and d.token_ids:
            ttft = time.perf_counter() - t0
        toks.extend(d.token_ids)
        cached = max(cached, d.cached_tokens)
    return ttft or (time.perf_counter() - t0), toks, cached


def _f1(pred: str, ref: str) -> float:
    p, r = re.findall(r"\w+", pred.lower()), re.findall(r"\w+", ref.lower())
    common = sum((Counter(p) & Counter(r)).values())
    if not p or not r or not common:
        return 0.0
    prec, rec = common / len(p), common / len(r)
    return 2 * prec * rec / (prec + rec)


class _Case:
    """One question of one user at one k and window: its prompt and (for KV mode) its segments."""

    def __init__(self, prompt: Any, segs: Any, answer: str):
        self.prompt, self.segs, self.answer = prompt, segs, answer


async def _build_cases(runner: Any, renderer: Any, svc: Any, user: str, qas: Sequence[Any], k: int, window: int,
                       resolver: Any) -> tuple[list[_Case], float]:
    from memory_store.layout import memory_prompt

    cases, enc_s = [], 0.0
    for qa in qas:
        recall = svc.recall(user, qa.question, k, window)
        p = memory_prompt(renderer, [{"role": "user", "content": qa.question}], recall.facts,
                          user=user, model="smollm2", window=window, inject=True)
        t0 = time.perf_counter()
        segs = await resolver.resolve(p.token_ids, p.injection)
        enc_s += time.perf_counter() - t0
        cases.append(_Case(p, segs, qa.answer))
    return cases, enc_s


async def _ttft(runner: Any, cases: Sequence[_Case], reps: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"prompt": [], "kv": []}
    cached: dict[str, list[int]] = {"prompt": [], "kv": []}
    for _ in range(reps):
        for c in cases:  # interleave the modes so drift on a shared machine hits both alike
            for mode, segs in (("prompt", None), ("kv", c.segs)):
                t, _, n = await _request(runner, c.prompt.token_ids, segs, 1)
                out[mode].append(t)
                cached[mode].append(n)
    prompt_len = sum(len(c.prompt.token_ids) for c in cases) / len(cases)
    return {m: {"p50_s": quantile(v, 0.5), "p95_s": quantile(v, 0.95), "n": len(v), "mean_cached_tokens": sum(cached[m]) / len(v)}
            for m, v in out.items()} | {"mean_prompt_tokens": prompt_len}


async def _throughput(runner: Any, cases: Sequence[_Case], concurrency: int, max_tokens: int) -> dict[str, Any]:
    res = {}
    for mode in ("prompt", "kv"):
        sem = asyncio.Semaphore(concurrency)
        toks = 0

        async def one(c: _Case, sem: asyncio.Semaphore, inject: bool) -> None:
            nonlocal toks
            async with sem:
                _, out, _ = await _request(runner, c.prompt.token_ids, c.segs if inject else None, max_tokens)
                toks += len(out)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, sem, mode == "kv") for c in cases))
        wall = time.perf_counter() - t0
        res[mode] = {"requests_per_s": len(cases) / wall, "output_tok_per_s": toks / wall, "wall_s": wall}
    return res


async def _fidelity(runner: Any, renderer: Any, cases: Sequence[_Case], kv_cases: dict[str, Sequence[_Case]]) -> dict[str, Any]:
    """Teacher-forced top-1 accuracy along each reference answer, per mode; F1 of greedy answers."""
    modes: dict[str, list[tuple[_Case, Any]]] = {"prompt": [(c, None) for c in cases]}
    for name, cs in kv_cases.items():
        modes[name] = [(c, c.segs) for c in cs]
    preds: dict[str, list[int]] = {m: [] for m in modes}
    hits: dict[str, list[int]] = {m: [] for m in modes}
    f1: dict[str, list[float]] = {m: [] for m in modes}
    for m, items in modes.items():
        for c, segs in items:
            ref = renderer.text_tokens(c.answer)[:12]
            for i in range(len(ref)):
                _, out, _ = await _request(runner, tuple(c.prompt.token_ids) + tuple(ref[:i]), segs, 1)
                preds[m].append(out[0] if out else -1)
                hits[m].append(int(bool(out) and out[0] == ref[i]))
            _, out, _ = await _request(runner, c.prompt.token_ids, segs, 24)
            f1[m].append(_f1(renderer.decode(out) if hasattr(renderer, "decode") else "", c.answer))
    res: dict[str, Any] = {}
    for m in modes:
        agree = sum(a == b for a, b in zip(preds[m], preds["prompt"], strict=True)) / max(1, len(preds[m]))
        res[m] = {"top1_accuracy": sum(hits[m]) / max(1, len(hits[m])), "answer_f1": sum(f1[m]) / max(1, len(f1[m])),
                  "top1_agreement_with_prompt": agree, "positions": len(hits[m])}
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


async def _main(quick: bool, out_dir: Path) -> dict[str, Any]:
    from baton.engine.args import resolve_model_path
    from memory_store.config import MemoryConfig
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
    svc = MemoryService(MemoryConfig(max_k=64), FactStore(tmp / "facts.sqlite3"), MiniLMEmbedder())
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
    runner = _runner(model_path)
    print(f"[memory] engine up in {time.perf_counter() - t0:.1f}s")
    try:
        return await _measure(runner, renderer, svc, users, quick, convs, n_q, reps, concurrency, out_dir)
    finally:
        runner.shutdown()


async def _measure(runner: Any, renderer: Any, svc: Any, users: list[tuple[str, list[Any]]], quick: bool,
                   convs: list[str], n_q: int, reps: int, concurrency: int, out_dir: Path) -> dict[str, Any]:
    from kv_transfer.segment_stats import segment_stats
    from memory_store.resolver import SegmentResolver

    resolver = SegmentResolver(runner, store=None, local_capacity_bytes=4 << 30)
    # warm-up (unmeasured): one request of each mode
    warm, _ = await _build_cases(runner, renderer, svc, users[0][0], users[0][1][:1], 5, DEFAULT_WINDOW, resolver)
    await _ttft(runner, warm, 1)

    by_k: dict[int, Any] = {}
    cases_k: dict[int, list[_Case]] = {}
    for k in KS:
        cases, enc_s = [], 0.0
        for user, qas in users:
            cs, e = await _build_cases(runner, renderer, svc, user, qas, k, DEFAULT_WINDOW, resolver)
            cases += cs
            enc_s += e
        cases_k[k] = cases
        before = segment_stats()
        ttft = await _ttft(runner, cases, reps)
        after = segment_stats()
        load_ms = 1000 * (after.load_seconds - before.load_seconds) / max(1, after.injections - before.injections)
        by_k[k] = {"ttft": ttft, "encode_s": enc_s, "mean_load_ms": load_ms}
        print(f"[memory] k={k:>2}: prompt {ttft['mean_prompt_tokens']:.0f} tokens; TTFT p50 prompt {ttft['prompt']['p50_s'] * 1000:.0f} ms "
              f"vs kv {ttft['kv']['p50_s'] * 1000:.0f} ms (p95 {ttft['prompt']['p95_s'] * 1000:.0f} vs {ttft['kv']['p95_s'] * 1000:.0f}); "
              f"kv cached {ttft['kv']['mean_cached_tokens']:.0f}, load {load_ms:.0f} ms; encode {enc_s:.1f}s")
    for k in (KS[0], KS[-1]):
        by_k[k]["throughput"] = await _throughput(runner, cases_k[k], concurrency, 16)
        t = by_k[k]["throughput"]
        print(f"[memory] k={k}: throughput at concurrency {concurrency}: prompt {t['prompt']['requests_per_s']:.2f} req/s, "
              f"kv {t['kv']['requests_per_s']:.2f} req/s")
    w0 = []
    for user, qas in users:
        cs, _ = await _build_cases(runner, renderer, svc, user, qas, FIDELITY_K, 0, resolver)
        w0 += cs
    fidelity = await _fidelity(runner, renderer, cases_k[FIDELITY_K], {f"kv_w{DEFAULT_WINDOW}": cases_k[FIDELITY_K], "kv_w0": w0})
    for m, f in fidelity.items():
        print(f"[memory] fidelity {m:>7}: top-1 along reference {f['top1_accuracy']:.3f} ({f['positions']} positions), "
              f"answer F1 {f['answer_f1']:.3f}, top-1 agreement with prompt {f['top1_agreement_with_prompt']:.3f}")

    kv5, kv50 = by_k[5]["ttft"]["kv"]["p50_s"], by_k[50]["ttft"]["kv"]["p50_s"]
    pr5, pr50 = by_k[5]["ttft"]["prompt"]["p50_s"], by_k[50]["ttft"]["prompt"]["p50_s"]
    base = fidelity["prompt"]["top1_accuracy"] or float("nan")
    result = {
        "kv_ttft_growth_k50_over_k5": kv50 / kv5,
        "prompt_ttft_growth_k50_over_k5": pr50 / pr5,
        "ttft_speedup_k50": pr50 / kv50,
        "fidelity_ratio": fidelity[f"kv_w{DEFAULT_WINDOW}"]["top1_accuracy"] / base,
        "fidelity_ratio_w0": fidelity["kv_w0"]["top1_accuracy"] / base,
    }
    report = {"quick": quick, "conversations": convs, "questions_per_conversation": n_q, "reps": reps,
              "window": DEFAULT_WINDOW, "by_k": {str(k): v for k, v in by_k.items()}, "fidelity_k": FIDELITY_K,
              "fidelity": fidelity, "result": result}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "memory.json").write_text(json.dumps(report, indent=2))
    _plot(by_k, fidelity, out_dir / "memory.png")
    print(f"[memory] wrote {out_dir / 'memory.json'} and {out_dir / 'memory.png'}")
    print("RESULT " + " ".join(f"{k}={v:.3f}" for k, v in result.items()))
    return report


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    return asyncio.run(_main(quick, out_dir))


def _plot(by_k: dict[int, Any], fidelity: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    ks = sorted(by_k)
    for mode, style in (("prompt", "o-"), ("kv", "s-")):
        p50 = [by_k[k]["ttft"][mode]["p50_s"] * 1000 for k in ks]
        p95 = [by_k[k]["ttft"][mode]["p95_s"] * 1000 for k in ks]
        axes[0].plot(ks, p50, style, label=f"{mode} injection p50")
        axes[0].fill_between(ks, p50, p95, alpha=0.15)
    axes[0].set_xlabel("memories recalled (k)")
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].set_title("TTFT vs k (band: p50..p95)")
    axes[0].legend()
    names = list(fidelity)
    axes[1].bar(names, [fidelity[n]["top1_accuracy"] for n in names])
    axes[1].set_title(f"top-1 accuracy along reference answers (k={FIDELITY_K})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
