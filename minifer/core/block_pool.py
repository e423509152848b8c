"""The block pool: every physical KV block, its reference count, the free ones, and the prefix cache's index.

The pool knows blocks, not sequences: which blocks are in use (``ref_count``), which are free, and which free ones
still hold a cached prefix (findable by hash until evicted). ``KVCacheManager`` (``kv_cache_manager.py``) builds
sequences' block tables on top of it, as vLLM's ``KVCacheManager`` does over its ``BlockPool``.

A block whose reference count drops to 0 goes one of two ways. If it holds a cached full block (its hash is set)
it is parked in an LRU list, still findable, and evicted only when no truly free block is left; otherwise it
returns to the free heap. A cache hit is verified against the stored tokens, so a hash collision never serves
wrong KV.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # what a cached block holds, to verify hits


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full block given the hash of the block before it (``None`` for the first block)."""
    return hash((parent, tokens))


class BlockPool:
    """``num_blocks`` blocks: reference counts, the free heap, the evictable LRU and the hash -> block index."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref 0, holding nothing worth keeping: a min-heap, so the lowest-numbered free block goes out first (see
        # _pop_free); range(n) is already one
        self._free: list[int] = list(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but cached, least recent first
        self._cache: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (truly free, plus cached ones that may be evicted)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cache)

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block with this hash, if it holds exactly ``token_ids`` (a verified hit), else None."""
        bid = self._cache.get(block_hash)
        if bid is None or self.blocks[bid].token_ids != token_ids:
            return None
        return bid

    def cache_full_block(self, bid: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Index a full block by its hash, unless it or an identical block is indexed already."""
        block = self.blocks[bid]
        if block.block_hash is None and block_hash not in self._cache:
            block.block_hash, block.token_ids = block_hash, token_ids
            self._cache[block_hash] = bid

    def uncache(self, bid: int) -> None:
        """Drop a block from the index: it will be written again and no longer holds what its hash promises."""
        block = self.blocks[bid]
        if block.block_hash is not None:
            del self._cache[block.block_hash]
            block.block_hash, block.token_ids = None, ()

    def touch(self, bid: int) -> None:
        """One more table holds the block (a cache hit takes it back from the evictable list)."""
        block = self.blocks[bid]
        if block.ref_count == 0:
            self._evictable.pop(bid, None)
        block.ref_count += 1

    def free_block(self, bid: int) -> None:
        """One table fewer holds the block; at 0 it is parked (cached) or freed."""
        block = self.blocks[bid]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {bid} freed twice")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable[bid] = None  # most recently used at the end
            else:
                self._push_free(bid)

    def get_new_block(self) -> int:
        """A free block (``_pop_free``), else the least recently used cached one, evicted; its count set to 1."""
        if self._free:
            bid = self._pop_free()
        elif self._evictable:
            bid, _ = self._evictable.popitem(last=False)  # evict the least recently used cached block
            self.uncache(bid)
        else:
            raise MemoryError("no free KV blocks")
        self.blocks[bid].ref_count = 1
        return bid

    def _push_free(self, bid: int) -> None:
        heapq.heappush(self._free, bid)

    def _pop_free(self) -> int:
        """The lowest-numbered free block, not the longest free (a FIFO): blocks come back in an order that depends on
        history (rollbacks, the order sequences finish), and a FIFO would hand it on, scattering a batch's KV over
        the pool, which slows the CPU's token-by-token key gather (``python -m minifer_course.block_order``).
        Lowest-first keeps the blocks in use packed at the start of the pool. Cached blocks are not in this heap:
        they go out least recently used first, once no free block is left (``get_new_block``)."""
        return heapq.heappop(self._free)

    def check_invariants(self, refs: list[int]) -> None:
        """Every block is in exactly one state and its reference count is ``refs[block]`` (used by tests)."""
        for b in self.blocks:
            assert b.ref_count == refs[b.block_id], f"block {b.block_id}: ref {b.ref_count} != {refs[b.block_id]}"
            in_free, in_evict = b.block_id in self._free, b.block_id in self._evictable
            if b.ref_count:
                assert not in_free and not in_evict, f"block {b.block_id} in use but listed free"
            else:
                assert in_free != in_evict, f"block {b.block_id} unused but not in exactly one free list"
            if b.block_hash is not None:
                assert self._cache.get(b.block_hash) == b.block_id, f"block {b.block_id} hash not indexed"
        assert len(self._free) == len(set(self._free)), "a block is listed free twice"
