"""The overhead bench's `vllm serve` baseline gets the engine arguments the other phases get,
as flags vLLM's own server parser accepts (no engine is built)."""
from __future__ import annotations

from baton.bench.overhead import _engine_config, vllm_serve_argv
from baton.engine.args import build_engine_spec


def test_vllm_serve_gets_the_same_engine_arguments(tmp_path) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = build_engine_spec(_engine_config(8192), role="decode", handoff=False, model_path=str(tmp_path), on_gpu=False,
                             cache_root=str(tmp_path))
    argv = vllm_serve_argv(spec, 28100)
    assert argv[:3] == ["vllm", "serve", str(tmp_path)]
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    args = AsyncEngineArgs.from_cli_args(ns)
    from baton.engine.vllm_engine import engine_kwargs_here

    kw = engine_kwargs_here(spec)
    assert kw["dtype"] in ("bfloat16", "float32")  # `auto` resolved for this CPU, as the other phases' engines
    for field in ("max_model_len", "dtype", "enforce_eager", "enable_prefix_caching", "max_num_seqs", "seed", "kv_cache_memory_bytes"):
        assert getattr(args, field) == kw[field], field
    assert ns.port == 28100
