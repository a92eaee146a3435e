"""One engine replica of a pool (prefill or decode): a vLLM engine (or its simulated stand-in,
`engine.kind: simulated`) behind a Serve deployment."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import ray
from ray import serve
from ray.serve import metrics

from baton.engine.args import EngineSpec
from baton.engine.cpu_cores import CoreClaim, claim_cores
from baton.engine.realtime.manager import RealtimeSessions, UnknownSession
from baton.engine.realtime.messages import RealtimeClose, RealtimeOpen, RealtimeTick, TickResult
from baton.engine.runner import EngineRunner
from baton.engine.types import EngineStats, EngineUnavailable, GenerationDelta, GenerationRequest, StageTimes
from baton.engine.vllm_engine import engine_factory_for
from deployments.log_guard import serve_logging_kept
from deployments.metrics import ServeMemoryPullMetrics, ServeSegmentMetrics
from deployments.replica_report import HeldConversations, replica_report
from kv_transfer.ledger import process_ledger
from kv_transfer.segment_stats import segment_stats

logger = logging.getLogger("ray.serve")


class EngineReplica:
    """Serve replica owning one EngineRunner. Streams GenerationDelta objects to its callers."""

    def __init__(self, pool: str, spec: EngineSpec, directory: Any = None, memory_store: Any = None,
                 memory_cache_bytes: int = 0):
        self._pool = pool
        self._replica_id = _own_replica_id()
        self._node_id = _own_node_id()
        self._directory = directory
        self._held = HeldConversations()  # conversations served here: rebuilds a restarted directory's pins
        t0 = time.monotonic()
        spec, self._cores = cores_for_this_replica(pool, spec)
        with serve_logging_kept():  # vLLM and NIXL reconfigure logging while the engine is built
            self._runner = EngineRunner(engine_spec_for_this_replica(spec), engine_factory=engine_factory_for(spec))
        self.start_seconds = time.monotonic() - t0
        self._resolver = None
        if memory_cache_bytes > 0:
            from kv_transfer.segment_pull import process_puller
            from memory_store.resolver import SegmentResolver

            self._resolver = SegmentResolver(self._runner, memory_store, memory_cache_bytes, puller=process_puller())
            self._pull_metrics = ServeMemoryPullMetrics()
        self._realtime = RealtimeSessions(self._runner)
        self._rt_sessions = metrics.Gauge("baton_realtime_sessions", "live real-time sessions on this replica")
        self._rt_kv_bytes = metrics.Gauge("baton_realtime_held_kv_bytes", "host bytes of sink + window KV held for bounded sessions")
        self._ckpt = {name: metrics.Gauge(f"baton_checkpoint_{name}", help_) for name, help_ in (
            ("held", "recurrent-state checkpoints held in the prefix cache (hybrid models)"),
            ("state_bytes", "bytes of recurrent state held as checkpoints"),
            ("match_tokens", "prompt tokens matched in the prefix cache (total)"),
            ("hit_tokens", "matched tokens resumed from a checkpoint (total)"),
            ("recomputed_tokens", "matched tokens recomputed because no checkpoint was kept there (total)"),
        )}
        self._memory_counter = metrics.Counter(
            "baton_memory_requests", "requests carrying memory KV, by outcome (injected | recomputed)", tag_keys=("outcome",))
        # Serve adds deployment (= pool) and replica tags to every metric
        self._kv_gauge = metrics.Gauge("baton_engine_kv_usage", "fraction of the KV pool in use")
        self._running_gauge = metrics.Gauge("baton_engine_running_requests", "requests the engine is running")
        self._waiting_gauge = metrics.Gauge("baton_engine_waiting_requests", "requests waiting in the engine")
        self._segment_metrics = ServeSegmentMetrics()
        logger.info("pool %s: engine up in %.1fs (pid %d)", pool, self.start_seconds, os.getpid())

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        received = time.time()
        if self._pool == "decode":  # a decoder holds the conversation's KV (a prefill replica hands it off)
            self._held.served(request.session_id, time.monotonic())
        injection = await self._memory_segments(request)
        first = True
        async for delta in self._runner.generate(request, injection=injection):
            if first:
                delta = replace(delta, replica=self._replica_id, timing=replace(delta.timing or StageTimes(), replica_received=received))
                first = False
            yield delta

    async def _memory_segments(self, request: GenerationRequest) -> Any:
        """KV for the request's memory facts, or None to compute them from the prompt: prepared
        for the engine (rotated to their positions and cast, in a thread: kv_transfer/prepared.py),
        or the plain segments when that is off or fails (the engine thread then rotates them)."""
        if request.memory is None:
            return None
        if self._resolver is None:
            self._memory_counter.inc(tags={"outcome": "recomputed"})
            return None
        try:
            segs = await self._resolver.resolve(request.prompt_token_ids, request.memory)
        except Exception as e:  # noqa: BLE001 - a cache failure: the engine recomputes the facts
            logger.warning("memory KV for %s unavailable (%s: %s); recomputing", request.request_id, type(e).__name__, e)
            self._memory_counter.inc(tags={"outcome": "recomputed"})
            return None
        self._memory_counter.inc(tags={"outcome": "injected"})
        return await _prepared(request.request_id, segs)

    async def encode_memories(self, prompt_token_ids: tuple[int, ...], memory: Any) -> int:
        """Precompute the KV of `memory`'s facts (and anchor) that no cache holds; returns how many
        segments were encoded. Called by the ingress after facts are added."""
        if self._resolver is None:
            return 0
        segs = await self._resolver.resolve(prompt_token_ids, memory)
        return len(segs)

    # ---- real-time sessions (baton/engine/realtime/) ----------------------------------------------
    async def realtime_open(self, msg: RealtimeOpen) -> str:
        """Open a session on this replica; returns this replica's id (the session's pin)."""
        self._realtime.open(msg)
        self._rt_sessions.set(len(self._realtime))
        return self._replica_id

    async def realtime_tick(self, msg: RealtimeTick) -> TickResult:
        try:
            result = await self._realtime.tick(msg)
        except UnknownSession:  # expired, or this replica restarted: the session cannot go on
            return TickResult(seq=msg.seq, text="", token_ids=(), server_s=0.0, prompt_tokens=0, computed_tokens=0,
                              kv_peak_tokens=0, replica=self._replica_id, fatal=True,
                              error="the session is not open on its replica (idle timeout or replica restart); open a new one")
        self._rt_kv_bytes.set(self._realtime.held_kv_bytes())
        return replace(result, replica=self._replica_id)

    async def realtime_close(self, msg: RealtimeClose) -> bool:
        closed = self._realtime.close(msg.session_id)
        self._rt_sessions.set(len(self._realtime))
        self._rt_kv_bytes.set(self._realtime.held_kv_bytes())
        return closed

    async def record_routing_stats(self) -> dict[str, Any]:
        """Called by Serve every routing_stats_period_s; also pushes the same figures, and a
        decoder's recent conversations, to the conversation directory (fire and forget: a slow
        directory never delays routing). Also the memory purge tick: the resolver pulls the memory
        store's deletion log in the background and drops deleted facts' KV from its cache."""
        if self._resolver is not None:
            self._resolver.sync_soon()
        stats = self._runner.stats
        ck = self._runner.checkpoint_metrics
        if ck is not None:
            for name, value in (("held", ck.checkpoints_held), ("state_bytes", ck.state_bytes), ("match_tokens", ck.match_tokens),
                                ("hit_tokens", ck.hit_tokens), ("recomputed_tokens", ck.recomputed_tokens)):
                self._ckpt[name].set(value)
        self._kv_gauge.set(stats.kv_usage)
        self._running_gauge.set(stats.num_running)
        self._waiting_gauge.set(stats.num_waiting)
        seg = segment_stats()
        self._segment_metrics.publish(seg)
        extra = seg.as_report()
        if self._resolver is not None:  # KV of deleted memory facts dropped from this replica's cache
            r = self._resolver
            self._pull_metrics.publish({"pulled_segments": r.pulled_segments, "pulled_bytes": r.pulled_bytes,
                                        "pull_failures": r.pull_failures})
            extra.update(memory_purged_segments=r.purged_segments, memory_encoded_tokens=r.encoded_tokens,
                         memory_pulled_segments=r.pulled_segments,
                         memory_pulled_bytes=r.pulled_bytes, memory_pull_failures=r.pull_failures)
        if ck is not None:  # shown per replica in /baton/stats
            extra.update(checkpoints_held=ck.checkpoints_held, checkpoint_state_bytes=ck.state_bytes,
                         checkpoint_hit_tokens=ck.hit_tokens, checkpoint_recomputed_tokens=ck.recomputed_tokens)
        seq, served, dropped = self._held.delta(time.monotonic())  # what changed since the last report
        report = replica_report(self._replica_id, self._pool, stats, process_ledger().totals(), extra,
                                served, self._realtime.token_growth(), self._node_id, delta=(seq, dropped))
        if self._directory is not None and stats.healthy:
            # to every shard (deployments/directory_client.py); a shard without this replica's complete
            # list of conversations (a fresh one) asks for it and gets it at once
            self._directory.report(report, lambda: replace(report, conversations=self._held.recent(time.monotonic()),
                                                           conversations_complete=True, dropped=(), seq=self._held.seq))
        return report.figures()

    async def engine_stats(self) -> EngineStats:
        return self._runner.stats

    async def describe(self) -> dict[str, Any]:
        return {"pool": self._pool, "pid": os.getpid(), "start_seconds": self.start_seconds, "rss_bytes": _rss_bytes()}

    async def check_health(self) -> None:
        stats = self._runner.stats
        if not stats.healthy:
            raise EngineUnavailable(stats.reason)

    def __del__(self) -> None:
        runner = getattr(self, "_runner", None)
        if runner is not None:
            runner.shutdown()


async def _prepared(request_id: str, segs: tuple[Any, ...]) -> Any:
    """The segments rotated and cast off the event loop and off the engine thread, or the segments
    themselves when preparing fails (the engine thread rotates them at load time, as before)."""
    from kv_transfer.segment_worker import prepare_injection

    try:
        return await asyncio.to_thread(prepare_injection, segs)
    except Exception as e:  # noqa: BLE001 - the old path still serves the request
        logger.warning("preparing memory KV for %s failed (%s: %s); the engine rotates it", request_id, type(e).__name__, e)
        return segs


def cores_for_this_replica(pool: str, spec: EngineSpec) -> tuple[EngineSpec, CoreClaim | None]:
    """The spec on the slice of the pool's cores this replica claimed (held while the claim lives)."""
    if spec.cpu is None or spec.cores:
        return spec, None
    claim = claim_cores(pool, spec.cpu)
    logger.info("pool %s: engine on cores %s", pool, claim.cores)
    return spec.pinned_to(claim.cores), claim


def engine_spec_for_this_replica(spec: EngineSpec) -> EngineSpec:
    """A NIXL engine needs a side channel (host, port) of its own, chosen where it runs."""
    if "kv_transfer_config" not in spec.engine_kwargs:
        return spec
    from kv_transfer.nixl import side_channel_env

    return replace(spec, env={**spec.env, **side_channel_env()})


def _own_replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve (tests), there is no replica context
        return f"pid-{os.getpid()}"


def _own_node_id() -> str:
    """The Ray node this replica runs on (shown per replica in /baton/stats); "" outside Ray."""
    try:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - no runtime context (tests)
        return ""


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


EngineReplicaDeployment = serve.deployment(EngineReplica, name="engine")
