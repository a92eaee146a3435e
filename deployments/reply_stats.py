"""What the frontend accumulates while one reply streams: usage, latency samples and text
(deployments/frontend.py); and the helper that puts a reply's first delta back in front."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from baton.engine.types import GenerationDelta, StageTimes
from deployments.inflight import Ticket
from deployments.metrics import IngressMetrics


async def chain(first: list[GenerationDelta], rest: AsyncIterator[GenerationDelta]) -> AsyncIterator[GenerationDelta]:
    for d in first:
        yield d
    async for d in rest:
        yield d


class Accumulator:
    """Usage and latency of one request, built from its deltas; the first token is reported to
    the request's admission ticket (its TTFT sample, deployments/inflight.py)."""

    def __init__(self, metrics: IngressMetrics, endpoint: str, t0: float, ticket: Ticket | None = None):
        self._metrics, self._endpoint, self._t0 = metrics, endpoint, t0
        self._ticket = ticket
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.texts: list[str] = []
        self.replica: str | None = None
        self.timing: StageTimes | None = None  # the first delta's
        self._turn: int | None = None
        self._t_first: float | None = None

    def add(self, d: GenerationDelta) -> None:
        self.replica = self.replica or d.replica
        self.timing = self.timing or d.timing
        if d.turn_index is not None:
            self._turn = d.turn_index
        if d.token_ids and self._t_first is None:
            self._t_first = time.monotonic()
            self._metrics.ttft(self._endpoint, self._t_first - self._t0, self._turn)
            if self._ticket is not None:
                self._ticket.first_token()
        self.prompt_tokens = max(self.prompt_tokens, d.prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, d.cached_tokens)
        self.completion_tokens += len(d.token_ids)
        self.texts.append(d.text)
        if d.finished:
            self.finish_reason = d.finish_reason

    def finish(self) -> None:
        if self._t_first is not None and self.completion_tokens > 1:
            self._metrics.tpot(self._endpoint, (time.monotonic() - self._t_first) / (self.completion_tokens - 1))
        self._metrics.tokens(self._endpoint, self.prompt_tokens, self.cached_tokens, self.completion_tokens)
