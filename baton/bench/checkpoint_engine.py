"""Run one real vLLM engine (tiny hybrid model) over a list of token-id prompts, one at a time.

Used by tests/e2e/test_checkpoints.py and `baton bench checkpoints`: each call runs in its own
spawned process (one engine per process, nothing left behind) and returns plain data: greedy
output tokens, vLLM's cached-token count (the hit depth), TTFT per request and, with Baton's
scheduler, its CheckpointMetrics and plans.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import asdict
from typing import Any

from baton.paths import REPO_ROOT

ROOT = REPO_ROOT
TINY_HYBRID = ROOT / ".cache" / "models" / "tiny-lfm2"


def engine_kwargs(mode: str, ckpt: dict[str, Any] | None, max_model_len: int, dtype: str = "float32") -> dict[str, Any]:
    """mode: 'nocache' (prefix caching off), 'vllm' (vLLM's own hybrid prefix cache), 'baton' (ckpt)."""
    from baton.engine.args import build_engine_spec
    from baton.engine.config import EngineConfig

    cfg = EngineConfig(
        model=str(TINY_HYBRID), max_model_len=max_model_len, dtype=dtype, kv_cache_gib=0.5, max_num_seqs=4,
        enable_prefix_caching=mode != "nocache", checkpoints=ckpt if mode == "baton" else None,
    )
    spec = build_engine_spec(cfg, role="decode", handoff=False, model_path=str(TINY_HYBRID), on_gpu=False, cache_root=str(ROOT / ".cache"))
    os.environ.update(spec.env)
    return spec.engine_kwargs


def _run(mode: str, ckpt: dict[str, Any] | None, prompts: list[list[int]], max_tokens: int, max_model_len: int, dtype: str,
         out: Any) -> None:
    try:
        kwargs = engine_kwargs(mode, ckpt, max_model_len, dtype)
        from vllm import SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        sched = engine.engine_core.engine_core.scheduler
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        rows = []
        for i, ids in enumerate(prompts):
            t0 = time.perf_counter()
            first = None
            engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if first is None and o.outputs and o.outputs[0].token_ids:
                        first = time.perf_counter() - t0
                    if o.finished:
                        rows.append({"tokens": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0), "ttft_s": first})
        res: dict[str, Any] = {"rows": rows}
        if hasattr(sched, "checkpoint_metrics"):
            res["metrics"] = asdict(sched.checkpoint_metrics())
            res["plans"] = [list(st.plan.positions) for st in sched.checkpoint_policy.families.values()]
        out.put(res)
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which raises
        import traceback

        out.put({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"})


def run_engine(mode: str, prompts: list[list[int]], *, ckpt: dict[str, Any] | None = None, max_tokens: int = 8, max_model_len: int = 4096,
               dtype: str = "float32", timeout_s: float = 900) -> dict[str, Any]:
    """Start an engine in a fresh process, send the prompts one after another, return its rows."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_run, args=(mode, ckpt, prompts, max_tokens, max_model_len, dtype, q), daemon=True)
    p.start()
    try:
        res = q.get(timeout=timeout_s)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if "error" in res:
        raise RuntimeError(f"engine run ({mode}) failed: {res['error']}")
    return res
