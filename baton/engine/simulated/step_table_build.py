"""Sampling a StepTable from AIConfigurator: the only step_table module that imports it.

The grids (GRID_VERSION names them in the cache file; change it with them) are integers where
AIConfigurator's curves bend most (small batches, short contexts), then log-spaced to fixed ends
wide enough for vLLM's usual limits: up to 1024 sequences, 65,536 tokens a step, 131,072 tokens
of context. Every value is the same AIConfigurator call AicStepTimer makes (timing.py):

    decode[bs, ctx]             predict_decode_latency(bs, ctx, 2)
    shared[t]                   mixed_step_breakdown(t, 0, t, 1, 0)[1]
    ctx_attn[k, new, prefix]    mixed_step_breakdown(k * (prefix + new), 0, prefix + new, 1, prefix)[2]
    dec_attn[n, ctx]            mixed_step_breakdown(0, n, ctx, 1, 0)[3]
"""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from baton.engine.simulated.step_table import AXES, StepTable, TableKey
from baton.engine.simulated.timing import compile_handle

GRID_VERSION = 1
MAX_SEQS = 1024
MAX_TOKENS = 65536
MAX_CONTEXT = 131072


def log_grid(dense_to: int, per_octave: int, top: int, start: int = 1) -> np.ndarray:
    """Every integer from `start` to `dense_to`, then `per_octave` points an octave (rounded, distinct) to `top`."""
    octaves = math.log2(top / dense_to)
    tail = np.round(dense_to * np.exp2(np.arange(1, math.ceil(octaves * per_octave) + 1) / per_octave))
    return np.unique(np.concatenate([np.arange(start, dense_to + 1), np.minimum(tail, top)])).astype(np.int64)


def with_steps(grid: np.ndarray, every: int) -> np.ndarray:
    """`grid` plus m and m + 1 for each multiple m of `every` up to its end: both sides of a step."""
    m = np.arange(every, int(grid[-1]) + 1, every)
    return np.unique(np.concatenate([grid, m, np.minimum(m + 1, grid[-1])])).astype(np.int64)


def grid_axes() -> dict[str, np.ndarray]:
    """Token counts (a GEMM's m: `tokens` of shared, `seqs` of a decode step) step where its kernels
    change tile, at multiples of 16, 32, 256 (measured: up to 7 % from one token to the next), so
    their grids are integers to 256 or 512, then both sides of every multiple of 32 or 64."""
    axes = {
        "seqs": with_steps(log_grid(256, 16, MAX_SEQS), 32),
        "ctx": log_grid(16, 16, MAX_CONTEXT),
        "tokens": with_steps(log_grid(512, 16, MAX_TOKENS), 64),
        "chunks": log_grid(8, 4, MAX_SEQS),
        "new": log_grid(16, 8, MAX_TOKENS),
        "prefix": log_grid(16, 8, MAX_CONTEXT, start=0),
    }
    assert set(axes) == set(AXES)
    return axes


def build_table(key: TableKey) -> StepTable:
    """Sample every grid point from AIConfigurator (seconds of CPU; the cache keeps the result)."""
    t0 = time.perf_counter()
    h = compile_handle(key.gpu, key.model, key.tp)
    ax = grid_axes()
    seqs, ctx, tokens, chunks, new, prefix = (ax[n].tolist() for n in AXES)
    decode = [[h.predict_decode_latency(b, c, 2) for c in ctx] for b in seqs]
    dec_attn = [[h.mixed_step_breakdown(0, n, c, 1, 0)[3] for c in ctx] for n in seqs]
    shared = [h.mixed_step_breakdown(t, 0, t, 1, 0)[1] for t in tokens]
    ctx_attn = [[[_ctx_attn(h, k, n, p) for p in prefix] for n in new] for k in chunks]
    arrays = {name: np.log(np.asarray(v, dtype=np.float64)).astype(np.float32)
              for name, v in (("decode", decode), ("shared", shared), ("ctx_attn", ctx_attn), ("dec_attn", dec_attn))}
    return StepTable(key, ax, arrays, build_seconds=time.perf_counter() - t0)


def _ctx_attn(h: Any, k: int, new: int, prefix: int) -> float:
    isl = prefix + new
    return float(h.mixed_step_breakdown(k * isl, 0, isl, 1, prefix)[2])
