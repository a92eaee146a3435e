"""An engine's step trace: every step's wall time and batch shape, as JSON lines (engine.step_trace_dir).

What it is for: the fleet simulator's calibration times its CPU engines from the steps of the
served engines themselves (baton/sim/served_steps.py), which share their cores with the serving
stack, instead of an engine timed alone. Off unless the pool's engine config names a folder.

One file per engine process, `<dir>/<role>-<pid>.jsonl`:
    {"engine": {"role", "block_size", "kv_capacity_tokens", "max_num_seqs", "max_num_batched_tokens"}}   first line
    {"t": wall clock at the step's start, "s": seconds in engine.step(), "g": seconds since the previous step ended,
     "p": [[new tokens, tokens already in KV], ...] (prefill chunks), "d": [context, ...] (decoded sequences)}
The shape is read from the scheduler's own output for the step (vLLM's SchedulerOutput: tokens
scheduled per request, and what each had computed before), so prefix-cache hits and KV loaded from
another engine count as context, never as work. A request scheduled one token is a decode.
Engine thread only. Lines are buffered and written at most once a second (and at close).
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)

_FLUSH_S = 1.0


def step_shape(out: Any) -> tuple[list[list[int]], list[int]]:
    """(prefill chunks [[new, context], ...], decode contexts) of one SchedulerOutput; ([], []) when
    it is not one. Pure."""
    scheduled = getattr(out, "num_scheduled_tokens", None)
    if not isinstance(scheduled, dict):
        return [], []
    before: dict[str, int] = {r.req_id: int(r.num_computed_tokens) for r in getattr(out, "scheduled_new_reqs", ())}
    cached = getattr(out, "scheduled_cached_reqs", None)
    if cached is not None:
        before.update(zip(cached.req_ids, (int(n) for n in cached.num_computed_tokens), strict=False))
    prefills: list[list[int]] = []
    decodes: list[int] = []
    for rid, n in scheduled.items():
        context = before.get(rid, 0)
        if n == 1:
            decodes.append(context)
        elif n > 1:
            prefills.append([int(n), context])
    return prefills, decodes


def open_step_trace(where: tuple[str, str] | None, scheduler: Any, kv_capacity_tokens: int) -> StepTrace | None:
    """The trace an EngineSpec asks for ((folder, role); None: off), or None when its file cannot be
    opened (logged: the engine serves untraced)."""
    if where is None:
        return None
    try:
        return StepTrace(where[0], where[1], scheduler, kv_capacity_tokens)
    except OSError as e:
        logger.warning("step trace under %s not written: %s", where[0], e)
        return None


class StepTrace:
    """Wraps a scheduler's schedule() to see each step's batch, and times engine.step()."""

    def __init__(self, folder: str, role: str, scheduler: Any, kv_capacity_tokens: int):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"{role}-{os.getpid()}.jsonl")
        self._file = open(self.path, "a", encoding="utf-8")  # held for the engine's life; close() closes it
        self._lines: list[str] = []
        self._flushed = time.monotonic()
        self._last: Any = None
        self._ended: float | None = None
        if scheduler is not None and callable(getattr(scheduler, "schedule", None)):
            schedule = scheduler.schedule

            def traced_schedule(*args: Any, **kwargs: Any) -> Any:
                self._last = schedule(*args, **kwargs)
                return self._last

            scheduler.schedule = traced_schedule
        header = {"role": role, "block_size": getattr(scheduler, "block_size", None), "kv_capacity_tokens": kv_capacity_tokens,
                  "max_num_seqs": getattr(scheduler, "max_num_running_reqs", None),
                  "max_num_batched_tokens": getattr(scheduler, "max_num_scheduled_tokens", None)}
        self._file.write(json.dumps({"engine": header}) + "\n")
        self._file.flush()

    def step(self, engine: Any) -> Any:
        """engine.step(), timed and recorded with its batch."""
        self._last = None
        t, start = time.time(), time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        prefills, decodes = step_shape(self._last)
        gap = None if self._ended is None else round(start - self._ended, 6)
        self._ended = end
        if prefills or decodes:
            self._lines.append(json.dumps({"t": round(t, 4), "s": round(end - start, 6), "g": gap, "p": prefills, "d": decodes}))
        if time.monotonic() - self._flushed >= _FLUSH_S:
            self.flush()
        return outputs

    def flush(self) -> None:
        self._flushed = time.monotonic()
        if not self._lines:
            return
        try:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk loses trace lines, never the engine
            logger.warning("step trace %s: %s", self.path, e)
        self._lines.clear()

    def close(self) -> None:
        self.flush()
        self._file.close()
