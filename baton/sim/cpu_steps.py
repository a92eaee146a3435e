"""Time a real vLLM CPU engine (SmolLM2, the engine `bench conserve` runs) for the calibration's
step-time model (calibrate.py). Not run by the tests or by `bench scale`; run it alone, with
nothing else on the core it pins:

    PYTHONPATH=. .venv/bin/python -m baton.sim.cpu_steps --out runs/cpu-steps.json [--core 1]

The engine is built from the same EngineConfig as a conserve pool (baton/bench/conserve.pool_args:
max_model_len 8192, kv_cache_gib 1.0, one core, in-process, eager) by baton/engine/args.py, then
driven step by step:
- prefill: a prompt of `context` tokens is computed first (cached), then `context + tokens` with
  max_tokens=1; the time of the steps until its one token = one prefill chunk of `tokens` new
  tokens after `context` in KV (tokens <= max_num_batched_tokens, so one step);
- decode: `batch` requests of `context` tokens each, all prefilled first; then the median time of
  DECODE_STEPS pure decode steps. A point whose requests the KV pool cannot hold at once (or that
  the scheduler did not run all together) is skipped and listed under "skipped", never timed.
Each point is the minimum over REPEATS (a noisy shared machine only ever adds time).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from baton.engine.scheduler_stats import find_scheduler

PREFILL_GRID = [(n, c) for c in (0, 1024, 3072) for n in (128, 512, 1024, 2048, 4096) if n + c < 8000]
DECODE_GRID = [(b, c) for c in (256, 2048, 4096) for b in (1, 2, 4, 8, 16, 32)]
DECODE_STEPS = 12
REPEATS = 3
SMOLLM2_KV_BYTES_PER_TOKEN = 23_040  # 2 × 30 layers × 3 KV heads × 64 × 2 B (DESIGN.md)


def build_engine(core: int) -> Any:
    from baton.engine.args import build_engine_spec
    from baton.engine.config import EngineConfig
    from baton.paths import REPO_ROOT

    path = str(Path(REPO_ROOT) / ".cache" / "models" / "SmolLM2-135M-Instruct")
    cfg = EngineConfig(model=path, max_model_len=8192, kv_cache_gib=1.0)
    spec = build_engine_spec(cfg, role="decode", handoff=False, model_path=path, on_gpu=False,
                             cache_root=str(Path(REPO_ROOT) / ".cache"), cpu_cores=(core,))
    os.environ.update(spec.env)
    os.sched_setaffinity(0, {core})
    from vllm import EngineArgs, LLMEngine

    from baton.engine.vllm_engine import engine_kwargs_here

    return LLMEngine.from_engine_args(EngineArgs(**engine_kwargs_here(spec)))


def _run(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str) -> None:
    from vllm import SamplingParams

    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _drain(engine: Any) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def time_prefill(engine: Any, rng: random.Random, tokens: int, context: int) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        base = [rng.randrange(1000, 40000) for _ in range(context)]
        if context:
            _run(engine, [base + [7]], 1, "warm")
            _drain(engine)
        _run(engine, [base + [rng.randrange(1000, 40000) for _ in range(tokens)]], 1, "pre")
        t0 = time.perf_counter()
        _drain(engine)
        best = min(best, time.perf_counter() - t0)
    return best


def fits(batch: int, context: int, capacity_tokens: int) -> bool:
    """Whether `batch` sequences of `context` tokens, decoding DECODE_STEPS + 8 more, fit the KV pool
    at once (a point that does not fit would time preemption or an idle step, not a decode step)."""
    return batch * (context + DECODE_STEPS + 8) <= capacity_tokens


def time_decode(engine: Any, rng: random.Random, batch: int, context: int) -> float | None:
    """The median decode-step time of `batch` running sequences; None when the scheduler did not
    run all of them through the timed steps (the point is then left out, never timed short)."""
    sched = find_scheduler(engine)
    best = float("inf")
    for _ in range(REPEATS):
        _run(engine, [[rng.randrange(1000, 40000) for _ in range(context)] for _ in range(batch)], DECODE_STEPS + 8, "dec")
        for _ in range(64):  # prefill them all (chunks under the token budget)
            outs = engine.step()
            if sum(1 for o in outs if o.outputs and len(o.outputs[0].token_ids) >= 1) >= batch:
                break
        times, all_running = [], True
        for _ in range(DECODE_STEPS):
            all_running &= len(sched.running) == batch and not sched.waiting
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        _drain(engine)
        if not all_running:
            return None
        best = min(best, statistics.median(times))
    return best


def measure(core: int) -> dict[str, Any]:
    engine = build_engine(core)
    rng = random.Random(0)
    sched = engine.vllm_config.scheduler_config
    cache = engine.vllm_config.cache_config
    out: dict[str, Any] = {"engine": {
        "max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs, "block_size": cache.block_size,
        "kv_capacity_tokens": (cache.num_gpu_blocks or 0) * cache.block_size, "bytes_per_token": SMOLLM2_KV_BYTES_PER_TOKEN,
        "max_model_len": 8192, "core": core, "threads": os.environ.get("OMP_NUM_THREADS")}, "prefill": [], "decode": []}
    for n, c in PREFILL_GRID:
        if n <= sched.max_num_batched_tokens:
            out["prefill"].append({"tokens": n, "context": c, "seconds": time_prefill(engine, rng, n, c)})
            print(f"[cpu-steps] prefill {n} after {c}: {out['prefill'][-1]['seconds'] * 1e3:.1f} ms", flush=True)
    out["skipped"] = []
    for b, c in DECODE_GRID:
        seconds = time_decode(engine, rng, b, c) if fits(b, c, out["engine"]["kv_capacity_tokens"]) else None
        if seconds is None:
            out["skipped"].append({"batch": b, "context": c, "why": "not all sequences running at once (KV pool too small)"})
            print(f"[cpu-steps] decode batch {b} at {c}: skipped, the pool does not hold them all", flush=True)
            continue
        out["decode"].append({"batch": b, "context": c, "seconds": seconds})
        print(f"[cpu-steps] decode batch {b} at {c}: {seconds * 1e3:.1f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--core", type=int, default=1, help="the core to pin the engine to (conserve's decode engine runs on core 1)")
    args = ap.parse_args()
    result = measure(args.core)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"[cpu-steps] wrote {args.out}")


if __name__ == "__main__":
    main()
