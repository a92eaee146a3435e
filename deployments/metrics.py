"""Ingress metrics. `ServeIngressMetrics` exports through Ray Serve's metrics API (Prometheus on
the Ray metrics port); `RecordingMetrics` keeps observations in memory for tests and reports.
Labels never carry prompt text or user ids: only endpoint, status and pool."""
from __future__ import annotations

from collections import defaultdict
from typing import Protocol

_LATENCY_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
_TPOT_BOUNDARIES_S = [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


def turn_label(turn_index: int | None) -> str:
    """A bounded label set: 0..4, "5+", "none" (no conversation id)."""
    if turn_index is None:
        return "none"
    return str(turn_index) if turn_index < 5 else "5+"


class IngressMetrics(Protocol):
    def request_done(self, endpoint: str, status: int) -> None: ...
    def ttft(self, endpoint: str, seconds: float, turn_index: int | None = None) -> None: ...
    def tpot(self, endpoint: str, seconds: float) -> None: ...
    def tokens(self, endpoint: str, prompt: int, cached: int, generated: int) -> None: ...


class RecordingMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.ttfts: list[float] = []
        self.ttft_turns: list[int | None] = []
        self.tpots: list[float] = []
        self.token_totals: dict[str, int] = defaultdict(int)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def ttft(self, endpoint: str, seconds: float, turn_index: int | None = None) -> None:
        self.ttfts.append(seconds)
        self.ttft_turns.append(turn_index)

    def tpot(self, endpoint: str, seconds: float) -> None:
        self.tpots.append(seconds)

    def tokens(self, endpoint: str, prompt: int, cached: int, generated: int) -> None:
        self.token_totals["prompt"] += prompt
        self.token_totals["cached"] += cached
        self.token_totals["generated"] += generated


class ServeIngressMetrics:
    def __init__(self) -> None:
        from ray.serve import metrics

        self._requests = metrics.Counter("baton_requests", "requests answered, by endpoint and HTTP status", tag_keys=("endpoint", "status"))
        self._ttft = metrics.Histogram(
            "baton_ttft_seconds", "time to first token, by the turn's index in its conversation (0..4, 5+, none)",
            boundaries=_LATENCY_BOUNDARIES_S, tag_keys=("endpoint", "turn"),
        )
        self._tpot = metrics.Histogram("baton_time_per_output_token_seconds", "mean time per output token after the first", boundaries=_TPOT_BOUNDARIES_S, tag_keys=("endpoint",))
        self._prompt = metrics.Counter("baton_prompt_tokens", "prompt tokens", tag_keys=("endpoint",))
        self._cached = metrics.Counter("baton_cached_prompt_tokens", "prompt tokens served from the prefix cache", tag_keys=("endpoint",))
        self._generated = metrics.Counter("baton_generated_tokens", "generated tokens", tag_keys=("endpoint",))

    def request_done(self, endpoint: str, status: int) -> None:
        self._requests.inc(1, tags={"endpoint": endpoint, "status": str(status)})

    def ttft(self, endpoint: str, seconds: float, turn_index: int | None = None) -> None:
        self._ttft.observe(seconds, tags={"endpoint": endpoint, "turn": turn_label(turn_index)})

    def tpot(self, endpoint: str, seconds: float) -> None:
        self._tpot.observe(seconds, tags={"endpoint": endpoint})

    def tokens(self, endpoint: str, prompt: int, cached: int, generated: int) -> None:
        tags = {"endpoint": endpoint}
        if prompt:
            self._prompt.inc(prompt, tags=tags)
        if cached:
            self._cached.inc(cached, tags=tags)
        if generated:
            self._generated.inc(generated, tags=tags)
