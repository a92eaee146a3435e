"""Where time to first token goes (deployments/hop_timing.py): each layer stamps its stages on a
request's first delta, and the ingress answers them as a Server-Timing header. Fake handles and a
fake tokenizer; the engine thread's stamps come from EngineRunner with a fake engine."""
from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

from fakes import FakeDirectory, FakePoolHandle, FakeResponseStream, FakeTokenizer, scripted_deltas
from fastapi.testclient import TestClient

from baton.engine.types import GenerationDelta, StageTimes
from deployments.chat import PromptRenderer
from deployments.frontend import OpenAIFrontend
from deployments.hop_timing import HOPS, hop_durations, parse_server_timing, server_timing
from deployments.metrics import RecordingMetrics
from deployments.openai_api import build_openai_app
from router.policy import TurnPlan

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from deployments.backend import PoolBackend

FULL = StageTimes(received=100.0, prepared=100.002, placed=100.005, prefilled=100.105, replica_received=100.107, engine_added=100.108,
                  engine_first=100.208, ingress_first=100.210)


def test_every_hop_from_its_two_stamps() -> None:
    d = hop_durations(FULL)
    assert list(d) == list(HOPS)
    expected = {"parse": 0.002, "route": 0.003, "prefill": 0.1, "to_replica": 0.002, "replica": 0.001, "engine": 0.1,
                "from_replica": 0.002, "total": 0.21}
    assert all(abs(d[k] - v) < 1e-9 for k, v in expected.items()), d


def test_without_a_remote_prefill_the_replica_hop_starts_at_placement() -> None:
    d = hop_durations(replace(FULL, prefilled=None))
    assert "prefill" not in d and abs(d["to_replica"] - 0.102) < 1e-9


def test_a_hop_with_an_unknown_end_is_left_out_not_zero() -> None:
    assert hop_durations(StageTimes(engine_added=1.0, engine_first=1.5)) == {"engine": 0.5}
    assert hop_durations(StageTimes()) == {}


def test_the_header_round_trips() -> None:
    header = server_timing(FULL)
    assert header.startswith("parse;dur=2.00, route;dur=3.00, prefill;dur=100.00")
    back = parse_server_timing(header)
    assert set(back) == set(HOPS) and abs(back["total"] - 0.21) < 1e-6
    assert parse_server_timing("cache;desc=hit, db;dur=53, bad;dur=x") == {"db": 0.053}


def _engine_deltas(n: int) -> list[GenerationDelta]:
    """What a decode replica sends: its stamps on the first delta only."""
    out = scripted_deltas(n)
    first = replace(out[0], replica="d0", timing=StageTimes(replica_received=1.0, engine_added=1.001, engine_first=1.051))
    return [first, *out[1:]]


def _client(decode: FakePoolHandle) -> TestClient:
    directory = FakeDirectory([TurnPlan("d0", remote_prefill=False, reason="pinned", turn_index=1)])
    frontend = OpenAIFrontend(model_id="m", renderer=PromptRenderer(FakeTokenizer()), backend=PoolBackend(decode, None, directory),
                              max_model_len=64, default_max_tokens=8, metrics=RecordingMetrics())
    return TestClient(build_openai_app(frontend, None, None))


def _hops(r: Any) -> dict[str, float]:
    assert r.status_code == 200, r.text
    return parse_server_timing(r.headers["server-timing"])


def test_the_ingress_answers_every_hop_it_saw_streamed_or_not() -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for stream in (False, True):
        client = _client(FakePoolHandle([FakeResponseStream(_engine_deltas(3))]))
        hops = _hops(client.post("/v1/chat/completions", json={**body, "stream": stream}, headers={"x-session-id": "s"}))
        assert set(hops) == {"parse", "route", "to_replica", "replica", "engine", "from_replica", "total"}, hops
        assert abs(hops["engine"] - 0.05) < 1e-6 and abs(hops["replica"] - 0.001) < 1e-6  # the replica's own stamps
        assert all(v >= 0 for k, v in hops.items() if k in ("parse", "route", "total"))  # the ingress's, one clock


def test_a_replica_that_stamps_nothing_still_gets_the_ingress_hops() -> None:
    client = _client(FakePoolHandle([FakeResponseStream(scripted_deltas(2))]))
    hops = _hops(client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, headers={"x-session-id": "s"}))
    assert set(hops) == {"parse", "route", "total"}, hops
