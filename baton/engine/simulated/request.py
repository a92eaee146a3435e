"""One request inside the simulated engine: its tokens, progress, and block hashes.

Invariants: 0 <= num_computed_tokens <= num_tokens; `block_hashes` holds the chained hash of every
full block of prompt + output tokens (extended as tokens are appended); num_cached_tokens is -1
until the request is first scheduled, then its prefix hit (local + transferred) at that moment.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from baton.engine.simulated.blocks import BlockHash, block_hashes, chain_hash


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its prompt KV is crossing the link
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    block_size: int
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    want_logprobs: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: Status = Status.WAITING
    kv_ready_at: float = 0.0  # WAITING_FOR_REMOTE_KVS: when the transfer completes (time.monotonic)
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_hashes = block_hashes(self.prompt_token_ids, self.block_size, self.cache_salt)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefill_producer(self) -> bool:
        """A prefill engine's request whose KV a decode engine will pull (P/D handoff)."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_decode"))

    @property
    def is_remote_prefilled(self) -> bool:
        """A decode engine's request whose prompt KV comes from a prefill engine."""
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_prefill"))

    def token(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        done = len(self.block_hashes)
        if self.num_tokens // self.block_size > done:  # one more block is full
            start = done * self.block_size
            chunk = tuple(self.token(i) for i in range(start, start + self.block_size))
            parent = self.block_hashes[-1] if done else None
            self.block_hashes.append(chain_hash(parent, chunk, self.cache_salt if done == 0 else None))
