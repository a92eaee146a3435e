"""How long one engine step takes on a GPU: AIConfigurator's measured per-op vLLM data.

`AicStepTimer(gpu, model, tp).step_time(batch)` returns the predicted wall time of one vLLM step
that runs `batch`: some prefill chunks (new tokens, tokens already in KV before the chunk) and some
decode sequences (tokens in KV). AIConfigurator (`aiconfigurator_core`, PyPI aiconfigurator-core)
compiles the model's op graph for the GPU and times it from measured kernels; the calls used are
`EngineHandle.compile(model, system, "vllm", tp_size=tp)` and then, on the compiled handle:

- decode-only steps: `predict_decode_latency(bs, isl, osl=2)`, one decode step of `bs` sequences
  at context `isl` (osl=2 is one step: AIConfigurator counts osl-1 decode steps);
- steps with prefill: `mixed_step_breakdown(ctx_tokens, gen_tokens, isl, osl=1, prefix)` →
  (total, shared non-attention, context attention, decode attention), in AIConfigurator's
  convention that `ctx_tokens = k × isl` is k sequences of isl tokens, the first `prefix` of each
  already cached. The step is its shared non-attention (all tokens of the step) plus its context
  attention, plus decode attention from `mixed_step_breakdown(0, n, ctx, 1, 0)` at the decode
  sequences' own mean context (AIConfigurator's mixed step assumes the decodes' context equals the
  prefills' isl; vLLM's do not).

Heterogeneous chunks are timed as k chunks of their mean new-token count and mean cached prefix
(exact for a uniform batch, where the step equals `mixed_step_latency`; attention is the part that
this averaging approximates). AIConfigurator takes ~4 ms of CPU for each new prefill length, so
the chunks' full length (prefix + new) is rounded up to a grid (`isl_grid`: multiples of 16 to
256, then 16 steps an octave), adding at most 1/16 of context to the attention term and never
changing the token count; results are cached per shape, so a warm step costs microseconds of CPU.
Times are milliseconds inside AIConfigurator and seconds here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

_CACHE_SHAPES = 1 << 16


@dataclass(frozen=True)
class PrefillChunk:
    """`new_tokens` prompt tokens computed this step, after `context_before` tokens already in KV."""

    new_tokens: int
    context_before: int


@dataclass(frozen=True)
class StepBatch:
    """What one step runs. decode_contexts: tokens in KV of each decoding sequence."""

    prefills: tuple[PrefillChunk, ...] = ()
    decode_contexts: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decode_contexts


@dataclass(frozen=True)
class StepTime:
    """Predicted GPU time of one step; `kind` says which AIConfigurator surface timed it."""

    seconds: float
    kind: str  # "idle" | "decode" | "mixed"


@dataclass(frozen=True)
class StepShape:
    """What a step's time is a function of, after averaging (module docstring): `k` prefill chunks of
    `new` tokens after `prefix` cached ones (`prefix + new` on isl_grid), and `n_dec` decodes at
    context `dec_ctx`. k == 0: decode-only; k == n_dec == 0: idle."""

    k: int = 0
    new: int = 0
    prefix: int = 0
    n_dec: int = 0
    dec_ctx: int = 0

    @property
    def tokens(self) -> int:
        """Tokens computed this step: what the shared non-attention part (GEMMs, norms, ...) costs by."""
        return self.k * self.new + self.n_dec


def step_shape(batch: StepBatch) -> StepShape:
    """Pure: the shape both timers (this one, step_table.TableStepTimer) time `batch` as."""
    n_dec = len(batch.decode_contexts)
    dec_ctx = max(1, round(sum(batch.decode_contexts) / n_dec)) if n_dec else 0
    if not batch.prefills:
        return StepShape(n_dec=n_dec, dec_ctx=dec_ctx)
    k = len(batch.prefills)
    new = max(1, round(sum(c.new_tokens for c in batch.prefills) / k))
    isl = isl_grid(new + round(sum(c.context_before for c in batch.prefills) / k))
    return StepShape(k, new, isl - new, n_dec, dec_ctx)


class AicStepTimer:
    """Step times for one gpu + model + tp. Construct once per engine (compiling takes ~1 s)."""

    def __init__(self, gpu: str, model: str, tp: int = 1):
        self.gpu, self.model, self.tp = gpu, model, tp
        self.handle = compile_handle(gpu, model, tp)
        self._decode_ms = lru_cache(_CACHE_SHAPES)(self._decode_ms_uncached)
        self._mixed_ms = lru_cache(_CACHE_SHAPES)(self._mixed_ms_uncached)

    def step_time(self, batch: StepBatch) -> StepTime:
        if batch.empty:
            return StepTime(0.0, "idle")
        s = step_shape(batch)
        if not s.k:
            return StepTime(self._decode_ms(s.n_dec, s.dec_ctx) / 1e3, "decode")
        return StepTime(self._mixed_ms(s.k, s.new, s.prefix, s.n_dec, s.dec_ctx) / 1e3, "mixed")

    def _decode_ms_uncached(self, bs: int, ctx: int) -> float:
        return float(self.handle.predict_decode_latency(bs, ctx, 2))

    def _mixed_ms_uncached(self, k: int, new: int, prefix: int, n_dec: int, dec_ctx: int) -> float:
        isl = prefix + new
        _, shared, ctx_attn, dec_attn = self.handle.mixed_step_breakdown(k * isl, n_dec, isl, 1, prefix)
        if n_dec and dec_ctx != isl:
            dec_attn = self.handle.mixed_step_breakdown(0, n_dec, dec_ctx, 1, 0)[3]
        return float(shared + ctx_attn + dec_attn)


def isl_grid(tokens: int) -> int:
    """The smallest grid length >= tokens: multiples of 16 up to 256, then 16 steps per octave."""
    step = 16 if tokens <= 256 else 1 << (tokens.bit_length() - 5)
    return -(-tokens // step) * step


@lru_cache(maxsize=8)
def compile_handle(gpu: str, model: str, tp: int) -> Any:
    """AIConfigurator's compiled engine for vLLM on `gpu` (its system name, e.g. h200_sxm); one per
    process for each gpu + model + tp (it is read-only once compiled)."""
    from aiconfigurator_core.sdk.engine import EngineHandle

    quiet = logging.getLogger("aiconfigurator_core")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # it logs every low-fidelity fallback table it loads
    try:
        return EngineHandle.compile(model, gpu, "vllm", tp_size=tp)
    finally:
        quiet.setLevel(level)
