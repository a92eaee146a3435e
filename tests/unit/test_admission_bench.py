"""The admission comparison's arithmetic (baton/bench/reliability_admission.py): what one streamed
request counts as, goodput, and admitted percentiles with failures kept as misses. No cluster:
requests go to an httpx mock transport."""
from __future__ import annotations

import json
import math
import time

import httpx

from baton.bench.reliability_admission import Phase, Shot, adaptive_admission, nearest_rank, shot, with_admission
from baton.bench.reliability_load import Limits
from deployments.config import IngressConfig


def sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def client(status: int, body: bytes, headers: dict[str, str] | None = None) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(lambda _: httpx.Response(status, content=body, headers=headers or {})))


def chunk(text: str) -> dict[str, object]:
    return {"choices": [{"delta": {"content": text}}]}


def test_a_streamed_answer_gives_its_ttft_an_error_event_makes_it_a_failure() -> None:
    good = shot(client(200, sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, chunk("hi"),
                                {"choices": [{"delta": {}, "finish_reason": "length"}]}, "[DONE]")),
                "http://x", "k", time.monotonic() + 5)
    assert good.ok and good.ttft_s is not None and good.latency() == good.ttft_s
    # a stream counts only when complete (reliability_verdict.judge_stream): no finish_reason, or no [DONE], is a failure
    unfinished = shot(client(200, sse(chunk("hi"), "[DONE]")), "http://x", "k", time.monotonic() + 5)
    assert not unfinished.ok and unfinished.error == "no finish_reason" and unfinished.latency() == math.inf
    cut = shot(client(200, sse(chunk("hi"), {"choices": [{"delta": {}, "finish_reason": "length"}]})), "http://x", "k", time.monotonic() + 5)
    assert not cut.ok and cut.error == "no [DONE]"
    broken = shot(client(200, sse(chunk("hi"), {"error": {"type": "service_unavailable"}}, "[DONE]")), "http://x", "k", time.monotonic() + 5)
    assert not broken.ok and broken.error == "service_unavailable" and broken.latency() == math.inf
    refused = shot(client(429, b'{"error": {}}', {"retry-after": "1"}), "http://x", "k", time.monotonic() + 5)
    assert refused.refused and refused.retry_after == "1"


def test_goodput_counts_only_200s_on_target_and_failures_stay_in_the_percentiles() -> None:
    shots = [Shot(200, 1.0, 2.0, None), Shot(200, 3.0, 4.0, None), Shot(200, 1.5, 9.0, "cut"), Shot(503, None, 0.1, None),
             Shot(None, None, 30.0, "cut"), Shot(429, None, 0.01, None, "1"), Shot(429, None, 0.01, None, "1")]
    f = Phase("adaptive", [0.5, 0.6, 0.7, 0.8, 0.9], 2.0, 10.0, shots).figures()
    assert f["refused"] == 2 and f["admitted"] == 5 and f["ok"] == 2 and f["good"] == 1
    assert f["goodput_per_s"] == 0.1 and f["unloaded_ttft_s"] == 0.7
    assert f["admitted_ttft_p50_s"] == math.inf and f["admitted_ttft_p99_s"] == math.inf  # 3 of 5 admitted failed
    assert f["failures"] == {"cut": 2, "503": 1}
    assert nearest_rank([1.0, 2.0, 3.0, math.inf], 0.5) == 2.0 and math.isnan(nearest_rank([], 0.5))


def test_the_adaptive_phase_config_is_a_valid_ingress_config_under_the_fixed_cap() -> None:
    args = {"ingress": {"num_replicas": 2, "max_inflight_requests": 4}}
    out = with_admission(args, adaptive_admission(10.0), Limits(2, 4))
    assert "admission" not in args["ingress"] and args["ingress"]["num_replicas"] == 2  # a copy
    cfg = IngressConfig.model_validate(out["ingress"])
    assert cfg.admission.mode == "adaptive" and cfg.admission.ttft_target_s == 8.0
    assert cfg.num_replicas == 1 and cfg.max_inflight_requests == 8  # one ingress holds the whole admitted concurrency
