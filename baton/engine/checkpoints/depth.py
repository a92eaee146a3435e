"""Prefix-match depth of a prompt against the prompts seen before (block granularity).

A prompt is given as its chain of per-block keys (key k identifies tokens [0, (k+1)·B), as vLLM's
chained block hashes do). depth = B · (number of leading keys seen before), capped at the replay
boundary ⌊(L−1)/B⌋·B because the last prompt token is always recomputed. This is the depth a
request *could* resume from if every state were kept — the histogram's input, independent of the
strategy in force. Bounded memory: the least recently seen keys are forgotten past `capacity`.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class PrefixDepthTracker:
    def __init__(self, block_size: int, capacity: int = 1 << 16) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._seen: OrderedDict[Hashable, None] = OrderedDict()

    def match_and_add(self, block_keys: Sequence[Hashable], prompt_len: int) -> int:
        """Match depth of this prompt (tokens), then remember its blocks."""
        cap = max(prompt_len - 1, 0) // self.block_size
        depth_blocks = 0
        for key in block_keys[:cap]:
            if key not in self._seen:
                break
            depth_blocks += 1
        for key in block_keys:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return depth_blocks * self.block_size

    def check_integrity(self) -> None:
        if len(self._seen) > self.capacity:
            raise AssertionError("depth tracker over capacity")
