"""Every shipped GPU config fits its device (baton/engine/gpu_fit.py): weights from the model's
published parameter count (bf16: 2 bytes each) over tensor parallel, plus the KV budget, plus
working memory, at most the memory of the pool's accelerator type."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from baton.engine.gpu_fit import DEVICE_MEMORY_GB, gpu_fit
from deployments.config import load_app_config

CONFIGS = Path(__file__).resolve().parents[2] / "cluster_configs"

# published parameter counts (the model cards: Meta's Llama 3.1, IBM's Granite 4.0, Qwen's
# Qwen3-Next); a GPU config naming a model not listed here fails the test below, on purpose
PARAMETERS = {"Llama-3.1-8B-Instruct": 8.03e9, "granite-4.0-h-small": 32.2e9, "Qwen3-Next-80B-A3B-Instruct": 81.3e9}
BYTES_PER_PARAMETER = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


def gpu_pools() -> list[tuple[str, str, object]]:
    out = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        for app in yaml.safe_load(path.read_text())["applications"]:
            cfg = load_app_config(app["args"])
            for name in ("prefill", "decode"):
                pool = getattr(cfg, name)
                if pool is not None and pool.resources.num_gpus > 0:
                    out.append((path.name, name, pool))
    return out


def test_there_are_gpu_configs() -> None:
    assert {f for f, _, _ in gpu_pools()} >= {"gpu_example.yaml", "gpu_hybrid_example.yaml"}


@pytest.mark.parametrize(("config", "pool_name", "pool"), gpu_pools(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_gpu_pool_fits_its_device(config: str, pool_name: str, pool: object) -> None:
    engine, resources = pool.engine, pool.resources  # type: ignore[attr-defined]
    assert engine.model in PARAMETERS, f"{config}: add {engine.model}'s published parameter count to PARAMETERS"
    assert resources.accelerator_type in DEVICE_MEMORY_GB, f"{config}: {pool_name} names no accelerator type of known memory"
    tp = int(engine.extra_engine_args.get("tensor_parallel_size", 1))
    assert resources.num_gpus >= tp, f"{config}: {pool_name} runs tensor parallel {tp} on {resources.num_gpus} GPUs"
    fit = gpu_fit(PARAMETERS[engine.model] * BYTES_PER_PARAMETER[engine.dtype], engine.kv_cache_gib, resources.accelerator_type, tp)
    assert fit.fits, f"{config} {pool_name}: {fit.describe()}"


def test_what_the_examples_shipped_before_does_not_fit() -> None:
    """Qwen3-Next-80B with tensor parallel 1 and 60 GiB of KV on an H100, and Llama-3.1-8B with
    16 GiB of KV on an L4: the two configs this check was written for."""
    qwen = gpu_fit(81.3e9 * 2, 60, "H100")
    assert not qwen.fits and qwen.weights_gib > 150
    assert gpu_fit(81.3e9 * 2, 40, "H200", tensor_parallel=2).fits
    assert not gpu_fit(8.03e9 * 2, 16, "L4").fits and gpu_fit(8.03e9 * 2, 3, "L4").fits


def test_unknown_devices_and_bad_parallelism_are_errors() -> None:
    with pytest.raises(KeyError, match="no device memory known"):
        gpu_fit(1e9, 1, "TPUv9")
    with pytest.raises(ValueError):
        gpu_fit(1e9, 1, "H100", tensor_parallel=0)
