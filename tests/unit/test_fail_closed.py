"""PoolBackend fails closed (deployments/backend.py `_place`): the directory is also the owner
check, so a turn with a session id is refused with EngineUnavailable (503 + Retry-After at the
ingress) when the directory fails or hangs, before any engine work; a turn without one is placed
by load (test_backend_errors.py); a directory that checked the owner but had no live decoder
(NoReplicaAvailable) lets the turn be placed by load."""
from __future__ import annotations

import asyncio
import warnings

import pytest
from fakes import FakeDirectory, FakePoolHandle, FakeResponseStream, scripted_deltas
from ray import exceptions as rx

from baton.engine.types import EngineUnavailable, GenerationDelta, GenerationRequest, SamplingSpec
from router.policy import NoReplicaAvailable

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments import backend as backend_module
    from deployments.backend import PoolBackend


def request(session_id: str | None) -> GenerationRequest:
    return GenerationRequest(request_id="r1", prompt_token_ids=(1, 2, 3), sampling=SamplingSpec(max_tokens=4), session_id=session_id, user="ana")


def pools() -> tuple[FakePoolHandle, FakePoolHandle]:
    decode = FakePoolHandle(lambda req: FakeResponseStream(scripted_deltas(2, replica="d0")))
    prefill = FakePoolHandle(lambda req: FakeResponseStream(scripted_deltas(1, kv_transfer_params={"k": 1})))
    return decode, prefill


async def collect(backend: PoolBackend, req: GenerationRequest) -> list[GenerationDelta]:
    return [d async for d in backend.generate(req)]


def in_replica(cause: BaseException) -> rx.RayTaskError:
    return rx.RayTaskError("ConversationDirectory.route", "Traceback", cause, proctitle="p", pid=1, ip="127.0.0.1").as_instanceof_cause()


@pytest.mark.parametrize(
    "error", [RuntimeError("directory down"), rx.ActorDiedError(), in_replica(ValueError("bug"))], ids=["runtime", "died", "in-replica"]
)
def test_a_failed_directory_refuses_a_turn_of_a_conversation_before_any_engine_work(error: BaseException) -> None:
    decode, prefill = pools()
    with pytest.raises(EngineUnavailable, match="owner cannot be checked") as info:
        asyncio.run(collect(PoolBackend(decode, prefill, FakeDirectory(errors={"route": error})), request("conv")))
    assert type(info.value) is EngineUnavailable and info.value.__cause__ is None  # no trace of the directory's failure
    assert decode.sent == [] and prefill.sent == []


def test_a_hung_directory_refuses_a_turn_of_a_conversation_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_module, "DIRECTORY_TIMEOUT_S", 0.05)
    decode, prefill = pools()
    backend = PoolBackend(decode, prefill, FakeDirectory(hang=["route"]))
    with pytest.raises(EngineUnavailable, match="directory is unreachable"):
        asyncio.run(asyncio.wait_for(collect(backend, request("conv")), timeout=0.5))
    assert decode.sent == [] and prefill.sent == []


@pytest.mark.parametrize("error", [NoReplicaAvailable("no live decode replica"), in_replica(NoReplicaAvailable("none"))],
                         ids=["local", "in-replica"])
def test_a_directory_without_live_decoders_has_checked_the_owner_so_the_turn_is_placed_by_load(error: BaseException) -> None:
    decode, prefill = pools()
    got = asyncio.run(collect(PoolBackend(decode, prefill, FakeDirectory(errors={"route": error})), request("conv")))
    assert len(got) == 2 and decode.sent[0].target_replica is None and prefill.sent == []


def test_a_conversation_waiting_for_its_pin_after_a_directory_restart_is_a_503() -> None:
    from router.directory_state import PinsRebuilding

    decode, prefill = pools()
    backend = PoolBackend(decode, prefill, FakeDirectory(errors={"route": in_replica(PinsRebuilding("conv"))}))
    with pytest.raises(EngineUnavailable, match="restoring this conversation's decoder"):
        asyncio.run(collect(backend, request("conv")))
    assert decode.sent == [] and prefill.sent == []
