"""An engine-free stand-in for vLLM's LLMEngine as EngineRunner drives it (tests/unit/test_runner.py).

FakeEngine: add_request, abort_request, step, has_unfinished_requests, shutdown. Each step gives
every active request one token; the last is `finished`. It can pause (steps produce nothing, so
requests stay open), block inside a step (`unstuck` cleared), crash in step, reject add_request,
and, as the segment connector does, put a capture under a request's segment key when a
capturing request finishes (`capture_mode`: ok | error | none).
RecordingTable: the real SegmentTable, logging every offer / take_capture / discard into a log
shared with the engine's add / abort / shutdown, so tests can check the order of the two.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.segment_connector import PARAMS_KEY  # imports vLLM once, before any engine thread needs it
from kv_transfer.segments import CaptureResult, KVSegment, SegmentTable


def seg(ids: tuple[int, ...]) -> KVSegment:
    k = torch.zeros(1, len(ids), 1, 2)
    return KVSegment(tuple(ids), k, k.clone())


@dataclass
class Comp:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: Any = None


@dataclass
class Out:
    request_id: str
    outputs: list[Comp]
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool


class RecordingTable(SegmentTable):
    def __init__(self, log: list[tuple[str, str]]):
        super().__init__()
        self.log = log

    def offer(self, key: str, segments: Any) -> Any:  # segments, or a PreparedInjection of them
        self.log.append(("offer", key))
        return super().offer(key, segments)

    def take_capture(self, key: str) -> CaptureResult | None:
        self.log.append(("take_capture", key))
        return super().take_capture(key)

    def discard(self, key: str) -> None:
        self.log.append(("discard", key))
        super().discard(key)

    def count(self, op: str, key: str) -> int:
        return self.log.count((op, key))


class FakeEngine:
    def __init__(self, tokens: int = 3, log: list[tuple[str, str]] | None = None):
        self.tokens = tokens
        self.log = log if log is not None else []
        self.table: SegmentTable | None = None  # where captures go (the connector's table)
        self.capture_mode = "ok"  # ok | error | none
        self.paused = threading.Event()
        self.unstuck = threading.Event()  # cleared: a step blocks until it is set again
        self.unstuck.set()
        self.stepping = threading.Event()
        self.crash: BaseException | None = None
        self.reject: BaseException | None = None
        self.added: dict[str, tuple[dict[str, Any], Any]] = {}
        self.shut_down = threading.Event()
        self._active: dict[str, int] = {}

    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any) -> None:
        if self.reject is not None:
            raise self.reject
        self.log.append(("add", request_id))
        self.added[request_id] = (prompt, params)
        self._active[request_id] = 0

    def abort_request(self, ids: list[str]) -> None:
        for rid in ids:
            self.log.append(("abort", rid))
            self._active.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._active)

    def step(self) -> list[Out]:
        if self.crash is not None:
            raise self.crash
        self.stepping.set()
        self.unstuck.wait(60)
        time.sleep(0.001)
        if self.paused.is_set():
            return []
        outs = []
        for rid, n in list(self._active.items()):
            n += 1
            done = n >= self.tokens
            if done:
                del self._active[rid]
                self._capture(rid)
            else:
                self._active[rid] = n
            prompt = self.added[rid][0]["prompt_token_ids"]
            outs.append(Out(rid, [Comp(f" t{n}", (100 + n,), "length" if done else None)], prompt, 0, done))
        return outs

    def shutdown(self) -> None:
        self.log.append(("shutdown", ""))
        self.shut_down.set()

    def _capture(self, rid: str) -> None:
        prompt, params = self.added[rid]
        seg_params = ((params.extra_args or {}).get("kv_transfer_params") or {}).get(PARAMS_KEY)
        if not seg_params or "capture" not in seg_params or self.capture_mode == "none":
            return
        assert self.table is not None
        ids = prompt["prompt_token_ids"]
        result = (CaptureResult(segments=tuple(seg(tuple(ids[a:b])) for a, b in seg_params["capture"]))
                  if self.capture_mode == "ok" else CaptureResult(error="no free staging buffer"))
        self.table.put_capture(seg_params["key"], result)
