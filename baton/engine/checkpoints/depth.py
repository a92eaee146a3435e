"""Prefix-match depth of a prompt against the prompts seen before (block granularity).

A prompt is given as its chain of per-block keys (key k identifies tokens [0, (k+1)·B), as vLLM's
chained block hashes do). depth = B · (number of leading keys seen before), capped at the replay
boundary ⌊(L−1)/B⌋·B because the last prompt token is always recomputed. This is the depth a
request *could* resume from if every state were kept — the histogram's input, independent of the
strategy in force. Bounded memory: the least recently seen keys are forgotten past `capacity`.

It also remembers each prompt's tail — the key of its replay boundary — and reports the deepest
earlier tail on a new prompt's matched chain: a conversation's next turn reaches the previous
turn's tail, a sibling question reaches the tail of the document it shares (the policy's
continuation estimate, policy.py).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixMatch:
    depth: int  # tokens matched (block multiple, ≤ the replay boundary)
    reached_tail: int | None  # deepest earlier prompt's replay boundary on the matched chain, if any


class PrefixDepthTracker:
    def __init__(self, block_size: int, capacity: int = 1 << 16) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._tails: OrderedDict[Hashable, None] = OrderedDict()

    def match_and_add(self, block_keys: Sequence[Hashable], prompt_len: int) -> int:
        """Match depth of this prompt (tokens), then remember its blocks."""
        return self.observe(block_keys, prompt_len).depth

    def observe(self, block_keys: Sequence[Hashable], prompt_len: int) -> PrefixMatch:
        """Match depth and reached tail of this prompt, then remember its blocks and its tail."""
        cap = max(prompt_len - 1, 0) // self.block_size
        depth_blocks = 0
        for key in block_keys[:cap]:
            if key not in self._seen:
                break
            depth_blocks += 1
        reached = next(((k + 1) * self.block_size for k in range(depth_blocks - 1, -1, -1) if block_keys[k] in self._tails), None)
        for key in block_keys:
            self._seen[key] = None
            self._seen.move_to_end(key)
        if 0 < cap <= len(block_keys):
            self._tails[block_keys[cap - 1]] = None
            self._tails.move_to_end(block_keys[cap - 1])
        for d in (self._seen, self._tails):
            while len(d) > self.capacity:
                d.popitem(last=False)
        return PrefixMatch(depth_blocks * self.block_size, reached)

    def check_integrity(self) -> None:
        if len(self._seen) > self.capacity or len(self._tails) > self.capacity:
            raise AssertionError("depth tracker over capacity")
