"""The ingress's way to the engine pools: ask the conversation directory where a turn goes,
prefill it on the prefill pool when the plan says so (its KV then moves to the decoder over
NIXL), and stream the decoder's output. The directory also checks who owns a conversation, so a
turn with a session id is refused (503) while it cannot answer, never placed unchecked. Ray failures become the engine errors the frontend
understands (503 / 400), never a stack trace; a failed prefill or transfer falls back to
prefilling on the decoder; a decoder that dies before the first token is replaced once, and one
that dies mid-stream is replaced by a continuation of the same stream (deployments/resume.py)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from ray import exceptions as ray_exceptions
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from baton.engine.types import (
    ConversationNotFound,
    EngineRequestError,
    EngineUnavailable,
    GenerationDelta,
    GenerationRequest,
    SamplingSpec,
    StageTimes,
)
from deployments.directory_client import DirectoryShards
from deployments.metrics import ResumeMetrics
from deployments.pin_sync import ShardedPins
from deployments.resume import ReplayDiverged, ReplaySplice, ResumeOutcome, ResumePlan, client_delta, finish_delta, plan_resume
from deployments.turn_placement import Placement
from router.directory_state import ForeignConversation, PinsRebuilding
from router.policy import NoReplicaAvailable, TurnPlan

logger = logging.getLogger("ray.serve")

DIRECTORY_TIMEOUT_S = 5.0


class ReplicaLost(EngineUnavailable):
    """The replica serving the request died or became unreachable."""


def translate_error(e: BaseException) -> BaseException:
    """Map what a Serve handle can raise to EngineUnavailable / EngineRequestError (or `e` itself)."""
    if isinstance(e, ray_exceptions.RayTaskError):  # an exception raised inside the replica
        cause = getattr(e, "cause", None)
        if isinstance(cause, (EngineUnavailable, EngineRequestError)):
            return type(cause)(str(cause))
        return EngineUnavailable(f"engine replica error: {type(cause or e).__name__}")
    if isinstance(e, (EngineUnavailable, EngineRequestError)):
        return e
    if isinstance(e, BackPressureError):
        return EngineUnavailable("engine pool is at capacity; retry later")
    if isinstance(e, DeploymentUnavailableError):
        return EngineUnavailable("engine pool is not available")
    if isinstance(e, ray_exceptions.RayActorError):  # died / unavailable replica
        return ReplicaLost("the engine replica died while serving the request")
    return e


def cancel_quietly(gen: Any) -> None:
    """Best-effort cancel of a handle call. Serve's DeploymentResponseGenerator.cancel() re-raises
    the call's own failure (e.g. BackPressureError when the pool's queue is full) when the router
    runs in its own loop; that failure is already handled by the caller and must not replace its
    fallback (a local prefill) or its translated error (503 with Retry-After)."""
    try:
        gen.cancel()
    except Exception as e:  # noqa: BLE001 - already handled where the call failed
        logger.debug("cancel of a failed handle call raised %s", type(e).__name__)


class PoolBackend:
    """Serves one turn under the configured routing policy (decided by the directory).

    A decoder lost before the stream's first delta: the turn is re-placed once, as planned
    (remote prefill and all). A decoder lost after deltas reached the client: the stream is
    resumed on another decoder (deployments/resume.py), at most once, prefilled on that decoder;
    `resumes` counts how that went (deployments.metrics.ResumeMetrics). A stream the client
    left is never resumed: closing it cancels the engine request and ends here.

    load_hint: given each plan (its `pool_queueing` and `pool_in_flight`: the directory's view of
    the pools, router/policy.TurnPlan), for the ingress's adaptive admission; no extra directory
    call.

    pins: this ingress's cache of the directory's pins (deployments/pin_sync.py): a pinned
    conversation's turn is planned from it when it can be (router/pin_cache.py), else by the
    directory, whose answer refills it; so is a turn without a session id when there is no
    prefill pool (from the cache's view of the decoders' loads). A decoder that fails here drops
    its cached pins; a turn that ran elsewhere than planned drops its conversation's.

    directory: its shards (deployments/directory_client.py); a conversation's calls go to the
    shard its session id hashes to, each shard with its own pin cache here."""

    def __init__(self, decode: Any, prefill: Any | None = None, directory: DirectoryShards | None = None, resumes: ResumeMetrics | None = None,
                 load_hint: Callable[[TurnPlan], None] | None = None, pins: ShardedPins | None = None):
        self._decode = decode
        self._prefill = prefill
        self._directory = directory
        self._resumes = resumes
        self._load_hint = load_hint
        self._pins = pins if directory is not None else None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        delivered: list[int] = []  # token ids the client has, in order
        delivered_text: list[str] = []  # and their text
        plan: ResumePlan | None = None  # the resume being served
        splice: ReplaySplice | None = None  # a replay's check of the delivered prefix (constrained output)
        yielded = replaced = failed = False
        turn = request  # what the next decoder is asked
        try:
            while True:
                placement = await self._place(turn)
                placed = time.time()
                if plan is not None:  # a resume is prefilled on its new decoder: one hop fewer in a recovery path
                    placement = replace(placement, remote_prefill=False)
                target = placement.decode_replica
                first = True
                try:
                    async with aclosing(self._stream(turn, placement, placed)) as stream:
                        async for delta in stream:
                            if first:
                                first = False
                                if delta.replica and delta.replica != target:
                                    if self._pins is not None:
                                        self._pins.for_session(request.session_id).cache.forget(request.session_id)
                                    await self._tell_directory("served", lambda d, sid=request.session_id, rid=delta.replica:
                                                               d.for_session(sid).served.remote(sid, rid))
                            if splice is not None:
                                spliced = splice.feed(delta)
                                if spliced is None:
                                    continue
                                delta = spliced
                            if plan is not None:
                                delta = client_delta(delta, plan)
                            elif not yielded:
                                delta = replace(delta, turn_index=placement.turn_index)
                            delivered.extend(delta.token_ids)
                            delivered_text.append(delta.text)
                            yielded = True
                            yield delta
                    return
                except ReplayDiverged as e:
                    logger.warning("stream %s: %s; the stream fails", request.request_id, e)
                    raise ReplicaLost(f"the engine replica died while serving the request, and its replay diverged ({e})") from None
                except ReplicaLost:
                    if target is not None:
                        if self._pins is not None:
                            self._pins.forget_decoder(target)
                        await self._tell_directory("replica_failed", lambda d, rid=target: d.replica_failed(rid))
                    if not yielded and target is not None and not replaced:
                        replaced = True
                        logger.warning("decoder %s lost before the first token of %s; re-placing the turn", target, request.request_id)
                        continue
                    if not yielded:
                        raise
                    decision = plan_resume(request, delivered, plan.resume if plan else 0, placed=target is not None)
                    if isinstance(decision, ResumePlan):
                        logger.warning("decoder %s lost after %d tokens of %s; resuming the stream as %s", target, decision.delivered,
                                       request.request_id, decision.request.request_id)
                        plan, turn = decision, decision.request
                        splice = ReplaySplice(delivered, "".join(delivered_text)) if decision.replay else None
                        continue
                    if plan is None:
                        self._count(decision.outcome)
                    if decision.finish_reason is None:
                        logger.warning("stream %s lost its decoder after %d tokens; not resumed (%s)", request.request_id, len(delivered),
                                       decision.reason)
                        raise
                    yield finish_delta(decision, len(request.prompt_token_ids))
                    return
        except Exception:
            failed = True
            raise
        finally:
            if plan is not None:
                self._count("failed" if failed else "resumed")

    async def _stream(self, request: GenerationRequest, placement: Placement, placed: float) -> AsyncIterator[GenerationDelta]:
        """One decoder's stream for `request` as placed (after a remote prefill when the placement
        says so). Ray failures come out translated; the engine request is cancelled unless it
        finished (failed, or closed early by the consumer). Its first delta's timing gains the
        ingress's stages (placed at `placed`, the remote prefill, the delta's arrival)."""
        kv_params = await self._remote_prefill(request, placement.prefill_replica) if placement.remote_prefill else None
        prefilled = time.time() if placement.remote_prefill else None
        # the prefill engine injected the memories and its KV arrives over NIXL: the decoder
        # has nothing left to inject (the cache salt stays, so later turns hit that KV)
        memory = None if kv_params else request.memory
        decode_req = replace(request, target_replica=placement.decode_replica, kv_transfer_params=kv_params, memory=memory)
        gen = self._decode.options(stream=True).generate.remote(decode_req)
        done = False
        first = True
        try:
            async for delta in gen:
                done = delta.finished
                if first:
                    first = False
                    delta = replace(delta, timing=replace(delta.timing or StageTimes(), placed=placed, prefilled=prefilled,
                                                          ingress_first=time.time()))
                yield delta
        except Exception as e:
            translated = translate_error(e)
            if translated is e:
                raise
            logger.warning("request %s failed: %s", request.request_id, translated)
            raise translated from None
        finally:
            if not done:
                cancel_quietly(gen)

    def _count(self, outcome: ResumeOutcome) -> None:
        if self._resumes is not None:
            self._resumes.stream_resume(outcome)

    async def _place(self, request: GenerationRequest) -> Placement:
        """The directory's plan for this turn; without a directory, by load. The directory also
        checks who owns a conversation, so a turn with a session id fails closed: when the
        directory cannot answer, EngineUnavailable (503 + Retry-After), never a turn placed with
        no owner check. A turn without one, or one the directory checked but had no live decoder
        for (NoReplicaAvailable comes after the check), is placed by load."""
        if self._directory is None:
            return Placement.by_load()
        n = len(request.prompt_token_ids)
        syncer = None
        if self._pins is not None:
            self._pins.start()
            syncer = self._pins.for_session(request.session_id)  # the cache of the conversation's directory shard
            cache = syncer.cache
            # a turn outside a conversation needs no owner check; without a prefill pool only its decoder is to choose
            cached = cache.plan(request.session_id, request.user, n) if request.session_id else (
                cache.plan_sessionless(n) if self._prefill is None else None)
            if cached is not None:
                return self._placed(cached, request)
        try:
            via = {"via": syncer.ingress_id} if syncer is not None else {}
            plan = await asyncio.wait_for(self._directory.for_session(request.session_id).route.remote(request.session_id, request.user, n, **via),
                                          DIRECTORY_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the directory's placement is advice; its owner check is not
            cause = getattr(e, "cause", None) or e
            if isinstance(cause, ForeignConversation):
                raise ConversationNotFound(request.session_id) from None
            if isinstance(cause, PinsRebuilding):
                raise EngineUnavailable("the conversation directory restarted and is restoring this conversation's decoder; retry shortly") from None
            if request.session_id and not isinstance(cause, NoReplicaAvailable):
                logger.warning("conversation directory could not check %s (%s); refusing the turn", request.request_id, type(e).__name__)
                raise EngineUnavailable(
                    "the conversation directory is unreachable, so the conversation's owner cannot be checked; retry shortly"
                ) from None
            logger.warning("conversation directory could not place %s (%s); placing by load", request.request_id, type(e).__name__)
            return Placement.by_load()
        if syncer is not None:
            syncer.cache.remember(request.session_id, request.user, plan, n)
        return self._placed(plan, request)

    def _placed(self, plan: TurnPlan, request: GenerationRequest) -> Placement:
        if self._load_hint is not None:
            self._load_hint(plan)
        return Placement.of(plan, prefill_pool=self._prefill is not None, in_conversation=bool(request.session_id))

    async def flush_pins(self) -> None:
        """This ingress's cached turns reach the directory now (before it is read)."""
        if self._pins is not None:
            await self._pins.flush()

    def pin_cache_snapshot(self) -> dict[str, Any] | None:
        return self._pins.snapshot() if self._pins is not None else None

    async def _remote_prefill(self, request: GenerationRequest, target: str | None = None) -> dict[str, Any] | None:
        """Prefill on the prefill pool (on `target`, the directory's choice, when it is alive);
        returns the KV handle for the decoder, or None to make the decoder prefill locally (a
        failed prefill never fails the turn)."""
        prefill_req = GenerationRequest(
            request_id=f"{request.request_id}-prefill",
            prompt_token_ids=request.prompt_token_ids,
            sampling=SamplingSpec(max_tokens=1, temperature=0.0),
            session_id=request.session_id,
            user=request.user,
            kv_transfer_params={"do_remote_decode": True},
            memory=request.memory,
            cache_salt=request.cache_salt,
            target_replica=target,
        )
        params = None
        done = False
        gen = self._prefill.options(stream=True).generate.remote(prefill_req)
        try:
            async for delta in gen:
                if delta.finished:
                    params, done = delta.kv_transfer_params, True
        except Exception as e:  # noqa: BLE001 - fall back to recompute on the decoder
            logger.warning("remote prefill of %s failed (%s); the decoder prefills it", request.request_id, type(translate_error(e)).__name__)
            return None
        finally:
            if not done:  # failed or cancelled (client gone): free the prefill engine's blocks now
                cancel_quietly(gen)
        return params

    async def _tell_directory(self, method: str, call: Callable[[DirectoryShards], Awaitable[Any]]) -> None:
        """`call(directory)`, advisory: a failure or timeout is logged, never raised."""
        if self._directory is None:
            return
        try:
            await asyncio.wait_for(call(self._directory), DIRECTORY_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - advisory
            logger.warning("directory %s failed: %s", method, type(e).__name__)
