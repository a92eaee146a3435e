"""The GPU check's pure parts (baton/bench/gpu_check.py): its facts and the engine it builds from
gpu_example.yaml (the e2e suite runs the whole check on CPU)."""
from __future__ import annotations

import yaml

from baton.bench import gpu_check


def test_facts_are_distinct_and_enough_for_k50() -> None:
    fs = gpu_check.facts()
    assert len(fs) == len(set(fs)) == 80 >= max(gpu_check.KS)


def test_the_engine_is_gpu_examples_decode_engine_with_a_small_model() -> None:
    decode = yaml.safe_load(gpu_check.CONFIG.read_text())["applications"][0]["args"]["decode"]["engine"]
    cuda = gpu_check.engine_config("/models/small", "cuda")
    assert cuda.model == "/models/small" and cuda.max_model_len == 4096
    assert (cuda.dtype, cuda.enforce_eager, cuda.enable_prefix_caching) == (decode["dtype"], decode["enforce_eager"],
                                                                          decode["enable_prefix_caching"])
    assert cuda.segment_async_load_min_tokens == 1024  # the product's default load path
    cpu = gpu_check.engine_config("/models/small", "cpu")
    assert cpu.enforce_eager and cpu.block_size == 32 and cpu.dtype == "auto"  # a CPU replica's own dtype
