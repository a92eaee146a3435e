"""An in-process vLLM engine owned by one background thread.

The engine is not thread-safe, so exactly one thread (the engine thread) builds it, adds and
aborts requests, and calls step(). Callers on an asyncio loop talk to it through a command queue
and receive deltas on per-request asyncio queues (filled with loop.call_soon_threadsafe).

Invariant: every request id in `_streams` is either queued as an `add` command or known to the
engine; it leaves `_streams` exactly once (finished, aborted, or failed).
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from baton.engine.args import EngineSpec
from baton.engine.types import (
    EngineRequestError,
    EngineStats,
    EngineUnavailable,
    GenerationDelta,
    GenerationRequest,
    SamplingSpec,
)

if TYPE_CHECKING:
    from kv_transfer.segments import KVSegment

logger = logging.getLogger("baton.engine")

_IDLE_WAIT_S = 0.05


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue


@dataclass(frozen=True)
class _Add:
    request: GenerationRequest
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


def apply_engine_environment(env: dict[str, str]) -> None:
    """vLLM reads these at import: call before the first `import vllm` of the process."""
    os.environ.update(env)


def _sampling_params(req: GenerationRequest, kv_transfer_params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = req.sampling
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else 0,
        seed=s.seed,
        stop=list(s.stop) or None,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        ignore_eos=s.ignore_eos,
        logprobs=0 if s.logprobs else None,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
    )


class EngineRunner:
    """Owns one vLLM LLMEngine on a dedicated thread. Construct, then `await generate(...)`."""

    def __init__(self, spec: EngineSpec, start_timeout_s: float = 600.0):
        apply_engine_environment(spec.env)
        self._spec = spec
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._stats = EngineStats()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.start_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            raise EngineUnavailable(f"engine did not start within {start_timeout_s:.0f}s")
        if self._start_error is not None:
            raise EngineUnavailable(f"engine failed to start: {self._start_error}") from self._start_error

    # ---- caller side (any asyncio loop) -------------------------------------------------------
    @property
    def stats(self) -> EngineStats:
        return self._stats

    async def generate(
        self, req: GenerationRequest, injection: tuple["KVSegment", ...] | None = None, capture: tuple[tuple[int, int], ...] = ()
    ) -> AsyncIterator[GenerationDelta]:
        """Yield deltas until the request finishes. Cancelling the consumer aborts the request.

        injection: KV segments laid from position 0 (kv_transfer/segments.py) that the segment
        connector loads instead of computing those prompt tokens. capture: prompt ranges whose
        KV the connector saves (collect them with `take_capture(req.request_id)`)."""
        kv_params = req.kv_transfer_params
        if injection or capture:
            from kv_transfer.segment_connector import PARAMS_KEY
            from kv_transfer.segments import process_segments

            seg: dict[str, Any] = {"key": req.request_id}
            if injection:
                seg["inject_end"] = process_segments().offer(req.request_id, injection).end
            if capture:
                seg["capture"] = [list(r) for r in capture]
            kv_params = {**(kv_params or {}), PARAMS_KEY: seg}
        try:
            async for delta in self._generate(req, kv_params):
                yield delta
        finally:
            if injection and not capture:  # a capture's key is discarded by capture() after the take
                from kv_transfer.segments import process_segments

                process_segments().discard(req.request_id)

    async def capture(self, request_id: str, prompt_token_ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...],
                      cache_salt: str | None = None) -> tuple["KVSegment", ...]:
        """Compute `prompt_token_ids` once (one output token) and return the KV of `ranges`,
        keys position-free. Raises EngineRequestError when the connector could not capture."""
        from kv_transfer.segments import process_segments

        req = GenerationRequest(request_id=request_id, prompt_token_ids=tuple(prompt_token_ids),
                                sampling=SamplingSpec(max_tokens=1, temperature=0.0), cache_salt=cache_salt)
        try:
            async for _ in self.generate(req, capture=ranges):
                pass
            result = process_segments().take_capture(request_id)
        finally:
            process_segments().discard(request_id)
        if result is None or result.error:
            raise EngineRequestError(f"KV capture failed: {result.error if result else 'the connector saw no capture'}")
        return result.segments

    async def _generate(self, req: GenerationRequest, kv_params: dict[str, Any] | None) -> AsyncIterator[GenerationDelta]:
        if not self._stats.healthy:
            raise EngineUnavailable(self._stats.reason or "engine is not healthy")
        stream = _Stream(loop=asyncio.get_running_loop(), out=asyncio.Queue())
        with self._streams_lock:
            if req.request_id in self._streams:
                raise EngineRequestError(f"duplicate request id {req.request_id!r}")
            self._streams[req.request_id] = stream
        self._commands.put(_Add(req, kv_params))
        finished = False
        try:
            while True:
                item = _coalesce(await stream.out.get(), stream.out)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(req.request_id))

    def shutdown(self) -> None:
        self._commands.put(_Stop())
        self._thread.join(timeout=30)

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        t0 = time.monotonic()
        cpus = os.sched_getaffinity(0)
        try:
            threads = self._spec.env.get("OMP_NUM_THREADS")
            if threads:  # OMP_NUM_THREADS only counts if torch was not imported yet; make it hold
                import torch

                torch.set_num_threads(int(threads))
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine

            try:
                engine = LLMEngine.from_engine_args(EngineArgs(**self._spec.engine_kwargs))
            finally:
                # NIXL's CPU worker pins the thread that builds the engine to the last core; with
                # several engines on a machine they would all share it. Keep our own mask unless
                # vLLM binds threads on purpose.
                if self._spec.env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind") == "nobind":
                    os.sched_setaffinity(0, cpus)
        except BaseException as e:  # noqa: BLE001 - reported to the constructor
            logger.exception("engine start failed")
            self._start_error = e
            self._stats = EngineStats(healthy=False, reason=f"start failed: {e}")
            self._ready.set()
            return
        self.start_seconds = time.monotonic() - t0
        self._scheduler = _find_scheduler(engine)
        self._checkpoints_at = 0.0
        self._kv_capacity_tokens = _kv_capacity_tokens(self._scheduler)
        self._publish_stats(engine, 0)
        self._ready.set()
        steps = 0
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not self._drain_commands(engine, block=not busy):
                    break
                # a prefill engine holding KV for a decoder has no unfinished request but must
                # keep stepping to see the reader's notification and free the blocks
                holding = self._scheduler is not None and self._scheduler.has_requests()
                if engine.has_unfinished_requests() or holding:
                    outputs = engine.step()
                    steps += 1
                    self._dispatch(outputs)
                self._publish_stats(engine, steps)
        except BaseException as e:  # noqa: BLE001 - the engine is dead; fail every stream
            logger.exception("engine step failed; engine marked unhealthy")
            self._stats = EngineStats(healthy=False, reason=f"engine failed: {type(e).__name__}: {e}")
            self._fail_all(EngineUnavailable(self._stats.reason))

    def _drain_commands(self, engine: Any, block: bool) -> bool:
        """Apply queued add/abort commands. Returns False on stop."""
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                self._fail_all(EngineUnavailable("engine shut down"))
                return False
            if isinstance(cmd, _Add):
                self._add(engine, cmd.request, cmd.kv_transfer_params)
            elif isinstance(cmd, _Abort):
                self._abort(engine, cmd.request_id)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, engine: Any, req: GenerationRequest, kv_params: dict[str, Any] | None) -> None:
        prompt: dict[str, Any] = {"prompt_token_ids": list(req.prompt_token_ids)}
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt
        try:
            engine.add_request(req.request_id, prompt, _sampling_params(req, kv_params))
        except Exception as e:  # noqa: BLE001 - vLLM rejects one request; the engine lives on
            self._finish_stream(req.request_id, EngineRequestError(str(e)))

    def _abort(self, engine: Any, request_id: str) -> None:
        with self._streams_lock:
            known = self._streams.pop(request_id, None) is not None
        if known:
            engine.abort_request([request_id])

    def _dispatch(self, outputs: list[Any]) -> None:
        for out in outputs:
            comp = out.outputs[0] if out.outputs else None
            delta = GenerationDelta(
                text=comp.text if comp else "",
                token_ids=tuple(comp.token_ids) if comp else (),
                prompt_tokens=len(out.prompt_token_ids or ()),
                cached_tokens=int(out.num_cached_tokens or 0),
                finished=bool(out.finished),
                finish_reason=comp.finish_reason if comp else None,
                kv_transfer_params=getattr(out, "kv_transfer_params", None),
                logprobs=_sampled_logprobs(comp),
            )
            if delta.finished:
                self._finish_stream(out.request_id, delta)
            else:
                self._send(out.request_id, delta)

    def _send(self, request_id: str, item: Any) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, item)

    def _finish_stream(self, request_id: str, item: Any) -> None:
        with self._streams_lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, item)

    def _fail_all(self, err: BaseException) -> None:
        with self._streams_lock:
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.loop.call_soon_threadsafe(s.out.put_nowait, err)

    @property
    def checkpoint_metrics(self) -> Any:
        """The sparse-checkpoint scheduler's metrics (baton/engine/checkpoints/), refreshed by the engine
        thread at most once a second; None for engines without it."""
        return getattr(self, "_checkpoint_metrics", None)

    def _publish_stats(self, engine: Any, steps: int) -> None:
        sched = self._scheduler
        now = time.monotonic()
        if sched is not None and hasattr(sched, "checkpoint_metrics") and now - self._checkpoints_at >= 1.0:
            self._checkpoints_at = now
            self._checkpoint_metrics = sched.checkpoint_metrics()
        with self._streams_lock:
            in_flight = len(self._streams)
        if sched is None:
            self._stats = EngineStats(in_flight=in_flight, steps=steps)
            return
        requests = list(sched.running) + list(sched.waiting)
        usage = float(sched.kv_cache_manager.usage)
        self._stats = EngineStats(
            kv_usage=usage,
            kv_resident=max(usage, _cached_fraction(sched)),
            kv_capacity_tokens=self._kv_capacity_tokens,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            pending_prefill_tokens=sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in requests),
            in_flight=in_flight,
            steps=steps,
        )


def _coalesce(item: Any, pending: asyncio.Queue) -> Any:
    """Merge deltas that queued up while the consumer was busy into one, so a slow consumer
    (Serve streaming, HTTP) handles one message per wake-up instead of one per engine step.
    An exception or a finished delta ends the merge; nothing queued after it exists."""
    while isinstance(item, GenerationDelta) and not item.finished and not pending.empty():
        nxt = pending.get_nowait()
        if isinstance(nxt, BaseException):
            pending.put_nowait(nxt)  # deliver the tokens first, the error on the next get
            break
        item = GenerationDelta(
            text=item.text + nxt.text,
            token_ids=item.token_ids + nxt.token_ids,
            prompt_tokens=nxt.prompt_tokens or item.prompt_tokens,
            cached_tokens=max(item.cached_tokens, nxt.cached_tokens),
            finished=nxt.finished,
            finish_reason=nxt.finish_reason,
            kv_transfer_params=nxt.kv_transfer_params or item.kv_transfer_params,
            replica=item.replica or nxt.replica,
            logprobs=item.logprobs + nxt.logprobs,
        )
    return item


def _sampled_logprobs(comp: Any) -> tuple[float, ...]:
    """The sampled tokens' logprobs of a delta (vLLM lists {token: Logprob} per position)."""
    if comp is None or not comp.logprobs:
        return ()
    return tuple(float(pos[tok].logprob) for tok, pos in zip(comp.token_ids, comp.logprobs))


def _cached_fraction(sched: Any) -> float:
    """Blocks holding prefix-cached KV (in use or free for reuse) over the pool: what a session's
    retained history occupies even between its requests."""
    try:
        pool = sched.kv_cache_manager.block_pool
        return min(1.0, len(pool.cached_block_hash_to_block) / max(1, pool.num_gpu_blocks - 1))
    except (AttributeError, TypeError):
        return 0.0


def _kv_capacity_tokens(sched: Any) -> int:
    try:
        return int(sched.kv_cache_manager.block_pool.num_gpu_blocks * sched.block_size)
    except AttributeError:
        return 0


def _find_scheduler(engine: Any) -> Any:
    """The in-process scheduler (present with VLLM_ENABLE_V1_MULTIPROCESSING=0), else None."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)
