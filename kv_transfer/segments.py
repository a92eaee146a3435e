"""Position-free KV segments and the per-process table the segment connector reads them from.

A `KVSegment` is the KV of consecutive tokens for every attention layer of a model, with keys
stored *before* RoPE, so it can be laid down at any position (kv_transfer/rope.py rotates it
there). InferScale's memory facts, a conversation's anchor (the tokens before the memories) and
Metronome's sink and window segments are all KVSegments.

The engine runs in the replica's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one worker), so the
connector's scheduler half, its worker half and the code that submits requests share this
process. They meet in `SegmentTable`, keyed by a key the submitter puts in the request's
kv_transfer_params (not the request id, which vLLM rewrites):
- `offer(key, segments)` before submitting a request that injects them (the segments, or a
  PreparedInjection of them whose keys are already rotated and cast: kv_transfer/prepared.py);
- the connector reads them (`injection(key)`), and writes captures (`put_capture`);
- the submitter takes captures (`take_capture`) and `discard`s its key when the request ends.
Invariant: a key is present only between offer/put and take/discard; nothing outlives its request.
The table holds segments only: each connector side counts its own work
(kv_transfer/segment_stats.py).
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kv_transfer.prepared import PreparedInjection


@dataclass(frozen=True)
class KVSegment:
    """KV of `token_ids` for every attention layer: keys fp32 pre-RoPE, values in the model dtype.

    keys, values: [layers, tokens, kv_heads, head_dim]."""

    token_ids: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} must both be [L, T, H, D]")
        if self.keys.shape[1] != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but KV for {self.keys.shape[1]} tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def slice(self, start: int, end: int) -> KVSegment:
        return KVSegment(self.token_ids[start:end], self.keys[:, start:end], self.values[:, start:end])


@dataclass(frozen=True)
class Injection:
    """Segments laid end to end from position 0: they supply the KV of prompt positions [0, end).

    prepared: the same segments with their KV already rotated and cast (None: the engine thread
    rotates them at load time). Invariant: a prepared injection is of exactly these segments."""

    segments: tuple[KVSegment, ...]
    prepared: PreparedInjection | None = None
    token_ids: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        p = self.prepared
        if p is not None and (len(p.segments) != len(self.segments)
                              or any(a is not b for a, b in zip(p.segments, self.segments, strict=True))):
            raise ValueError("the prepared KV is of other segments than the injection's")
        object.__setattr__(self, "token_ids", tuple(t for s in self.segments for t in s.token_ids))

    @property
    def end(self) -> int:
        return len(self.token_ids)

    def copy_range(self, start: int, end: int, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """Copy pre-RoPE keys and values of injected positions [start, end) into [L, end-start, H, D]
        tensors (the caller's reusable buffers: no allocation per request). Every position of the
        range must be injected: a partial copy would leave stale buffer contents in the cache."""
        if not 0 <= start < end <= self.end:
            raise ValueError(f"positions [{start}, {end}) are not within the injected [0, {self.end})")
        pos = 0
        for s in self.segments:
            lo, hi = max(start, pos), min(end, pos + s.num_tokens)
            if lo < hi:
                keys_out[:, lo - start : hi - start] = s.keys[:, lo - pos : hi - pos]
                values_out[:, lo - start : hi - start] = s.values[:, lo - pos : hi - pos]
            pos += s.num_tokens


@dataclass(frozen=True)
class CaptureResult:
    """What a capture request produced: one segment per requested range, or why it failed."""

    segments: tuple[KVSegment, ...] = ()
    error: str | None = None


class SegmentTable:
    """Per-process hand-over point between request submitters and the segment connector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._injections: dict[str, Injection] = {}
        self._captures: dict[str, CaptureResult] = {}

    def offer(self, key: str, segments: Sequence[KVSegment] | PreparedInjection) -> Injection:
        """Offer the KV a request injects: its segments, or a PreparedInjection of them."""
        if isinstance(segments, Sequence):
            inj = Injection(tuple(segments))
        else:
            inj = Injection(segments.segments, prepared=segments)
        with self._lock:
            self._injections[key] = inj
        return inj

    def injection(self, key: str) -> Injection | None:
        with self._lock:
            return self._injections.get(key)

    def put_capture(self, key: str, result: CaptureResult) -> None:
        with self._lock:
            self._captures[key] = result

    def take_capture(self, key: str) -> CaptureResult | None:
        with self._lock:
            return self._captures.pop(key, None)

    def discard(self, key: str) -> None:
        with self._lock:
            self._injections.pop(key, None)
            self._captures.pop(key, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._injections) + len(self._captures)


_TABLE = SegmentTable()


def process_segments() -> SegmentTable:
    """This process's table (one engine per process; see the module docstring)."""
    return _TABLE
