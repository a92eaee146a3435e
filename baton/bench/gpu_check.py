"""GPU check of memory injection (scripts/gpu_check.sh): one engine with the decode pool's engine
settings of cluster_configs/gpu_example.yaml, on one GPU, with a small model (SmolLM2-135M by
default), the real memory store logic (SQLite + MiniLM retrieval) and the replica's resolver.

It checks and prints:
- exact injection: the KV of a prompt's memory prefix, captured by the segment connector from the
  engine's own cache and injected again, reproduces the greedy tokens of computing it (and their
  logprobs within 0.1 nats);
- engine TTFT p50 at k = 5 and k = 50 recalled facts for prompt injection, KV injection, and a
  prefix-cache hit of the same memory prefix (the floor), and the growth k = 50 / k = 5 of each.
Facts are generated (deterministic, 80 of them), so the check needs nothing outside the project.

`--device cpu` runs the same check on CPU (what the e2e suite does, so the script cannot rot).
Last line: `RESULT device=<cuda|cpu> exact_injection=<ok|FAILED> kv_ttft_growth_k50_over_k5=...
hit_ttft_growth_k50_over_k5=... kv_over_hit_growth=... prompt_ttft_growth_k50_over_k5=...
ttft_speedup_k50=...`; JSON in runs/gpu-check-<stamp>/. Exit status 1 when exact injection fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baton.bench.stats import quantile
from baton.paths import REPO_ROOT

CONFIG = REPO_ROOT / "cluster_configs" / "gpu_example.yaml"
KS = (5, 50)
PEOPLE = ("Ana", "Bo", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana")
THINGS = ("a red bicycle", "a tortoise called Mo", "a lemon tree", "a blue kayak", "a jazz record collection",
          "a vintage camera", "a sourdough starter", "a telescope", "a chess set", "a ukulele")


@dataclass(frozen=True)
class _Question:
    question: str
    answer: str


def facts() -> list[str]:
    """Pure: 80 distinct facts, one per person and thing."""
    return [f"{p} owns {t} and keeps it at home number {i * len(THINGS) + j + 1}."
            for i, p in enumerate(PEOPLE) for j, t in enumerate(THINGS)]


def engine_config(model: str, device: str) -> Any:
    """The decode pool's engine of gpu_example.yaml, with `model` and a KV pool a small model needs."""
    import yaml

    from baton.engine.config import EngineConfig

    app = yaml.safe_load(CONFIG.read_text())["applications"][0]["args"]
    fields = dict(app["decode"]["engine"])
    fields.update(model=model, max_model_len=4096, kv_cache_gib=2.0 if device == "cuda" else 1.0, max_num_seqs=16)
    if device == "cpu":  # CPU: eager only, the CPU attention kernel's smallest block, the dtype a CPU replica takes
        fields.update(enforce_eager=True, block_size=32, cpu_threads=2, dtype="auto")
    return EngineConfig(**fields)


def _runner(model_path: str, device: str) -> Any:
    from baton.engine.args import build_engine_spec
    from baton.engine.runner import EngineRunner

    cfg = engine_config(model_path, device)
    spec = build_engine_spec(cfg, role="decode", handoff=False, model_path=model_path, on_gpu=device == "cuda",
                             cache_root=str(REPO_ROOT / ".cache"), segments=True)
    return EngineRunner(spec)


async def _exact(runner: Any, prompt: Any) -> dict[str, Any]:
    from baton.bench.memory import _request

    end = prompt.injection.end
    (seg,) = await runner.capture(uuid.uuid4().hex, prompt.token_ids, ((0, end),), cache_salt=uuid.uuid4().hex)
    _, plain, _ = await _request(runner, prompt.token_ids, None, 16)
    _, injected, cached = await _request(runner, prompt.token_ids, (seg,), 16)
    return {"ok": plain == injected and cached >= end, "plain": plain, "injected": injected, "cached_tokens": cached,
            "inject_end": end}


async def _ttfts(runner: Any, cases: list[Any], reps: int) -> dict[str, float]:
    from baton.bench.memory import _request

    out: dict[str, list[float]] = {"prompt": [], "kv": [], "hit": []}
    for _ in range(reps):
        for c in cases:
            salt = uuid.uuid4().hex
            await _request(runner, c.prompt.token_ids[: c.prompt.injection.end], None, 1, salt)  # primes the hit
            out["hit"].append((await _request(runner, c.prompt.token_ids, None, 1, salt))[0])
            out["prompt"].append((await _request(runner, c.prompt.token_ids, None, 1))[0])
            out["kv"].append((await _request(runner, c.prompt.token_ids, c.prepared_kv, 1))[0])
    return {m: quantile(v, 0.5) for m, v in out.items()}


async def _check(device: str, model: str, reps: int, n_questions: int = 4) -> dict[str, Any]:
    from baton.bench.memory import _build_cases, _Renderer
    from baton.engine.args import resolve_model_path
    from memory_store.config import MemoryConfig
    from memory_store.db import FactStore
    from memory_store.embedder import MiniLMEmbedder
    from memory_store.resolver import SegmentResolver
    from memory_store.store import MemoryService

    model_path = resolve_model_path(model, str(REPO_ROOT / ".cache" / "models"))
    renderer = _Renderer(model_path)
    tmp = Path(tempfile.mkdtemp(prefix="baton-gpu-check-"))
    svc = MemoryService(MemoryConfig(max_k=64, segment_capacity_mb=1024), FactStore(tmp / "facts.sqlite3"), MiniLMEmbedder())
    svc.add("user", facts(), "gpu-check")
    questions = [_Question(f"Where does {p} keep {t}?", "") for p, t in zip(PEOPLE, THINGS, strict=False)][:n_questions]
    t0 = time.perf_counter()
    runner = _runner(model_path, device)
    started = time.perf_counter() - t0
    try:
        resolver = SegmentResolver(runner, store=None, local_capacity_bytes=2 << 30)
        by_k: dict[str, Any] = {}
        exact: dict[str, Any] = {}
        for k in KS:
            cases, encode_s, prepare_s = await _build_cases(runner, renderer, svc, "user", questions, k, 2, resolver)
            if k == KS[0]:
                await _ttfts(runner, cases[:1], 1)  # warm-up, not measured
                exact = await _exact(runner, cases[0].prompt)
            by_k[str(k)] = {"ttft_p50_s": await _ttfts(runner, cases, reps), "encode_s": encode_s, "prepare_s": prepare_s,
                            "prompt_tokens": sum(len(c.prompt.token_ids) for c in cases) / len(cases)}
    finally:
        runner.shutdown()
    lo, hi = by_k[str(KS[0])]["ttft_p50_s"], by_k[str(KS[-1])]["ttft_p50_s"]
    kv_g, hit_g = hi["kv"] / lo["kv"], hi["hit"] / lo["hit"]
    result = {"kv_ttft_growth_k50_over_k5": kv_g, "hit_ttft_growth_k50_over_k5": hit_g, "kv_over_hit_growth": kv_g / hit_g,
              "prompt_ttft_growth_k50_over_k5": hi["prompt"] / lo["prompt"], "ttft_speedup_k50": hi["prompt"] / hi["kv"]}
    return {"device": device, "model": model_path, "engine_start_s": started, "reps": reps, "questions": len(questions),
            "exact_injection": exact, "by_k": by_k, "result": result}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="a folder, or a name under .cache/models")
    ap.add_argument("--reps", type=int, default=5, help="timed requests per question, mode and k")
    ap.add_argument("--questions", type=int, default=4, help="questions timed per mode and k (1 to 8)")
    ap.add_argument("--out", type=Path, default=None, help="where the JSON goes (default runs/gpu-check-<stamp>)")
    args = ap.parse_args(argv)
    if not 1 <= args.questions <= len(PEOPLE):
        ap.error(f"--questions must be 1 to {len(PEOPLE)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
                  "install the CUDA vllm (pip install -e '.[gpu]') on a GPU machine, or run with --device cpu",
                  file=sys.stderr)
            return 2
    report = asyncio.run(_check(args.device, args.model, args.reps, args.questions))
    out = args.out or REPO_ROOT / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    ex = report["exact_injection"]
    print(f"[gpu-check] {args.device}: exact injection of {ex['inject_end']} tokens: "
          f"{'same greedy tokens' if ex['ok'] else 'DIFFERENT tokens'} ({ex['cached_tokens']} prompt tokens not computed)")
    for k, row in report["by_k"].items():
        t = row["ttft_p50_s"]
        print(f"[gpu-check] k={k}: {row['prompt_tokens']:.0f} prompt tokens; TTFT p50 prompt {1000 * t['prompt']:.1f} ms, "
              f"kv {1000 * t['kv']:.1f} ms, hit {1000 * t['hit']:.1f} ms")
    print(f"[gpu-check] wrote {out / 'gpu_check.json'}")
    print(f"RESULT device={args.device} exact_injection={'ok' if ex['ok'] else 'FAILED'} "
          + " ".join(f"{k}={v:.3f}" for k, v in report["result"].items()))
    return 0 if ex["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
