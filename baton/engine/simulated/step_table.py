"""Step times from a precomputed table, so an engine replica never imports AIConfigurator.

AicStepTimer (timing.py) holds a compiled AIConfigurator per process (~0.25 GiB idle, ~0.8 GiB
once its per-op databases have loaded, seconds of CPU on the first steps). A StepTable holds the
same step times for one gpu + model + tp, sampled once (step_table_build.py) and cached on disk
(step_table_cache.py), as four low-dimensional grids of log(ms), each a part of timing.py's step:

    decode-only step   = decode[bs, ctx]                        predict_decode_latency(bs, ctx, 2)
    step with prefill  = shared[tokens] + ctx_attn[k, new, prefix] + dec_attn[n_dec, dec_ctx]
                         (tokens = k * new + n_dec; the three parts of mixed_step_breakdown)

The decomposition is exact for AIConfigurator 0.12 (checked on 3,000 random shapes when it was
written): its shared non-attention part depends on the step's token count alone, and its decode
attention on (n_dec, their context) alone, whatever the prefills are. Context attention is not
linear in k (AIConfigurator interpolates its attention data piecewise in batch size), so it keeps
k as an axis. Between grid points the table interpolates multilinearly in log(axis) and log(time);
below an axis' first point it clamps, above its last it extrapolates the last interval's power law
(`uncovered` tells a caller whose limits reach past the grid). Shapes come from timing.step_shape,
as AicStepTimer's do, so the two timers differ only by interpolation (tests/unit/test_step_table.py
measures it: p95 and max relative error are in its docstring).
"""
from __future__ import annotations

import argparse
import math
import os
import time
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from baton.engine.simulated.timing import StepBatch, StepTime, step_shape

ARRAYS = ("decode", "shared", "ctx_attn", "dec_attn")
AXES = ("seqs", "ctx", "tokens", "chunks", "new", "prefix")
SHAPES = {"decode": ("seqs", "ctx"), "shared": ("tokens",), "ctx_attn": ("chunks", "new", "prefix"), "dec_attn": ("seqs", "ctx")}


@dataclass(frozen=True)
class TableKey:
    """Which step times a table holds and from which AIConfigurator and grid; names its file."""

    gpu: str
    model: str
    tp: int
    aic_version: str
    grid_version: int

    @property
    def filename(self) -> str:
        return f"{self.gpu}--{self.model.replace('/', '--')}--tp{self.tp}--aic{self.aic_version}--v{self.grid_version}.npz"


class Axis:
    """Grid points of one quantity; `locate` gives the interval and weight in log(x + offset)."""

    def __init__(self, points: np.ndarray, offset: float):
        self.points = points
        self.offset = offset
        self.u = [math.log(float(p) + offset) for p in points]

    def locate(self, x: float) -> tuple[int, float]:
        """(i, w): x lies at u[i] + w × (u[i+1] − u[i]); w clamps at 0 below the grid, exceeds 1 above it."""
        u = math.log(x + self.offset)
        i = min(max(bisect_right(self.u, u) - 1, 0), len(self.u) - 2)
        return i, max(0.0, (u - self.u[i]) / (self.u[i + 1] - self.u[i]))


@dataclass(frozen=True)
class StepTable:
    """log(ms) grids of one gpu + model + tp (module docstring). Read-only once built."""

    key: TableKey
    axes: dict[str, np.ndarray]  # AXES → int64 grid points, strictly increasing
    arrays: dict[str, np.ndarray]  # ARRAYS → float32 log(ms), shapes from SHAPES
    build_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.check_integrity()
        # offsets: prefix starts at 0 (log(1 + p)); the rest start at 1
        object.__setattr__(self, "_ax", {n: Axis(self.axes[n], 1.0 if n == "prefix" else 0.0) for n in AXES})

    def check_integrity(self) -> None:
        """Raises ValueError unless every axis is increasing from its start and every grid finite and of its axes' shape."""
        for name in AXES:
            a = self.axes[name]
            if a.ndim != 1 or len(a) < 2 or a[0] != (0 if name == "prefix" else 1) or not np.all(np.diff(a) > 0):
                raise ValueError(f"step table axis {name!r} must rise strictly from {0 if name == 'prefix' else 1}")
        for name, dims in SHAPES.items():
            arr = self.arrays[name]
            if arr.shape != tuple(len(self.axes[d]) for d in dims) or not np.all(np.isfinite(arr)):
                raise ValueError(f"step table grid {name!r} must be finite and shaped {dims}")

    def limit(self, axis: str) -> int:
        return int(self.axes[axis][-1])

    def uncovered(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[str]:
        """The engine limits that reach past the grid (empty: every step the engine can run is inside it)."""
        wants = {"seqs": max_num_seqs, "chunks": max_num_seqs, "tokens": max_num_batched_tokens, "new": max_num_batched_tokens,
                 "ctx": max_model_len, "prefix": max_model_len}
        return [f"{name} up to {n} (the table's grid ends at {self.limit(name)})" for name, n in wants.items() if n > self.limit(name)]

    def decode_ms(self, bs: int, ctx: int) -> float:
        return math.exp(self._bilinear("decode", self._ax["seqs"].locate(bs), self._ax["ctx"].locate(ctx)))

    def dec_attn_ms(self, n_dec: int, dec_ctx: int) -> float:
        return math.exp(self._bilinear("dec_attn", self._ax["seqs"].locate(n_dec), self._ax["ctx"].locate(dec_ctx)))

    def shared_ms(self, tokens: int) -> float:
        i, w = self._ax["tokens"].locate(tokens)
        a = self.arrays["shared"]
        return math.exp((1 - w) * a.item(i) + w * a.item(i + 1))

    def ctx_attn_ms(self, k: int, new: int, prefix: int) -> float:
        (i, wi), (j, wj), (m, wm) = self._ax["chunks"].locate(k), self._ax["new"].locate(new), self._ax["prefix"].locate(prefix)
        a = self.arrays["ctx_attn"]
        plane = [(1 - wm) * a.item(i + di, j + dj, m) + wm * a.item(i + di, j + dj, m + 1) for di in (0, 1) for dj in (0, 1)]
        lo = (1 - wj) * plane[0] + wj * plane[1]
        hi = (1 - wj) * plane[2] + wj * plane[3]
        return math.exp((1 - wi) * lo + wi * hi)

    def _bilinear(self, name: str, at_i: tuple[int, float], at_j: tuple[int, float]) -> float:
        (i, wi), (j, wj), a = at_i, at_j, self.arrays[name]
        lo = (1 - wj) * a.item(i, j) + wj * a.item(i, j + 1)
        hi = (1 - wj) * a.item(i + 1, j) + wj * a.item(i + 1, j + 1)
        return (1 - wi) * lo + wi * hi


class TableStepTimer:
    """AicStepTimer's interface (`step_time(batch) -> StepTime`) over a StepTable."""

    def __init__(self, table: StepTable):
        self.table = table

    def step_time(self, batch: StepBatch) -> StepTime:
        if batch.empty:
            return StepTime(0.0, "idle")
        s, t = step_shape(batch), self.table
        if not s.k:
            return StepTime(t.decode_ms(s.n_dec, s.dec_ctx) / 1e3, "decode")
        ms = t.shared_ms(s.tokens) + t.ctx_attn_ms(s.k, s.new, s.prefix) + (t.dec_attn_ms(s.n_dec, s.dec_ctx) if s.n_dec else 0.0)
        return StepTime(ms / 1e3, "mixed")


def main(argv: list[str] | None = None) -> None:
    """Prebuild (or find) the cached table: python -m baton.engine.simulated.step_table --gpu h200_sxm --model ... --tp 1."""
    from baton.engine.simulated.step_table_cache import load_or_build, table_dir, table_key

    p = argparse.ArgumentParser(prog="python -m baton.engine.simulated.step_table", description=main.__doc__)
    p.add_argument("--gpu", required=True, help="AIConfigurator system, e.g. h200_sxm")
    p.add_argument("--model", required=True, help="AIConfigurator model, e.g. meta-llama/Meta-Llama-3.1-8B")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dir", default=table_dir(".cache"), help="cache folder (default: %(default)s, from the repo root)")
    a = p.parse_args(argv)
    path = os.path.join(a.dir, table_key(a.gpu, a.model, a.tp).filename)
    existed = os.path.exists(path)
    t0 = time.perf_counter()
    table = load_or_build(a.dir, a.gpu, a.model, a.tp)
    size = f"{os.path.getsize(path) / 1024:.0f} KiB" if os.path.exists(path) else "not on disk"
    print(f"{path}\n  {'loaded' if existed else 'built'} in {time.perf_counter() - t0:.2f} s (its build took "
          f"{table.build_seconds:.2f} s); {size}; grids " + ", ".join(f"{n} {'x'.join(map(str, table.arrays[n].shape))}" for n in ARRAYS))


if __name__ == "__main__":
    main()
