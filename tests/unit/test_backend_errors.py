"""The ingress's way to the pools (deployments/backend.py): Ray/Serve failures become the engine
errors the frontend answers as 503/400, and PoolBackend serves a turn as the directory planned it
(remote prefill, target decoder) over fake Serve handles, falling back instead of failing where it
can. Exceptions are built as Ray builds them; no cluster is started."""
from __future__ import annotations

import asyncio
import warnings

import pytest
from ray import exceptions as rx

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    from deployments import backend as backend_module
    from deployments.backend import PoolBackend, ReplicaLost, translate_error
from fakes import FakeDirectory, FakePoolHandle, FakeResponseStream, scripted_deltas

from baton.engine.types import EngineRequestError, EngineUnavailable, GenerationDelta, GenerationRequest, SamplingSpec
from router.directory_state import DirectorySettings, DirectoryState
from router.policy import TurnPlan
from router.report import ReplicaReport

TRACEBACK = 'Traceback (most recent call last):\n  File "baton/engine/runner.py", line 1, in generate\nsecret'


def raised_in_replica(cause: BaseException) -> rx.RayTaskError:
    """What a Serve handle raises for an exception inside the replica: RayTaskError's dual instance."""
    return rx.RayTaskError("EngineReplica.generate", TRACEBACK, cause, proctitle="ray::test", pid=1, ip="127.0.0.1").as_instanceof_cause()


# ---- translate_error --------------------------------------------------------------------------------


@pytest.mark.parametrize("engine_error", [EngineUnavailable, EngineRequestError])
def test_engine_errors_raised_in_the_replica_keep_their_kind_and_message(engine_error: type[Exception]) -> None:
    wrapped = raised_in_replica(engine_error("the engine says no"))
    assert isinstance(wrapped, rx.RayTaskError) and isinstance(wrapped, engine_error)  # as Ray delivers it
    out = translate_error(wrapped)
    assert type(out) is engine_error
    assert str(out) == "the engine says no"
    assert "Traceback" not in str(out) and "secret" not in str(out)


def test_a_plain_ray_task_error_is_unwrapped_too() -> None:
    wrapped = rx.RayTaskError("f", TRACEBACK, EngineRequestError("bad stop"), proctitle="p", pid=1, ip="127.0.0.1")
    out = translate_error(wrapped)
    assert type(out) is EngineRequestError and str(out) == "bad stop"


@pytest.mark.parametrize("cause", [ValueError("oops"), KeyError("k"), ZeroDivisionError()])
def test_other_replica_exceptions_are_the_engine_being_unavailable(cause: Exception) -> None:
    out = translate_error(raised_in_replica(cause))
    assert type(out) is EngineUnavailable
    assert type(cause).__name__ in str(out)
    assert "Traceback" not in str(out) and "secret" not in str(out)


@pytest.mark.parametrize(
    "error",
    [
        rx.ActorDiedError(),
        rx.RayActorError(),
        rx.ActorUnavailableError("connection lost", None),
    ],
    ids=["ActorDiedError", "RayActorError", "ActorUnavailableError"],
)
def test_a_dead_replica_is_a_lost_replica(error: Exception) -> None:
    out = translate_error(error)
    assert type(out) is ReplicaLost and "died" in str(out)
    assert isinstance(out, EngineUnavailable)  # the frontend answers 503


def test_back_pressure_is_unavailable_with_a_retry_hint() -> None:
    out = translate_error(BackPressureError(num_queued_requests=10, max_queued_requests=10))
    assert type(out) is EngineUnavailable and "capacity" in str(out)


def test_an_undeployed_pool_is_unavailable() -> None:
    out = translate_error(DeploymentUnavailableError(DeploymentID(name="decode", app_name="baton")))
    assert type(out) is EngineUnavailable and "not available" in str(out)


@pytest.mark.parametrize("error", [EngineUnavailable("x"), EngineRequestError("y")])
def test_engine_errors_pass_through_as_they_are(error: Exception) -> None:
    assert translate_error(error) is error


@pytest.mark.parametrize("error", [ValueError("v"), RuntimeError("r"), asyncio.CancelledError(), TimeoutError()])
def test_unrelated_exceptions_are_left_unchanged(error: BaseException) -> None:
    assert translate_error(error) is error


# ---- PoolBackend: streaming over a fake decode handle ------------------------------------------------

KV = {"remote_block_ids": [1, 2], "remote_engine_id": "prefill-0", "do_remote_prefill": True}


def deltas(n: int, replica: str | None = None) -> list[GenerationDelta]:
    return scripted_deltas(n, replica=replica)


def request(session_id: str | None = None, user: str | None = None) -> GenerationRequest:
    return GenerationRequest(request_id="r1", prompt_token_ids=(1, 2, 3), sampling=SamplingSpec(max_tokens=4), session_id=session_id, user=user)


def decoder(*streams: FakeResponseStream) -> FakePoolHandle:
    return FakePoolHandle(list(streams) or [FakeResponseStream(deltas(3))])


def prefiller(stream: FakeResponseStream | None = None) -> FakePoolHandle:
    return FakePoolHandle([stream or FakeResponseStream(scripted_deltas(1, replica="p0", kv_transfer_params=KV))])


def lost() -> FakeResponseStream:
    """A decoder that dies before its first delta."""
    return FakeResponseStream(deltas(3), error=rx.ActorDiedError(), error_after=0)


async def collect(backend: PoolBackend, req: GenerationRequest, stop_after: int | None = None) -> list[GenerationDelta]:
    got: list[GenerationDelta] = []
    gen = backend.generate(req)
    try:
        async for d in gen:
            got.append(d)
            if stop_after is not None and len(got) == stop_after:
                break
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
    return got


def serve_turn(backend: PoolBackend, req: GenerationRequest, stop_after: int | None = None) -> list[GenerationDelta]:
    return asyncio.run(collect(backend, req, stop_after))


def test_without_a_directory_a_whole_stream_passes_through_placed_by_load() -> None:
    handle = decoder(FakeResponseStream(deltas(3)))
    got = serve_turn(PoolBackend(handle), request("conv-1"))
    assert got == deltas(3)
    assert handle.sent == [request("conv-1")]  # target_replica None, no kv_transfer_params
    assert handle.stream.cancelled == 0


@pytest.mark.parametrize("sid", ["conv-1", None])
def test_the_decode_handle_is_asked_for_a_stream_and_nothing_else(sid: str | None) -> None:
    # placement travels in the request (target_replica), not in handle options
    handle = decoder()
    serve_turn(PoolBackend(handle, None, FakeDirectory([TurnPlan("d0", remote_prefill=False, reason="new")])), request(sid))
    assert handle.options_calls == [{"stream": True}]


def test_a_consumer_that_stops_early_cancels_the_engine_request() -> None:
    handle = decoder(FakeResponseStream(deltas(5)))
    got = serve_turn(PoolBackend(handle), request("s"), stop_after=2)
    assert [d.text for d in got] == ["t0", "t1"]
    assert handle.stream.cancelled == 1


@pytest.mark.parametrize("engine_error", [EngineUnavailable, EngineRequestError])
def test_a_failure_mid_stream_is_translated_and_cancels(engine_error: type[Exception]) -> None:
    handle = decoder(FakeResponseStream(deltas(4), error=raised_in_replica(engine_error("lost it")), error_after=2))
    got: list[GenerationDelta] = []

    async def run() -> None:
        async for d in PoolBackend(handle).generate(request()):
            got.append(d)

    with pytest.raises(engine_error) as info:
        asyncio.run(run())
    assert type(info.value) is engine_error and str(info.value) == "lost it"
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert len(got) == 2
    assert handle.stream.cancelled == 1


def test_a_ray_failure_before_the_first_delta_without_a_directory_is_unavailable() -> None:
    handle = decoder(lost())
    with pytest.raises(ReplicaLost):
        serve_turn(PoolBackend(handle), request("s"))
    assert len(handle.sent) == 1  # no directory: nobody to ask for another decoder


def test_unknown_failures_are_reraised_as_they_are() -> None:
    boom = RuntimeError("handle bug")
    handle = decoder(FakeResponseStream(deltas(2), error=boom, error_after=1))
    with pytest.raises(RuntimeError) as info:
        serve_turn(PoolBackend(handle), request())
    assert info.value is boom


# ---- PoolBackend: the directory's plan --------------------------------------------------------------------


def test_the_directory_is_asked_with_session_user_and_prompt_length() -> None:
    directory = FakeDirectory([TurnPlan("d1", remote_prefill=False, reason="pinned")])
    serve_turn(PoolBackend(decoder(FakeResponseStream(deltas(2, replica="d1"))), prefiller(), directory), request("conv-1", user="alice"))
    assert directory.called("route") == [("conv-1", "alice", 3)]
    assert [name for name, _ in directory.calls] == ["route"]  # served by the target: nothing else to tell


def test_target_replica_comes_from_the_plan() -> None:
    handle = decoder(FakeResponseStream(deltas(2, replica="d1")))
    serve_turn(PoolBackend(handle, prefiller(), FakeDirectory([TurnPlan("d1", remote_prefill=False, reason="pinned")])), request("s"))
    assert handle.sent[0].target_replica == "d1"
    assert handle.sent[0].kv_transfer_params is None


@pytest.mark.parametrize("sid, turn", [("s", 2), (None, None)])
def test_the_first_delta_carries_the_plans_turn_index_in_a_conversation(sid: str | None, turn: int | None) -> None:
    plan = TurnPlan("d1", remote_prefill=False, reason="pinned", turn_index=2)
    got = serve_turn(PoolBackend(decoder(FakeResponseStream(deltas(3, replica="d1"))), None, FakeDirectory([plan])), request(sid))
    assert [d.turn_index for d in got] == [turn, None, None]


def test_a_remote_prefill_happens_when_the_plan_says_so_and_its_kv_params_reach_the_decoder() -> None:
    decode, prefill = decoder(FakeResponseStream(deltas(3, replica="d0"))), prefiller()
    got = serve_turn(PoolBackend(decode, prefill, FakeDirectory([TurnPlan("d0", remote_prefill=True, reason="new")])), request("s", user="u"))
    assert [d.text for d in got] == ["t0", "t1", "t2"]  # the client sees the decoder's output only
    (sent,) = prefill.sent
    assert sent.request_id == "r1-prefill" and sent.prompt_token_ids == (1, 2, 3)
    assert sent.sampling.max_tokens == 1 and sent.kv_transfer_params == {"do_remote_decode": True}
    assert (sent.session_id, sent.user, sent.target_replica) == ("s", "u", None)  # a prefill replica is chosen by load
    assert prefill.options_calls == [{"stream": True}]
    (decode_req,) = decode.sent
    assert decode_req.kv_transfer_params == KV and decode_req.target_replica == "d0"
    assert decode_req.request_id == "r1" and decode_req.sampling == request().sampling


@pytest.mark.parametrize("reason", ["pinned", "round_robin"])
def test_no_remote_prefill_when_the_plan_does_not_ask_for_one(reason: str) -> None:
    decode, prefill = decoder(), prefiller()
    serve_turn(PoolBackend(decode, prefill, FakeDirectory([TurnPlan("d0", remote_prefill=False, reason=reason)])), request("s"))  # type: ignore[arg-type]
    assert prefill.sent == [] and decode.sent[0].kv_transfer_params is None


def test_no_remote_prefill_without_a_prefill_pool_even_if_planned() -> None:
    decode = decoder()
    serve_turn(PoolBackend(decode, None, FakeDirectory([TurnPlan("d0", remote_prefill=True, reason="new")])), request("s"))
    assert decode.sent[0].kv_transfer_params is None and decode.sent[0].target_replica == "d0"


@pytest.mark.parametrize(
    "prefill_stream",
    [
        FakeResponseStream(scripted_deltas(1, kv_transfer_params=KV), error=rx.ActorDiedError(), error_after=0),
        FakeResponseStream(scripted_deltas(1, kv_transfer_params=KV), error=raised_in_replica(EngineUnavailable("no blocks")), error_after=0),
        FakeResponseStream(scripted_deltas(1, kv_transfer_params=KV), error=BackPressureError(num_queued_requests=1, max_queued_requests=1)),
        FakeResponseStream(scripted_deltas(2, kv_transfer_params=KV), error=rx.ActorDiedError(), error_after=1),
        FakeResponseStream(scripted_deltas(1, kv_transfer_params=None)),
    ],
    ids=["died", "engine-error", "back-pressure", "died-mid-stream", "finished-without-kv"],
)
def test_a_failed_remote_prefill_falls_back_to_a_local_prefill_and_the_turn_succeeds(prefill_stream: FakeResponseStream) -> None:
    decode, prefill = decoder(FakeResponseStream(deltas(3, replica="d0"))), prefiller(prefill_stream)
    directory = FakeDirectory([TurnPlan("d0", remote_prefill=True, reason="new")])
    got = serve_turn(PoolBackend(decode, prefill, directory), request("s"))
    assert [d.text for d in got] == ["t0", "t1", "t2"]
    (decode_req,) = decode.sent
    assert decode_req.kv_transfer_params is None and decode_req.target_replica == "d0"
    assert [name for name, _ in directory.calls] == ["route"]  # a prefill failure does not fail the decoder


@pytest.mark.parametrize(
    "error", [RuntimeError("directory down"), rx.ActorDiedError(), raised_in_replica(ValueError("bug"))], ids=["runtime", "died", "in-replica"]
)
def test_a_failed_directory_means_placing_a_turn_without_session_by_load_without_remote_prefill(error: BaseException) -> None:
    decode, prefill = decoder(FakeResponseStream(deltas(2, replica="d0"))), prefiller()
    got = serve_turn(PoolBackend(decode, prefill, FakeDirectory(errors={"route": error, "served": error})), request(None))
    assert len(got) == 2
    assert decode.sent[0].target_replica is None and decode.sent[0].kv_transfer_params is None
    assert prefill.sent == []


def test_a_hung_directory_means_placing_a_turn_without_session_by_load_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_module, "DIRECTORY_TIMEOUT_S", 0.05)
    decode = decoder(FakeResponseStream(deltas(2, replica="d0")))
    backend = PoolBackend(decode, prefiller(), FakeDirectory(hang=["route"]))

    async def run() -> list[GenerationDelta]:
        return await asyncio.wait_for(collect(backend, request(None)), timeout=0.5)

    assert len(asyncio.run(run())) == 2
    assert decode.sent[0].target_replica is None


def test_a_delta_from_another_replica_than_the_target_is_reported_as_served() -> None:
    # the router fell back (the target was not available): the pin follows the KV
    directory = FakeDirectory([TurnPlan("d0", remote_prefill=False, reason="pinned")])
    got = serve_turn(PoolBackend(decoder(FakeResponseStream(deltas(3, replica="d1"))), prefiller(), directory), request("s"))
    assert len(got) == 3
    assert directory.called("served") == [("s", "d1")]


def test_a_failing_served_report_does_not_fail_the_turn() -> None:
    directory = FakeDirectory([TurnPlan("d0", remote_prefill=False, reason="pinned")], errors={"served": RuntimeError("down")})
    got = serve_turn(PoolBackend(decoder(FakeResponseStream(deltas(3, replica="d1"))), prefiller(), directory), request("s"))
    assert len(got) == 3 and directory.called("served") == [("s", "d1")]


# ---- PoolBackend: a lost decoder -----------------------------------------------------------------------------


def test_a_decoder_lost_before_the_first_token_is_reported_and_the_turn_replanned_once() -> None:
    directory = FakeDirectory([TurnPlan("d0", remote_prefill=False, reason="pinned"), TurnPlan("d1", remote_prefill=True, reason="repinned")])
    first = lost()
    decode, prefill = decoder(first, FakeResponseStream(deltas(3, replica="d1"))), prefiller()
    got = serve_turn(PoolBackend(decode, prefill, directory), request("s"))
    assert [d.text for d in got] == ["t0", "t1", "t2"]
    assert [name for name, _ in directory.calls] == ["route", "replica_failed", "route"]
    assert directory.called("replica_failed") == [("d0",)]
    assert [r.target_replica for r in decode.sent] == ["d0", "d1"]
    assert decode.sent[1].kv_transfer_params == KV and len(prefill.sent) == 1  # the new plan's remote prefill
    assert first.cancelled == 1


def test_a_decoder_lost_twice_fails_the_turn_after_one_retry() -> None:
    directory = FakeDirectory([TurnPlan("d0", remote_prefill=False, reason="pinned"), TurnPlan("d1", remote_prefill=False, reason="repinned")])
    decode = decoder(lost(), lost(), FakeResponseStream(deltas(1)))
    with pytest.raises(ReplicaLost):
        serve_turn(PoolBackend(decode, prefiller(), directory), request("s"))
    assert len(decode.sent) == 2 and len(directory.called("route")) == 2
    assert directory.called("replica_failed") == [("d0",), ("d1",)]


def test_a_decoder_lost_after_a_delta_is_resumed_on_another_decoder() -> None:
    # the stream goes on from the delivered tokens (tests/unit/test_stream_resume.py has the cases)
    directory = FakeDirectory([TurnPlan("d0", remote_prefill=False, reason="pinned"), TurnPlan("d1", remote_prefill=False, reason="repinned")])
    decode = decoder(FakeResponseStream(deltas(3, replica="d0"), error=rx.ActorDiedError(), error_after=1), FakeResponseStream(deltas(3)))
    got = serve_turn(PoolBackend(decode, prefiller(), directory), request("s"))
    assert [d.text for d in got] == ["t0", "t0", "t1", "t2"]  # the first decoder's token, then the continuation's
    assert [r.target_replica for r in decode.sent] == ["d0", "d1"]
    assert decode.sent[1].prompt_token_ids == (1, 2, 3, 3) and decode.sent[1].sampling.max_tokens == 3
    assert directory.called("replica_failed") == [("d0",)]  # later turns move elsewhere
    assert decode.streams[0].cancelled == 1


def test_a_lost_decoder_placed_by_load_is_not_retried() -> None:
    # the directory could not place the turn: there is no target to report nor a plan to retry
    directory = FakeDirectory(errors={"route": RuntimeError("down")})
    decode = decoder(lost(), FakeResponseStream(deltas(2)))
    with pytest.raises(ReplicaLost):
        serve_turn(PoolBackend(decode, prefiller(), directory), request(None))
    assert len(decode.sent) == 1 and directory.called("replica_failed") == []


@pytest.mark.parametrize("engine_error", [EngineUnavailable("engine stopped"), EngineRequestError("bad stop")])
def test_engine_errors_before_the_first_token_are_not_a_lost_replica(engine_error: Exception) -> None:
    directory = FakeDirectory([TurnPlan("d0", remote_prefill=False, reason="pinned")])
    decode = decoder(FakeResponseStream(deltas(2), error=raised_in_replica(engine_error), error_after=0), FakeResponseStream(deltas(2)))
    with pytest.raises(type(engine_error)):
        serve_turn(PoolBackend(decode, prefiller(), directory), request("s"))
    assert len(decode.sent) == 1 and directory.called("replica_failed") == []


def test_a_lost_decoder_with_the_real_directory_state_moves_the_conversation() -> None:
    """PoolBackend over a DirectoryState (conversation policy): turn 1 on d0 with a handoff; d0
    dies before turn 2's first token; turn 2 is re-placed on d1 with a second handoff; turn 3
    stays on d1 without one."""
    state = DirectoryState(DirectorySettings(policy="conversation"))
    for replica, pool in (("d0", "decode"), ("d1", "decode"), ("p0", "prefill")):
        state.report(ReplicaReport(replica, pool, kv_capacity_tokens=1000), 0.0)
    directory = FakeDirectory(state=state)

    def decode_script(req: GenerationRequest) -> FakeResponseStream:
        if req.target_replica == "d0" and len(directory.called("route")) > 1:
            return lost()
        return FakeResponseStream(deltas(2, replica=req.target_replica))

    decode, prefill = FakePoolHandle(decode_script), FakePoolHandle(lambda _: FakeResponseStream(scripted_deltas(1, kv_transfer_params=KV)))
    backend = PoolBackend(decode, prefill, directory)
    for _ in range(3):
        assert len(serve_turn(backend, request("conv"))) == 2
    assert [(r.target_replica, r.kv_transfer_params is not None) for r in decode.sent] == [("d0", True), ("d0", False), ("d1", True), ("d1", False)]
    assert len(prefill.sent) == 2
    pin = state.pin_of("conv")
    assert pin is not None and (pin.decoder, pin.turns, pin.handoffs) == ("d1", 4, 2)
    assert state.totals["replica_failures"] == 1 and directory.called("served") == []
    state.check_integrity()


def test_a_conversation_belongs_to_the_user_who_opened_it() -> None:
    """Another user's turn on the same session id is refused before any engine work, as
    ConversationNotFound (404 at the ingress); the owner's conversation is untouched. The same
    holds when the refusal crosses Ray (RayTaskError around ForeignConversation)."""
    from baton.engine.types import ConversationNotFound
    from router.directory_state import ForeignConversation

    state = DirectoryState(DirectorySettings(policy="colocated"))
    state.report(ReplicaReport("d0", "decode", kv_capacity_tokens=1000), 0.0)
    decode = FakePoolHandle(lambda req: FakeResponseStream(deltas(2, replica=req.target_replica)))
    backend = PoolBackend(decode, None, FakeDirectory(state=state))
    assert len(serve_turn(backend, request("conv", "alice"))) == 2
    with pytest.raises(ConversationNotFound):
        serve_turn(backend, request("conv", "mallory"))
    with pytest.raises(ConversationNotFound):
        serve_turn(backend, request("conv"))  # no user is not alice either
    assert len(decode.sent) == 1
    pin = state.pin_of("conv")
    assert pin is not None and (pin.user, pin.turns) == ("alice", 1)
    assert state.totals["foreign_session_refused"] == 2
    wrapped = FakeDirectory(errors={"route": raised_in_replica(ForeignConversation("conv"))})
    with pytest.raises(ConversationNotFound):
        serve_turn(PoolBackend(decode, None, wrapped), request("conv", "mallory"))
    assert len(decode.sent) == 1



class CancelRaises(FakeResponseStream):
    """Serve's DeploymentResponseGenerator whose routing failed: iterating raises the failure, and so
    does cancel() (it fetches the routing result when the router runs in its own loop)."""

    def cancel(self) -> None:
        super().cancel()
        if self._error is not None:
            raise self._error


def test_a_full_prefill_queue_falls_back_even_when_cancel_reraises() -> None:
    full = BackPressureError(num_queued_requests=2, max_queued_requests=2)
    decode, prefill = decoder(FakeResponseStream(deltas(2, replica="d0"))), prefiller(CancelRaises([], error=full))
    directory = FakeDirectory([TurnPlan("d0", remote_prefill=True, reason="new")])
    got = serve_turn(PoolBackend(decode, prefill, directory), request("s"))
    assert len(got) == 2 and decode.sent[0].kv_transfer_params is None  # the decoder prefilled it
    assert prefill.stream.cancelled == 1


def test_a_full_decode_queue_is_unavailable_even_when_cancel_reraises() -> None:
    full = BackPressureError(num_queued_requests=2, max_queued_requests=2)
    decode = decoder(CancelRaises([], error=full))
    with pytest.raises(EngineUnavailable, match="capacity"):
        serve_turn(PoolBackend(decode), request("s"))


def test_each_plans_pool_view_goes_to_the_load_hint() -> None:
    hints: list[TurnPlan] = []
    plans = [TurnPlan("d0", remote_prefill=False, reason="new", pool_queueing=True, pool_in_flight=3),
             TurnPlan("d0", remote_prefill=False, reason="pinned")]
    backend = PoolBackend(decoder(FakeResponseStream(deltas(1)), FakeResponseStream(deltas(1))), None, FakeDirectory(plans), load_hint=hints.append)
    serve_turn(backend, request("s"))
    serve_turn(backend, request("s"))
    assert [(h.pool_queueing, h.pool_in_flight) for h in hints] == [(True, 3), (False, 0)]
    serve_turn(PoolBackend(decoder(FakeResponseStream(deltas(1))), load_hint=hints.append), request())  # no directory: no hint
    assert len(hints) == 2
