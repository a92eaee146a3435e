"""A stream survives its decoder (deployments/backend.py + deployments/resume.py): a decoder that dies
after some tokens reached the client is replaced by a continuation on another decoder, which
prefills the prompt plus those tokens; the client sees one stream. Fake Serve handles, no Ray."""
from __future__ import annotations

import asyncio
import json
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from ray import exceptions as rx

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.backend import PoolBackend, ReplicaLost
    from deployments.ingress import Ingress
from fakes import FakeDirectory, FakePoolHandle, FakeResponseStream, FakeTokenizer, scripted_deltas

from baton.engine.types import EngineUnavailable, GenerationDelta, GenerationRequest, OutputConstraint, SamplingSpec
from deployments.chat import PromptRenderer
from deployments.frontend import OpenAIFrontend
from deployments.inflight import InflightLimit
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app
from router.directory_state import DirectorySettings, DirectoryState
from router.policy import TurnPlan
from router.report import ReplicaReport

PROMPT = (1, 2, 3)
KV = {"remote_block_ids": [1], "remote_engine_id": "p0", "do_remote_prefill": True}


def request(max_tokens: int = 4, session_id: str | None = "s") -> GenerationRequest:
    return GenerationRequest(request_id="r1", prompt_token_ids=PROMPT, sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0),
                             session_id=session_id, user="u")


def emitted(ids: list[int], *, replica: str, prompt: int = 3, cached: int = 0) -> list[GenerationDelta]:
    """An engine's deltas: one token each, `replica` on the first, the last finished."""
    return [GenerationDelta(text=f" w{t}", token_ids=(t,), prompt_tokens=prompt, cached_tokens=cached, finished=i == len(ids) - 1,
                            finish_reason="length" if i == len(ids) - 1 else None, replica=replica if i == 0 else None)
            for i, t in enumerate(ids)]


def raised_in_replica(cause: BaseException) -> rx.RayTaskError:
    """What a Serve handle raises for an exception inside the replica."""
    return rx.RayTaskError("EngineReplica.generate", "Traceback", cause, proctitle="ray::test", pid=1, ip="127.0.0.1").as_instanceof_cause()


def dies_after(n: int, ids: list[int], replica: str) -> FakeResponseStream:
    return FakeResponseStream(emitted(ids, replica=replica), error=rx.ActorDiedError(), error_after=n)


def plans(*replicas: str, remote_prefill: bool = False) -> FakeDirectory:
    """The first decoder pinned (turn 1), then every later plan on the next one (repinned)."""
    first = TurnPlan(replicas[0], remote_prefill=False, reason="pinned", turn_index=1)
    return FakeDirectory([first] + [TurnPlan(r, remote_prefill=remote_prefill, reason="repinned", turn_index=2) for r in replicas[1:]])


def serve(backend: PoolBackend, req: GenerationRequest, stop_after: int | None = None) -> tuple[list[GenerationDelta], BaseException | None]:
    """What the client saw: the deltas, then the error that ended the stream (None: it ended well)."""
    got: list[GenerationDelta] = []

    async def run() -> None:
        gen = backend.generate(req)
        try:
            async for d in gen:
                got.append(d)
                if stop_after is not None and len(got) == stop_after:
                    break
        finally:
            await gen.aclose()  # type: ignore[attr-defined]

    try:
        asyncio.run(run())
    except Exception as e:  # noqa: BLE001 - returned for the test to check
        return got, e
    return got, None


def ids(deltas: list[GenerationDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_a_decoder_lost_mid_stream_is_continued_by_another_decoder() -> None:
    decode = FakePoolHandle([dies_after(2, [10, 11, 12, 13], "d0"), FakeResponseStream(emitted([12, 13], replica="d1", prompt=5, cached=5))])
    prefill = FakePoolHandle([FakeResponseStream(scripted_deltas(1, kv_transfer_params=KV))])
    directory, metrics = plans("d0", "d1", remote_prefill=True), RecordingMetrics()
    got, error = serve(PoolBackend(decode, prefill, directory, metrics), request())
    assert error is None
    assert ids(got) == [10, 11, 12, 13] and "".join(d.text for d in got) == " w10 w11 w12 w13"
    assert got[-1].finished and got[-1].finish_reason == "length" and not any(d.finished for d in got[:-1])
    first, cont = decode.sent
    assert first.request_id == "r1" and first.target_replica == "d0"
    assert cont.request_id == "r1-r1" and cont.target_replica == "d1"
    assert cont.prompt_token_ids == PROMPT + (10, 11) and cont.sampling == SamplingSpec(max_tokens=2, temperature=0.0)
    assert cont.kv_transfer_params is None and prefill.sent == []  # a resume is prefilled on its decoder, whatever the plan
    assert [name for name, _ in directory.calls] == ["route", "replica_failed", "route"]
    assert directory.called("replica_failed") == [("d0",)] and directory.called("route")[1] == ("s", "u", 5)
    assert decode.streams[0].cancelled == 1 and decode.streams[1].cancelled == 0
    assert metrics.resume_totals == {"resumed": 1}


def test_the_client_sees_the_original_prompt_and_one_replica_and_turn() -> None:
    decode = FakePoolHandle([dies_after(1, [10, 11, 12], "d0"), FakeResponseStream(emitted([11, 12], replica="d1", prompt=4, cached=4))])
    got, _ = serve(PoolBackend(decode, None, plans("d0", "d1")), request(max_tokens=3))
    assert [d.prompt_tokens for d in got] == [3, 3, 3]  # the delivered token is completion, not prompt
    assert max(d.cached_tokens for d in got) <= 3
    assert [d.replica for d in got] == ["d0", None, None] and [d.turn_index for d in got] == [1, None, None]


def test_a_second_death_in_the_same_request_is_not_resumed() -> None:
    decode = FakePoolHandle([dies_after(2, [10, 11, 12, 13], "d0"), dies_after(1, [12, 13], "d1"), FakeResponseStream(emitted([13], replica="d2"))])
    directory, metrics = plans("d0", "d1", "d2"), RecordingMetrics()
    got, error = serve(PoolBackend(decode, None, directory, metrics), request())
    assert type(error) is ReplicaLost
    assert ids(got) == [10, 11, 12]  # what both decoders delivered, then the error
    assert len(decode.sent) == 2 and directory.called("replica_failed") == [("d0",), ("d1",)]
    assert metrics.resume_totals == {"failed": 1}


def test_a_continuation_lost_before_its_first_token_fails_the_stream() -> None:
    lost_at_once = FakeResponseStream([], error=rx.ActorDiedError(), error_after=0)
    decode = FakePoolHandle([dies_after(1, [10, 11], "d0"), lost_at_once, FakeResponseStream(emitted([11], replica="d2"))])
    metrics = RecordingMetrics()
    got, error = serve(PoolBackend(decode, None, plans("d0", "d1", "d2"), metrics), request())
    assert type(error) is ReplicaLost and ids(got) == [10] and len(decode.sent) == 2
    assert metrics.resume_totals == {"failed": 1}


def test_a_death_before_the_first_token_is_re_placed_not_resumed() -> None:
    """The existing path: the turn is re-placed as planned (remote prefill and all); a later
    mid-stream death of that decoder may still be resumed once."""
    lost_at_once = FakeResponseStream([], error=rx.ActorDiedError(), error_after=0)
    decode = FakePoolHandle([lost_at_once, dies_after(1, [10, 11], "d1"), FakeResponseStream(emitted([11], replica="d2"))])
    prefill = FakePoolHandle([FakeResponseStream(scripted_deltas(1, kv_transfer_params=KV))])
    metrics = RecordingMetrics()
    got, error = serve(PoolBackend(decode, prefill, plans("d0", "d1", "d2", remote_prefill=True), metrics), request(max_tokens=2))
    assert error is None and ids(got) == [10, 11]
    assert [r.request_id for r in decode.sent] == ["r1", "r1", "r1-r1"]
    assert decode.sent[1].kv_transfer_params == KV and len(prefill.sent) == 1  # the re-placed turn's planned handoff only
    assert decode.sent[2].prompt_token_ids == PROMPT + (10,)
    assert metrics.resume_totals == {"resumed": 1}


def test_a_stream_the_client_left_is_cancelled_and_never_resumed() -> None:
    decode = FakePoolHandle([FakeResponseStream(emitted([10, 11, 12, 13], replica="d0")), FakeResponseStream(emitted([12], replica="d1"))])
    directory, metrics = plans("d0", "d1"), RecordingMetrics()
    got, error = serve(PoolBackend(decode, None, directory, metrics), request(), stop_after=2)
    assert error is None and ids(got) == [10, 11]
    assert len(decode.sent) == 1 and decode.stream.cancelled == 1
    assert directory.called("replica_failed") == [] and dict(metrics.resume_totals) == {}


def test_a_cancelled_request_is_not_resumed() -> None:
    decode = FakePoolHandle([FakeResponseStream(emitted([10, 11, 12], replica="d0"), error=asyncio.CancelledError(), error_after=1)])
    directory, metrics = plans("d0", "d1"), RecordingMetrics()
    with pytest.raises(asyncio.CancelledError):
        serve(PoolBackend(decode, None, directory, metrics), request())
    assert len(decode.sent) == 1 and decode.stream.cancelled == 1
    assert directory.called("replica_failed") == [] and dict(metrics.resume_totals) == {}


def test_a_client_leaving_during_the_continuation_cancels_it() -> None:
    decode = FakePoolHandle([dies_after(1, [10, 11, 12, 13], "d0"), FakeResponseStream(emitted([11, 12, 13], replica="d1"))])
    metrics = RecordingMetrics()
    got, error = serve(PoolBackend(decode, None, plans("d0", "d1"), metrics), request(), stop_after=2)
    assert error is None and ids(got) == [10, 11]
    assert decode.streams[1].cancelled == 1 and len(decode.sent) == 2
    assert metrics.resume_totals == {"resumed": 1}  # the stream was served until the client left


def test_an_engine_error_mid_stream_is_not_a_lost_decoder() -> None:
    failing = FakeResponseStream(emitted([10, 11, 12], replica="d0"), error=raised_in_replica(EngineUnavailable("engine stopped")), error_after=1)
    decode, metrics = FakePoolHandle([failing, FakeResponseStream(emitted([11], replica="d1"))]), RecordingMetrics()
    got, error = serve(PoolBackend(decode, None, plans("d0", "d1"), metrics), request())
    assert type(error) is EngineUnavailable and ids(got) == [10] and len(decode.sent) == 1
    assert dict(metrics.resume_totals) == {}


def test_a_decoder_placed_by_load_is_not_resumed() -> None:
    decode, metrics = FakePoolHandle([dies_after(1, [10, 11], "d0"), FakeResponseStream(emitted([11], replica="d1"))]), RecordingMetrics()
    got, error = serve(PoolBackend(decode, None, None, metrics), request(session_id=None))
    assert type(error) is ReplicaLost and ids(got) == [10] and len(decode.sent) == 1
    assert metrics.resume_totals == {"refused": 1}


def test_a_stream_that_delivered_all_its_tokens_finishes_with_length() -> None:
    decode = FakePoolHandle([dies_after(2, [10, 11, 12], "d0"), FakeResponseStream(emitted([12], replica="d1"))])
    metrics = RecordingMetrics()
    got, error = serve(PoolBackend(decode, None, plans("d0", "d1"), metrics), request(max_tokens=2))
    assert error is None and ids(got) == [10, 11] and len(decode.sent) == 1
    assert got[-1].finished and got[-1].finish_reason == "length" and got[-1].text == ""
    assert metrics.resume_totals == {"finished": 1}


def constrained(max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(request_id="r1", prompt_token_ids=PROMPT, session_id="s", user="u",
                             sampling=SamplingSpec(max_tokens=max_tokens, temperature=0.0, constraint=OutputConstraint(json_schema="{}")))


def test_a_constrained_stream_is_replayed_and_the_client_gets_each_token_once() -> None:
    decode = FakePoolHandle([dies_after(2, [10, 11, 12, 13], "d0"), FakeResponseStream(emitted([10, 11, 12, 13], replica="d1"))])
    metrics = RecordingMetrics()
    got, error = serve(PoolBackend(decode, None, plans("d0", "d1"), metrics), constrained())
    assert error is None and ids(got) == [10, 11, 12, 13] and "".join(d.text for d in got) == " w10 w11 w12 w13"
    replay = decode.sent[1]
    assert replay.prompt_token_ids == PROMPT and replay.sampling.constraint is not None and replay.sampling.max_tokens == 4
    assert [d.replica for d in got] == ["d0", None, None, None] and got[-1].finished
    assert metrics.resume_totals == {"resumed": 1}


def test_a_replay_that_diverges_fails_the_stream_and_never_splices() -> None:
    decode = FakePoolHandle([dies_after(2, [10, 11, 12, 13], "d0"), FakeResponseStream(emitted([10, 99, 12, 13], replica="d1"))])
    metrics = RecordingMetrics()
    got, error = serve(PoolBackend(decode, None, plans("d0", "d1"), metrics), constrained())
    assert type(error) is ReplicaLost and "diverged" in str(error)
    assert ids(got) == [10, 11]  # nothing of the diverging replay reached the client
    assert metrics.resume_totals == {"failed": 1}


def test_with_the_real_directory_the_conversation_moves_to_the_resuming_decoder() -> None:
    """Conversation policy over a DirectoryState: d0 dies mid-stream in turn 2; the continuation
    runs on d1 (prefilled there, no handoff), the pin moves to d1, and turn 3 stays on d1."""
    state = DirectoryState(DirectorySettings(policy="conversation"))
    for replica, pool in (("d0", "decode"), ("d1", "decode"), ("p0", "prefill")):
        state.report(ReplicaReport(replica, pool, kv_capacity_tokens=1000), 0.0)
    directory = FakeDirectory(state=state)
    turn = [0]

    def script(req: GenerationRequest) -> FakeResponseStream:
        if req.target_replica == "d0" and turn[0] == 2:
            return dies_after(1, [10, 11], "d0")
        return FakeResponseStream(emitted([11] if req.request_id.endswith("-r1") else [10, 11], replica=req.target_replica or "?"))

    decode, prefill = FakePoolHandle(script), FakePoolHandle(lambda _: FakeResponseStream(scripted_deltas(1, kv_transfer_params=KV)))
    backend = PoolBackend(decode, prefill, directory)
    for turn[0] in (1, 2, 3):
        got, error = serve(backend, request(max_tokens=2, session_id="conv"))
        assert error is None and ids(got) == [10, 11]
    assert [(r.target_replica, r.request_id, r.kv_transfer_params is not None) for r in decode.sent] == [
        ("d0", "r1", True), ("d0", "r1", False), ("d1", "r1-r1", False), ("d1", "r1", False)]
    pin = state.pin_of("conv")
    assert pin is not None and pin.decoder == "d1" and len(prefill.sent) == 1
    assert state.totals["replica_failures"] == 1
    state.check_integrity()


def test_over_http_the_client_reads_one_uninterrupted_stream() -> None:
    """The whole ingress path (frontend + SSE): no error event, one [DONE], usage over the original prompt."""
    tokenizer = FakeTokenizer()
    decode = FakePoolHandle(lambda req: dies_after(2, [10, 11, 12, 13], "d0") if req.target_replica == "d0"
                            else FakeResponseStream(emitted([12, 13], replica="d1", prompt=len(req.prompt_token_ids))))
    metrics = RecordingMetrics()
    frontend = OpenAIFrontend(model_id="m", renderer=PromptRenderer(tokenizer), backend=PoolBackend(decode, None, plans("d0", "d1"), metrics),
                              max_model_len=64, default_max_tokens=16, metrics=metrics)
    client = TestClient(build_openai_app(frontend, None, None))
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "tell me more"}], "max_tokens": 4, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    r = client.post("/v1/chat/completions", json=body, headers={"x-session-id": "s"})
    assert r.status_code == 200 and r.headers["x-baton-replica"] == "d0"
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c.get("choices"))
    assert text == " w10 w11 w12 w13"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]] == ["length"]
    prompt_len = len(decode.sent[0].prompt_token_ids)
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_len and chunks[-1]["usage"]["completion_tokens"] == 4
    assert decode.sent[1].prompt_token_ids == decode.sent[0].prompt_token_ids + (10, 11)
    assert metrics.requests == {("chat", 200): 1} and metrics.resume_totals == {"resumed": 1}


def test_baton_stats_shows_the_resumes_of_the_ingress_replica_that_answers() -> None:
    cls = Ingress.func_or_class
    metrics = RecordingMetrics()
    metrics.stream_resume("resumed")
    state = DirectoryState(DirectorySettings(policy="colocated"))
    ingress = SimpleNamespace(_directory=FakeDirectory(state=state), _metrics=metrics, _admission=InflightLimit(4), _realtime=None,
                              _backend=PoolBackend(None), _renderer=SimpleNamespace(prefix_snapshot=lambda: None))  # no pin cache
    ingress._stats = lambda: cls._stats(ingress)
    snap = asyncio.run(cls._public_stats(ingress))
    assert snap["ingress"]["stream_resumes"] == {"resumed": 1} and snap["policy"] == "colocated"
    assert snap["ingress"]["admission"] == {"mode": "fixed", "limit": 4, "cap": 4, "inflight": 0, "pool_queueing": False,
                                            "pool_in_flight": 0, "retry_after_s": 1, "admitted": 0, "refused": 0, "samples": 0, "overdue": 0}
    assert "realtime" not in snap["ingress"]  # no /v1/realtime at this ingress
    assert snap["ingress"]["pin_cache"] is None and snap["ingress"]["prompt_prefix_tokens"] is None
    rt = {"live_sessions": 2, "cap": 2, "overload": "shed", "sessions_shed_total": 1}  # RealtimeFrontend.snapshot()
    ingress._realtime = SimpleNamespace(snapshot=lambda: rt)
    assert asyncio.run(cls._public_stats(ingress))["ingress"]["realtime"] == rt
