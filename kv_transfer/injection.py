"""Which prompt prefix an engine loads as injected KV segments instead of computing it (InferScale).

Built by memory_store/layout.py, carried on baton.engine.types.GenerationRequest, and turned into
KV segments by memory_store/resolver.py; it lives here, below both, because it describes the
segments the KV connector injects (kv_transfer/segments.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryFact:
    """One memory fact laid into a prompt: its tokens sit at prompt positions [start, start+len(token_ids)).

    context_ids: the tokens of the w facts that precede it in its source (context-window
    encoding: the fact's KV is computed after them, and only the fact's own tokens are kept)."""

    fact_id: str
    start: int
    token_ids: tuple[int, ...]
    context_ids: tuple[int, ...] = ()
    context_fact_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class MemoryInjection:
    """Which prompt prefix is injected as KV instead of computed (InferScale).

    Prompt regions:  [0, anchor_len) anchor (system text before the memories; exact KV)
                     [anchor_len, end) the facts, back to back (position-free KV, re-rotated)
                     [end, prompt_len) computed by the engine (conversation and query)
    Invariant (check_integrity): the facts tile [anchor_len, end) without gaps."""

    user: str
    anchor_len: int
    facts: tuple[MemoryFact, ...]
    window: int
    model: str
    # the memory store's deletion log (store id, epoch) when the facts were recalled: the engine
    # replica purges its segment cache up to it before using that cache (memory_store/resolver.py)
    deletions: tuple[str, int] = ("", 0)

    @property
    def end(self) -> int:
        return self.facts[-1].start + len(self.facts[-1].token_ids) if self.facts else self.anchor_len

    def check_integrity(self, prompt_len: int) -> None:
        pos = self.anchor_len
        for f in self.facts:
            if f.start != pos or not f.token_ids:
                raise ValueError(f"memory fact {f.fact_id} at {f.start} does not continue the layout at {pos}")
            pos += len(f.token_ids)
        if not 0 < self.anchor_len <= pos < prompt_len:
            raise ValueError(f"injected prefix [0, {pos}) must start with an anchor and leave a token to compute")
