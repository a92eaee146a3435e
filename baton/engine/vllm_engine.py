"""Building and stopping the in-process vLLM engine (the runner's default engine factory).

Both run on the runner's engine thread: the engine is not thread-safe, so the thread that
builds it is the one that steps it and shuts it down.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from baton.engine.args import EngineSpec, engine_dtype
from baton.engine.cpu_cores import is_poller, pin_threads, poller_cores, thread_ids, thread_name

logger = logging.getLogger("baton.engine")


def apply_engine_environment(env: dict[str, str]) -> None:
    """vLLM reads these at import: call before the first `import vllm` of the process."""
    os.environ.update(env)


@contextmanager
def engine_thread_affinity(spec: EngineSpec) -> Iterator[None]:
    """Around an engine build on this thread: on `spec.cores` when it names them (set before, so
    the threads the build starts inherit them, and set again after on this thread and every
    thread the build started: NIXL's CPU worker pins its caller to the machine's last core); else
    this thread gets back the affinity it had, unless vLLM binds threads on purpose. Threads that
    only poll go to this thread's other cores instead (cpu_cores.poller_cores)."""
    prior = tuple(sorted(os.sched_getaffinity(0)))
    cpus = tuple(spec.cores) or prior
    before = thread_ids()
    if spec.cores:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        if spec.cores:
            started = thread_ids() - before
            pollers = {t for t in started if is_poller(thread_name(t))}
            pin_threads({threading.get_native_id()} | (started - pollers), cpus)
            elsewhere = poller_cores(prior, cpus)
            if moved := pin_threads(pollers, elsewhere):
                logger.info("engine on cores %s; %d polling threads on %s", cpus, moved, elsewhere)
        elif spec.env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind") == "nobind":
            os.sched_setaffinity(0, cpus)


def native_cpu_bf16() -> bool:
    """Whether this host's CPU computes bf16 natively: AVX-512 BF16 or AMX tiles on x86; assumed on
    other architectures (vLLM's CPU backend takes bf16 there as native)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def engine_kwargs_here(spec: EngineSpec) -> dict[str, Any]:
    """The spec's EngineArgs with `dtype: auto` resolved for the CPU of the host the engine runs on
    (engine_dtype): the replica's host, not the one that built the app."""
    kwargs = dict(spec.engine_kwargs)
    if kwargs.get("dtype") == "auto" and not spec.on_gpu:
        kwargs["dtype"] = engine_dtype("auto", on_gpu=False, cpu_bf16=native_cpu_bf16())
        logger.info("engine dtype auto -> %s on this CPU", kwargs["dtype"])
    return kwargs


def build_vllm_engine(spec: EngineSpec) -> Any:
    """`LLMEngine.from_engine_args(EngineArgs(**engine_kwargs_here(spec)))`, keeping this thread's
    torch thread count and CPU affinity as the spec asks (engine_thread_affinity)."""
    with engine_thread_affinity(spec):
        threads = spec.env.get("OMP_NUM_THREADS")
        if threads:  # OMP_NUM_THREADS only counts if torch was not imported yet; make it hold
            import torch

            torch.set_num_threads(int(threads))
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs_here(spec)))
    bind_segment_rope(engine)
    return engine


def bind_segment_rope(engine: Any) -> None:
    """Give the segment connector (if the engine has one) the loaded model's own rotary embedding
    (kv_transfer/segment_worker.py bind_model_rope, through vLLM's public `apply_model`). Never
    fails the start: a model it cannot read keeps the rotation built from the config."""
    from kv_transfer.segment_worker import bind_model_rope

    try:
        for found in engine.apply_model(bind_model_rope):
            if found is not None:
                logger.info("segment connector: %s", found)
    except Exception:  # a start must not fail on this check; the config's rotation stays
        logger.exception("could not read the model's rotary embedding")


def engine_factory_for(spec: EngineSpec) -> Callable[[EngineSpec], Any]:
    """The factory that builds `spec`'s engine: vLLM's, or the simulated stand-in (engine.kind)."""
    if spec.simulated is not None:
        from baton.engine.simulated.engine import build_simulated_engine

        return build_simulated_engine
    return build_vllm_engine


def shutdown_engine(engine: Any) -> None:
    """Release an engine's workers and KV memory (vLLM: its engine-core client's shutdown; an
    engine with its own `shutdown()` is asked directly). Never raises: it runs on the way out."""
    close = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
    if close is None:
        return
    try:
        close()
    except Exception:  # best effort on the way out: the engine is being dropped anyway
        logger.exception("engine shutdown failed")
