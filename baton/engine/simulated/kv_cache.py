"""Per-request block tables over the BlockPool: vLLM v1's KVCacheManager for one full-attention group.

A request's blocks cover its tokens in order (block i holds tokens [i·B, (i+1)·B)). "No room" is a
return value: `allocate_slots` returns None and changes nothing. Layout of one allocation
(vLLM's, kv_cache_manager.py):

    | computed | new prefix hit | external (handoff) | new tokens |
                                |<------- allocated here ------->|

Invariants: a request's full blocks up to `num_cached_block[rid]` are in the pool's hash map;
`free` returns every block the request holds, tail first (so its tail is evicted first).
"""
from __future__ import annotations

from typing import Protocol

from baton.engine.simulated.blocks import Block, BlockHash, BlockPool


class KVRequest(Protocol):
    """What the manager reads of a request."""

    request_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]

    @property
    def num_tokens(self) -> int: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns which blocks each request holds; the pool owns the blocks themselves."""

    def __init__(self, pool: BlockPool, max_model_len: int):
        self.block_pool = pool
        self.block_size = pool.block_size
        self.max_model_len = max_model_len
        self.req_to_blocks: dict[str, list[Block]] = {}
        self.num_cached_block: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, req: KVRequest) -> tuple[list[Block], int]:
        """The longest cached prefix of `req` in whole blocks, and its tokens. At most
        num_tokens - 1 tokens hit: the last prompt token is always computed, for its logits."""
        if not self.block_pool.enable_caching:
            return [], 0
        hits: list[Block] = []
        for h in req.block_hashes[:(req.num_tokens - 1) // self.block_size]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: KVRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[Block] | None = None, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, full_sequence_must_fit: bool = False) -> list[Block] | None:
        """Give `req` slots for its prefix hit, its external tokens and `num_new_tokens` more.
        Returns the newly allocated blocks, or None (nothing changed) when they do not fit.
        full_sequence_must_fit: admit only if the whole current sequence fits (vLLM's
        scheduler_reserve_full_isl, on by default, for waiting requests)."""
        hit = new_computed_blocks or []
        num_local = req.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local + num_external_computed_tokens, self.max_model_len)
        free = self.block_pool.get_num_free_blocks()
        if full_sequence_must_fit:
            if self._blocks_to_allocate(req.request_id, min(req.num_tokens, self.max_model_len), hit) > free:
                return None
        need_slots = min(total_computed + num_new_tokens, self.max_model_len)
        if self._blocks_to_allocate(req.request_id, need_slots, hit) > free:
            return None
        blocks = self.req_to_blocks.setdefault(req.request_id, [])
        if hit or num_external_computed_tokens > 0:
            self.block_pool.touch(hit)
            blocks.extend(hit)
            self.num_cached_block[req.request_id] = len(blocks)
            if num_external_computed_tokens > 0:
                blocks.extend(self.block_pool.get_new_blocks(max(0, cdiv(total_computed, self.block_size) - len(blocks))))
        new = self.block_pool.get_new_blocks(max(0, cdiv(need_slots, self.block_size) - len(blocks)))
        blocks.extend(new)
        if not delay_cache_blocks:
            self.cache_blocks(req, min(total_computed + num_new_tokens, req.num_tokens))
        return new

    def cache_blocks(self, req: KVRequest, num_tokens: int) -> None:
        """Put `req`'s full blocks among its first `num_tokens` tokens into the prefix cache."""
        done = self.num_cached_block.get(req.request_id, 0)
        full = num_tokens // self.block_size
        if done >= full:
            return
        self.block_pool.cache_full_blocks(self.req_to_blocks[req.request_id], req.block_hashes, done, full)
        self.num_cached_block[req.request_id] = full

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def take_blocks(self, request_id: str) -> list[Block]:
        """Hand over the request's blocks without freeing them (a handoff holds them for its reader)."""
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def num_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ()))

    def _blocks_to_allocate(self, request_id: str, num_tokens: int, hit: list[Block]) -> int:
        required = cdiv(num_tokens, self.block_size)
        held = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:  # running: no new prefix hits
            return max(required - held, 0)
        evictable = sum(1 for b in hit if b.ref_cnt == 0)  # touching a free cached block takes it from the free queue
        return max(required - len(hit) - held, 0) + evictable
