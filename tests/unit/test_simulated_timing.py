"""baton/engine/simulated/timing.py against AIConfigurator's own predictions, called directly here.

Uniform batches must equal AIConfigurator's step surfaces (prefill, decode, mixed) exactly: the
timing model is a mapping onto them, not a model of its own. Heterogeneous batches are checked for
what the mapping promises: token counts kept, attention monotone in context.
"""
from __future__ import annotations

import logging
from typing import Any

import pytest

from baton.engine.simulated.timing import AicStepTimer, PrefillChunk, StepBatch, isl_grid

GPU, MODEL = "h200_sxm", "meta-llama/Meta-Llama-3.1-8B"


@pytest.fixture(scope="module")
def timer() -> AicStepTimer:
    return AicStepTimer(GPU, MODEL, tp=1)


@pytest.fixture(scope="module")
def aic() -> Any:  # AIConfigurator's EngineHandle, compiled independently of the timer
    from aiconfigurator_core.sdk.engine import EngineHandle

    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)
    return EngineHandle.compile(MODEL, GPU, "vllm", tp_size=1)


def ms(timer: AicStepTimer, batch: StepBatch) -> float:
    return timer.step_time(batch).seconds * 1e3


@pytest.mark.parametrize("isl", [128, 512, 2048])
def test_one_fresh_prefill_is_aiconfigurators_prefill(timer: AicStepTimer, aic: Any, isl: int) -> None:
    assert ms(timer, StepBatch(prefills=(PrefillChunk(isl, 0),))) == pytest.approx(aic.predict_prefill_latency(1, isl, 0), rel=1e-9)


def test_a_prefill_after_a_cached_prefix_is_aiconfigurators_prefill_with_prefix(timer: AicStepTimer, aic: Any) -> None:
    got = ms(timer, StepBatch(prefills=(PrefillChunk(512, 512),)))
    assert got == pytest.approx(aic.predict_prefill_latency(1, 1024, 512), rel=1e-9)


@pytest.mark.parametrize(("bs", "ctx"), [(1, 128), (8, 1024), (64, 4096)])
def test_a_decode_step_is_aiconfigurators_decode_step(timer: AicStepTimer, aic: Any, bs: int, ctx: int) -> None:
    step = timer.step_time(StepBatch(decode_contexts=(ctx,) * bs))
    assert step.kind == "decode"
    assert step.seconds * 1e3 == pytest.approx(aic.predict_decode_latency(bs, ctx, 2), rel=1e-9)


@pytest.mark.parametrize(("k", "isl", "n_dec"), [(1, 256, 8), (2, 1024, 16), (4, 512, 0)])
def test_a_uniform_mixed_step_is_aiconfigurators_mixed_step(timer: AicStepTimer, aic: Any, k: int, isl: int, n_dec: int) -> None:
    batch = StepBatch(prefills=(PrefillChunk(isl, 0),) * k, decode_contexts=(isl,) * n_dec)
    assert ms(timer, batch) == pytest.approx(aic.mixed_step_latency(k * isl, n_dec, isl, 1, 0), rel=1e-9)


def test_batched_prefills_agree_with_aiconfigurators_batched_prefill(timer: AicStepTimer, aic: Any) -> None:
    """Its static prefill of 4 sequences and its mixed step of the same 4 differ by rounding only."""
    got = ms(timer, StepBatch(prefills=(PrefillChunk(256, 0),) * 4))
    assert got == pytest.approx(aic.predict_prefill_latency(4, 256, 0), rel=0.01)


def test_decodes_at_their_own_context_cost_what_their_context_costs(timer: AicStepTimer) -> None:
    chunk = (PrefillChunk(256, 0),)
    short = ms(timer, StepBatch(prefills=chunk, decode_contexts=(256,) * 32))
    long = ms(timer, StepBatch(prefills=chunk, decode_contexts=(8192,) * 32))
    assert long > short


def test_more_tokens_or_more_context_never_take_less_time(timer: AicStepTimer) -> None:
    assert ms(timer, StepBatch(prefills=(PrefillChunk(1024, 0),))) > ms(timer, StepBatch(prefills=(PrefillChunk(512, 0),)))
    assert ms(timer, StepBatch(prefills=(PrefillChunk(512, 4096),))) > ms(timer, StepBatch(prefills=(PrefillChunk(512, 0),)))
    assert ms(timer, StepBatch(decode_contexts=(1024,) * 64)) > ms(timer, StepBatch(decode_contexts=(1024,) * 8))


def test_an_empty_batch_takes_no_time(timer: AicStepTimer) -> None:
    assert timer.step_time(StepBatch()).seconds == 0.0


def test_the_length_grid_rounds_up_by_at_most_a_sixteenth() -> None:
    for n in (1, 16, 17, 255, 256, 257, 1000, 4097, 131_071):
        g = isl_grid(n)
        assert n <= g <= max(n + 15, n * 17 // 16 + 1), (n, g)
    assert [isl_grid(n) for n in (16, 256, 512, 1024)] == [16, 256, 512, 1024]  # grid points are kept
