"""The ingress's way to the pools (deployments/backend.py): Ray/Serve failures become the engine
errors the frontend answers as 503/400, and PoolBackend drives a Serve handle correctly.
Exceptions are built as Ray builds them; no cluster is started."""
from __future__ import annotations

import asyncio
import warnings
from collections.abc import Sequence
from typing import Any

import pytest
from ray import exceptions as rx

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    from deployments.backend import PoolBackend, translate_error
from engine.types import EngineRequestError, EngineUnavailable, GenerationDelta, GenerationRequest, SamplingSpec

TRACEBACK = 'Traceback (most recent call last):\n  File "engine/runner.py", line 1, in generate\nsecret'


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
def test_a_dead_replica_is_unavailable(error: Exception) -> None:
    out = translate_error(error)
    assert type(out) is EngineUnavailable and "died" in str(out)


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


# ---- PoolBackend over a fake handle ----------------------------------------------------------------------


class FakeResponseStream:
    """What `handle.options(stream=True).generate.remote(req)` returns: an async iterator with cancel()."""

    def __init__(self, deltas: Sequence[GenerationDelta], error: BaseException | None = None, error_after: int = 0):
        self._deltas = list(deltas)
        self._error, self._error_after = error, error_after
        self._i = 0
        self.cancelled = 0

    def __aiter__(self) -> "FakeResponseStream":
        return self

    async def __anext__(self) -> GenerationDelta:
        if self._error is not None and self._i == self._error_after:
            raise self._error
        if self._i >= len(self._deltas):
            raise StopAsyncIteration
        self._i += 1
        return self._deltas[self._i - 1]

    def cancel(self) -> None:
        self.cancelled += 1


class FakeHandle:
    """A DeploymentHandle's surface that PoolBackend uses: options(**kw) -> handle, generate.remote."""

    def __init__(self, stream: FakeResponseStream):
        self.stream = stream
        self.options_calls: list[dict[str, Any]] = []
        self.sent: list[GenerationRequest] = []
        self.generate = self

    def options(self, **kw: Any) -> "FakeHandle":
        self.options_calls.append(kw)
        return self

    def remote(self, request: GenerationRequest) -> FakeResponseStream:
        self.sent.append(request)
        return self.stream


def deltas(n: int) -> list[GenerationDelta]:
    return [GenerationDelta(text=f"t{i}", token_ids=(i,), prompt_tokens=3, cached_tokens=0, finished=i == n - 1, finish_reason="stop" if i == n - 1 else None) for i in range(n)]


def request(session_id: str | None = None) -> GenerationRequest:
    return GenerationRequest(request_id="r1", prompt_token_ids=(1, 2, 3), sampling=SamplingSpec(max_tokens=4), session_id=session_id)


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


def test_a_whole_stream_passes_through_and_is_not_cancelled() -> None:
    handle = FakeHandle(FakeResponseStream(deltas(3)))
    got = asyncio.run(collect(PoolBackend(handle), request("conv-1")))
    assert got == deltas(3)
    assert handle.sent == [request("conv-1")]
    assert handle.stream.cancelled == 0


@pytest.mark.parametrize("sid, expected", [("conv-1", {"stream": True, "session_id": "conv-1"}), (None, {"stream": True}), ("", {"stream": True})])
def test_session_id_goes_in_the_handle_options_only_when_present(sid: str | None, expected: dict[str, Any]) -> None:
    handle = FakeHandle(FakeResponseStream(deltas(1)))
    asyncio.run(collect(PoolBackend(handle), request(sid)))
    assert handle.options_calls == [expected]


def test_a_consumer_that_stops_early_cancels_the_engine_request() -> None:
    handle = FakeHandle(FakeResponseStream(deltas(5)))
    got = asyncio.run(collect(PoolBackend(handle), request("s"), stop_after=2))
    assert [d.text for d in got] == ["t0", "t1"]
    assert handle.stream.cancelled == 1


@pytest.mark.parametrize("engine_error", [EngineUnavailable, EngineRequestError])
def test_a_failure_mid_stream_is_translated_and_cancels(engine_error: type[Exception]) -> None:
    handle = FakeHandle(FakeResponseStream(deltas(4), error=raised_in_replica(engine_error("lost it")), error_after=2))
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


def test_a_ray_failure_before_the_first_delta_is_unavailable() -> None:
    handle = FakeHandle(FakeResponseStream(deltas(2), error=rx.ActorDiedError(), error_after=0))
    with pytest.raises(EngineUnavailable):
        asyncio.run(collect(PoolBackend(handle), request("s")))


def test_unknown_failures_are_reraised_as_they_are() -> None:
    boom = RuntimeError("handle bug")
    handle = FakeHandle(FakeResponseStream(deltas(2), error=boom, error_after=1))
    with pytest.raises(RuntimeError) as info:
        asyncio.run(collect(PoolBackend(handle), request()))
    assert info.value is boom
