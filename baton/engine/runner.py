"""An in-process engine owned by one background thread.

The engine is not thread-safe, so exactly one thread (the engine thread) builds it, adds and
aborts requests, calls step() and shuts it down. Callers on an asyncio loop talk to it through a
command queue and receive deltas on per-request asyncio queues (baton/engine/streams.py, which
also holds the runner's lifecycle and health under the same lock as its streams). The engine
comes from a factory (`engine_factory(spec)`, vLLM's LLMEngine by default), so the concurrency
here is unit-tested with a fake engine.

Invariants:
- every request id in the stream table is queued as an `add` command or known to the engine; it
  leaves the table exactly once (finished, aborted, or failed);
- the runner is the only code that offers, takes and discards a request's segment key in the
  process SegmentTable (kv_transfer/segments.py), and it discards each key exactly once: the
  caller does when the request ended (finished or failed), the engine thread does right after it
  aborted a cancelled request, so no later step can write a capture under a discarded key.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from baton.engine.args import EngineSpec
from baton.engine.deltas import coalesce, delta_from_output
from baton.engine.sampling import engine_inputs
from baton.engine.scheduler_stats import find_scheduler, kv_capacity_tokens, none_running, scheduler_stats, wire_segment_scheduler
from baton.engine.step_trace import StepTrace, open_step_trace
from baton.engine.streams import Stream, StreamTable
from baton.engine.types import (
    EngineRequestError,
    EngineStats,
    EngineUnavailable,
    GenerationDelta,
    GenerationRequest,
    SamplingSpec,
    StageTimes,
)
from baton.engine.vllm_engine import apply_engine_environment, build_vllm_engine, shutdown_engine

if TYPE_CHECKING:
    from kv_transfer.prepared import PreparedInjection
    from kv_transfer.segments import CaptureResult, KVSegment, SegmentTable

logger = logging.getLogger("baton.engine")

EngineFactory = Callable[[EngineSpec], Any]
NO_CAPTURE = "the connector saw no capture"

_IDLE_WAIT_S = 0.05  # between steps of an engine that holds KV for a reader but has nothing to run
# an engine with nothing at all: the command queue wakes the loop the moment a request arrives, so
# this only paces the stats it publishes while idle (which do not change); at 20 wake-ups a second
# a few dozen idle replicas on one host kept a core busy doing nothing
_IDLE_BLOCK_S = 0.5
# an engine whose every request waits (for KV loading in the background: a segment load, a NIXL
# read) and none runs: a step would schedule nothing, so wait this long for a command first instead
# of spinning on empty steps, which would take the core (and the GIL) from the loading threads
_BLOCKED_WAIT_S = 0.001


@dataclass(frozen=True)
class _Add:
    request: GenerationRequest
    kv_transfer_params: dict[str, Any] | None
    stream: Stream


@dataclass(frozen=True)
class _Abort:
    request_id: str
    stream: Stream
    segments: SegmentTable | None  # discard the request's key once it is aborted


class _Stop:
    pass


class EngineRunner:
    """Owns one engine on a dedicated thread. Construct, then `async for d in generate(...)`."""

    def __init__(self, spec: EngineSpec, *, engine_factory: EngineFactory | None = None, start_timeout_s: float = 600.0,
                 segment_table: SegmentTable | None = None):
        """Start the engine thread and wait for the build. Raises EngineUnavailable when it fails,
        or when it has not finished within `start_timeout_s` (the watchdog: the runner is then
        stopped for good, and an engine the build thread finishes later is shut down, never served).
        segment_table: where injected and captured KV meet the connector (None: this process's)."""
        apply_engine_environment(spec.env)
        self._spec = spec
        self._factory: EngineFactory = engine_factory or build_vllm_engine
        self._segment_table = segment_table
        self._commands: queue.Queue = queue.Queue()
        self._streams = StreamTable()
        self._added: dict[str, float] = {}  # engine thread only: when each request without a first output yet was added
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.start_seconds = 0.0
        # written by the engine thread before it reports ready; read-only afterwards
        self._scheduler: Any = None
        self._kv_capacity_tokens = 0
        self._checkpoint_metrics: Any = None
        self._checkpoints_at = 0.0
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self._thread.start()
        self._ready.wait(start_timeout_s)
        if not self._streams.give_up_start(f"engine build did not finish within {start_timeout_s:g}s"):
            reason = self._streams.stats.reason
            logger.error("engine unavailable: %s", reason)
            raise EngineUnavailable(reason) from self._start_error

    # ---- caller side (any asyncio loop) -------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self._streams.stats

    @property
    def scheduler(self) -> Any:
        """The in-process engine's vLLM scheduler once started (None before, or when not found);
        read it from the engine thread's side only for settings, never to drive it."""
        return self._scheduler

    @property
    def checkpoint_metrics(self) -> Any:
        """The sparse-checkpoint scheduler's metrics (baton/engine/checkpoints/), refreshed by the engine
        thread at most once a second; None for engines without it."""
        return self._checkpoint_metrics

    async def generate(self, req: GenerationRequest, injection: tuple[KVSegment, ...] | PreparedInjection | None = None,
                       capture: tuple[tuple[int, int], ...] = ()) -> AsyncIterator[GenerationDelta]:
        """Yield deltas until the request finishes. Cancelling the consumer aborts the request.
        Raises EngineUnavailable (at once when the runner is not running) or EngineRequestError.

        injection: KV segments laid from position 0 that the segment connector loads instead of
        computing those prompt tokens -- plain (the engine thread rotates them at load time) or a
        PreparedInjection of them (kv_transfer/prepared.py: rotated and cast already, so the engine
        thread only writes them; kv_transfer/segment_worker.prepare_injection makes one). capture: prompt ranges whose KV the connector saves; the
        finished delta then carries it (`delta.capture`, a CaptureResult: one segment per range,
        or why not). Only capture requests carry one, and they never leave this process."""
        rid = req.request_id
        stream = self._streams.register(rid)
        segments: SegmentTable | None = None
        ended = False  # the engine is done with the request: finished, failed, or stopped
        try:
            segments = self._segments() if injection or capture else None
            kv_params = req.kv_transfer_params
            if segments is not None:
                kv_params = {**(kv_params or {}), **_segment_params(segments, rid, injection, capture)}
            self._commands.put(_Add(req, kv_params, stream))
            while True:
                item = coalesce(await stream.out.get(), stream.out)
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                if item.finished:
                    ended = True
                    if segments is not None and capture:
                        item = replace(item, capture=segments.take_capture(rid) or _no_capture())
                    yield item
                    return
                yield item
        finally:
            # left early: the engine thread aborts it, then discards its key (unless it has stopped)
            handed_over = not ended and self._streams.unless_stopped(lambda: self._commands.put(_Abort(rid, stream, segments)))
            if not handed_over and segments is not None:
                segments.discard(rid)

    async def capture(self, request_id: str, prompt_token_ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...],
                      cache_salt: str | None = None) -> tuple[KVSegment, ...]:
        """Compute `prompt_token_ids` once (one output token) and return the KV of `ranges`,
        keys position-free. Raises EngineRequestError when the connector could not capture."""
        req = GenerationRequest(request_id=request_id, prompt_token_ids=tuple(prompt_token_ids),
                                sampling=SamplingSpec(max_tokens=1, temperature=0.0), cache_salt=cache_salt)
        result = None
        async for delta in self.generate(req, capture=ranges):
            if delta.finished:
                result = delta.capture
        if result is None or result.error:
            raise EngineRequestError(f"KV capture failed: {result.error if result else NO_CAPTURE}")
        return result.segments

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop serving now (healthy False, new requests refused), stop the engine thread and
        shut the engine down. Waiting callers get EngineUnavailable."""
        self._streams.stopping("engine shut down")
        self._commands.put(_Stop())
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():  # a step that does not return: fail the waiting callers anyway
            logger.error("engine thread did not stop within %.0fs", timeout_s)
            self._streams.fail_all()

    def _segments(self) -> SegmentTable:
        if self._segment_table is None:
            from kv_transfer.segments import process_segments

            self._segment_table = process_segments()
        return self._segment_table

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            engine = self._factory(self._spec)
        except BaseException as e:  # reported to the constructor
            logger.exception("engine start failed")
            self._start_error = e
            self._streams.stop(f"engine failed to start: {type(e).__name__}: {e}")
            self._ready.set()
            return
        self._scheduler = find_scheduler(engine)
        self._kv_capacity_tokens = kv_capacity_tokens(self._scheduler)
        wire_segment_scheduler(self._scheduler)
        self.start_seconds = time.monotonic() - t0
        started = self._streams.start(EngineStats(kv_capacity_tokens=self._kv_capacity_tokens))
        self._ready.set()
        if not started:
            logger.error("engine build finished after %.0fs, past the start watchdog; shutting the late engine down",
                         time.monotonic() - t0)
            shutdown_engine(engine)
            return
        reason = "engine shut down"
        trace = open_step_trace(self._spec.step_trace, self._scheduler, self._kv_capacity_tokens)
        try:
            self._publish_stats(0)
            self._loop(engine, trace)
        except BaseException as e:  # the engine is dead: fail every stream
            logger.exception("engine step failed; engine marked unhealthy")
            reason = f"engine failed: {type(e).__name__}: {e}"
        finally:
            self._stop(reason)
            if trace is not None:
                trace.close()
            shutdown_engine(engine)

    def _loop(self, engine: Any, trace: StepTrace | None) -> None:
        steps = 0
        while True:
            busy = engine.has_unfinished_requests()
            # a prefill engine holding KV for a decoder has no unfinished request but must
            # keep stepping to see the reader's notification and free the blocks
            holding = self._scheduler is not None and self._scheduler.has_requests()
            if busy:
                wait = _BLOCKED_WAIT_S if none_running(self._scheduler) else None
            else:
                wait = _IDLE_WAIT_S if holding else _IDLE_BLOCK_S
            if not self._drain_commands(engine, wait):
                return
            holding = self._scheduler is not None and self._scheduler.has_requests()
            if engine.has_unfinished_requests() or holding:
                outputs = trace.step(engine) if trace is not None else engine.step()
                steps += 1
                self._dispatch(outputs)
            self._publish_stats(steps)

    def _drain_commands(self, engine: Any, wait_s: float | None) -> bool:
        """Apply queued add/abort commands, first waiting up to wait_s for one (None: no wait).
        Returns False on stop."""
        try:
            cmd = self._commands.get(timeout=wait_s) if wait_s is not None else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._add(engine, cmd)
            elif isinstance(cmd, _Abort):
                self._abort(engine, cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, engine: Any, cmd: _Add) -> None:
        rid = cmd.request.request_id
        if not self._streams.is_open(rid, cmd.stream):  # cancelled or failed before it reached the engine
            return
        try:
            build = getattr(engine, "engine_inputs", None) or engine_inputs  # a stand-in engine builds its own, without vLLM
            prompt, params = build(cmd.request, cmd.kv_transfer_params)
            engine.add_request(rid, prompt, params)
            self._added[rid] = time.time()
        except Exception as e:  # noqa: BLE001 - the engine rejects one request; it lives on
            self._streams.finish(rid, EngineRequestError(str(e)))

    def _abort(self, engine: Any, cmd: _Abort) -> None:
        try:
            self._added.pop(cmd.request_id, None)
            if self._streams.close(cmd.request_id, cmd.stream):
                engine.abort_request([cmd.request_id])
        finally:
            if cmd.segments is not None:
                cmd.segments.discard(cmd.request_id)

    def _stop(self, reason: str) -> None:
        """Leave service for good: fail every stream, then discard the keys of the aborts still
        queued (no command runs after this, and no abort is queued once stopped)."""
        self._streams.stop(reason)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Abort) and cmd.segments is not None:
                cmd.segments.discard(cmd.request_id)

    def _dispatch(self, outputs: list[Any]) -> None:
        now = time.time()
        for out in outputs:
            delta = delta_from_output(out)
            added = self._added.pop(out.request_id, None)
            if added is not None:  # its first output: when it was added, and this step
                delta = replace(delta, timing=StageTimes(engine_added=added, engine_first=now))
            if delta.finished:
                self._streams.finish(out.request_id, delta)
            else:
                self._streams.send(out.request_id, delta)

    def _publish_stats(self, steps: int) -> None:
        sched = self._scheduler
        now = time.monotonic()
        if sched is not None and hasattr(sched, "checkpoint_metrics") and now - self._checkpoints_at >= 1.0:
            self._checkpoints_at = now
            self._checkpoint_metrics = sched.checkpoint_metrics()
        self._streams.publish(scheduler_stats(sched, self._kv_capacity_tokens, len(self._streams), steps))


def _segment_params(segments: SegmentTable, key: str, injection: tuple[KVSegment, ...] | PreparedInjection | None,
                    capture: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    """Offer the injection under `key` and say what the segment connector does for the request."""
    from kv_transfer.segment_connector import PARAMS_KEY

    seg: dict[str, Any] = {"key": key}
    if injection:
        seg["inject_end"] = segments.offer(key, injection).end
    if capture:
        seg["capture"] = [list(r) for r in capture]
    return {PARAMS_KEY: seg}


def _no_capture() -> CaptureResult:
    from kv_transfer.segments import CaptureResult

    return CaptureResult(error=NO_CAPTURE)
