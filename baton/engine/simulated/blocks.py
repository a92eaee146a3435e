"""The simulated engine's KV block pool: vLLM v1's BlockPool for one full-attention cache group.

Blocks hold `block_size` tokens. Block 0 is the null block (vLLM keeps it out of the pool), so
`num_gpu_blocks - 1` blocks are usable and usage = 1 - free / (num_gpu_blocks - 1), as vLLM reports.
A full block is cached under its chained hash (`block_hashes`): the hash of the previous block's
hash and this block's tokens, with the cache salt mixed into the first, so a hit on block i means
blocks 0..i all match. Free blocks sit in one queue, evicted from the front:

    front [ freed uncached blocks (newest first) | ... | freed cached blocks (oldest first) ] back

so uncached blocks are reused first (LIFO) and cached ones in LRU order; a cached free block stays
findable until it is handed out again, when its hash is dropped (evicted).

Invariants (check_integrity):
- every usable block is either free (ref_cnt 0, in the queue exactly once) or in use (ref_cnt > 0,
  not in the queue); the null block is in neither;
- every hash in the map names blocks that carry that hash, and every block with a hash is in the map.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = int


def chain_hash(parent: BlockHash | None, tokens: tuple[int, ...], salt: str | None) -> BlockHash:
    """A block's hash from its parent's and its tokens (salt: first block only). Python's tuple
    hash: stable within a process, which is all one engine's cache needs."""
    return hash((parent, tokens, salt))


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[BlockHash]:
    """Chained hashes of every full block of `tokens`."""
    out: list[BlockHash] = []
    prev = None
    for i in range(len(tokens) // block_size):
        prev = chain_hash(prev, tuple(tokens[i * block_size:(i + 1) * block_size]), salt if i == 0 else None)
        out.append(prev)
    return out


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every block, their reference counts, the free queue and the hash → blocks map."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True):
        if num_gpu_blocks < 2:
            raise ValueError("a block pool needs the null block and at least one usable block")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_gpu_blocks)]
        self.null_block = self.blocks[0]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        # hash -> blocks holding it (two requests may compute the same block at once), first = the hit
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, Block]] = {}

    # ---- questions --------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def get_usage(self) -> float:
        return 1.0 - len(self._free) / (self.num_gpu_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        held = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(held.values())) if held else None

    # ---- actions ----------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[Block]:
        """n blocks from the front of the free queue, each evicted from the cache, ref_cnt 1."""
        if n > len(self._free):
            raise ValueError(f"cannot get {n} free blocks from the pool ({len(self._free)} free)")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """A prefix hit takes a reference; a free cached block leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Drop one reference each; `ordered` is eviction order (first = evicted first)."""
        evict_first: list[Block] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    evict_first.append(block)
                else:
                    self._free[block.block_id] = block  # back of the queue: LRU
        for block in reversed(evict_first):  # front of the queue, keeping their order
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)

    def cache_full_blocks(self, blocks: Sequence[Block], hashes: Sequence[BlockHash], num_cached: int, num_full: int) -> None:
        """Cache blocks[num_cached:num_full] under hashes[num_cached:num_full]."""
        if not self.enable_caching:
            return
        for i in range(num_cached, num_full):
            block = blocks[i]
            block.block_hash = hashes[i]
            self.cached_block_hash_to_block.setdefault(hashes[i], {})[block.block_id] = block

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        held = self.cached_block_hash_to_block[block.block_hash]
        del held[block.block_id]
        if not held:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def check_integrity(self) -> None:
        """Raise AssertionError if an invariant in the module docstring does not hold."""
        assert self.null_block.block_id not in self._free, "the null block is in the free queue"
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"block {block.block_id}: negative ref_cnt {block.ref_cnt}"
            free = block.block_id in self._free
            assert free == (block.ref_cnt == 0), f"block {block.block_id}: ref_cnt {block.ref_cnt} but free={free}"
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash, {}).get(block.block_id) is block, \
                    f"block {block.block_id} has a hash the map does not list"
        for h, held in self.cached_block_hash_to_block.items():
            assert held, f"hash {h} maps to no block"
            for bid, block in held.items():
                assert block.block_id == bid and block.block_hash == h, f"hash {h} lists block {bid} holding {block.block_hash}"
