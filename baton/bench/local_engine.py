"""One in-process engine with Baton's segment connector, for benchmarks and end-to-end tests
(outside Serve): the same EngineArgs a colocated decode replica of that model would get."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from baton.engine.runner import EngineRunner
from baton.paths import REPO_ROOT

ROOT = REPO_ROOT


def local_engine(model_path: str | Path, *, max_model_len: int = 4096, kv_cache_gib: float = 1.0, cpu_threads: int = 2,
                 max_num_seqs: int = 16, segments: bool = True, extra_engine_args: dict[str, Any] | None = None,
                 block_size: int | None = None, dtype: str = "auto") -> EngineRunner:
    from baton.engine.args import build_engine_spec
    from baton.engine.config import EngineConfig

    path = str(model_path)
    cfg = EngineConfig(model=path, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib, cpu_threads=cpu_threads,
                       max_num_seqs=max_num_seqs, extra_engine_args=extra_engine_args or {}, block_size=block_size,
                       dtype=dtype)
    spec = build_engine_spec(cfg, role="decode", handoff=False, model_path=path, on_gpu=False,
                             cache_root=str(ROOT / ".cache"), segments=segments)
    return EngineRunner(spec)
