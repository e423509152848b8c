"""The paged KV cache's bookkeeping: fixed-size blocks, block tables, reference counts, prefix caching.

A contiguous KV cache reserves ``max_len`` slots for every sequence up front; most of them are never
used (chapter 02 measures how many). vLLM's PagedAttention instead cuts the cache into blocks of
``block_size`` token slots and gives each sequence a *block table*: logical block ``i`` of the sequence
lives in physical block ``table[i]``, anywhere in the pool. A sequence takes a new block only when its
last one is full, so at most ``block_size - 1`` slots per sequence are ever empty.

Prefix caching rides on the same tables. A *full* block is identified by a chained hash of its tokens and
of everything before it, so two requests with the same first 256 tokens map those tokens to the same
physical blocks. Shared blocks carry a reference count; when it drops to zero a cached block is not
wiped but parked in an LRU list, still findable by its hash, and only evicted when a free block is
needed. Every hit is verified against the stored tokens, so a hash collision can never serve wrong KV.

The blocks themselves (reference counts, the free heap, the evictable LRU, the hash index) are the
``BlockPool``'s (``block_pool.py``); this module keeps each sequence's table and the prefix lookups. Both only do
bookkeeping on integers; the engine's runner owns the tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from minifer.core.block_pool import BlockPool, chain_hash


class KVBlockAllocator(Protocol):
    """The seam between the engine and whatever hands out KV-cache blocks (chapter 02); ``KVCacheManager`` below is
    the reference, with prefix caching and copy-on-write. The engine builds one per cache (``LLMEngine``'s
    ``block_allocator``: a callable ``(num_blocks, block_size, enable_prefix_caching)``, ``KVCacheManager`` itself
    by default).

    A sequence (any hashable id) owns a *block table*, its block ids in order: token ``t`` lives in block
    ``block_table(seq)[t // block_size]`` at offset ``t % block_size``, a block in ``range(num_blocks)``.
    ``allocate(seq, token_ids)`` creates the table for a new sequence's tokens and returns how many leading tokens
    the prefix cache already holds (a multiple of ``block_size``, less than ``len(token_ids)``; 0 without caching);
    ``can_allocate`` says whether the free blocks allow it. ``append_slots(seq, n)`` grows the table to hold ``n``
    tokens in all (``can_append`` first says whether it can), ``truncate(seq, n)`` shrinks it to ``n``,
    ``free(seq)`` releases it. ``register_computed(seq, token_ids)``: the table's full blocks now hold these
    computed tokens (a cache may hand them to later sequences with the same prefix). ``fork(parent, child)`` shares
    the parent's blocks with a new child; ``copy_on_write(seq, position)`` gives a sequence about to write at
    ``position`` a block of its own if that block is shared, returning ``(source, destination)`` block ids whose
    contents the caller copies (None when nothing moved). A block is in two tables only when shared (fork or prefix
    cache), and is handed out again only once no table holds it. ``num_free_blocks`` counts blocks a new table may
    take; ``num_cached_blocks`` and ``prefix_cache_stats`` are statistics. ``cdiv`` and ``scratch_sequence`` below
    are built on these members, for any allocator."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    prefix_cache_stats: PrefixCacheStats

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_cached_blocks(self) -> int: ...

    def block_table(self, seq_id: object) -> list[int]: ...

    def has_seq(self, seq_id: object) -> bool: ...

    def can_allocate(self, token_ids: list[int], use_cache: bool = True) -> bool: ...

    def allocate(self, seq_id: object, token_ids: list[int], use_cache: bool = True) -> int: ...

    def can_append(self, seq_id: object, num_tokens: int) -> bool: ...

    def append_slots(self, seq_id: object, num_tokens: int) -> None: ...

    def truncate(self, seq_id: object, num_tokens: int) -> None: ...

    def register_computed(self, seq_id: object, token_ids: list[int]) -> None: ...

    def fork(self, parent_id: object, child_id: object) -> None: ...

    def copy_on_write(self, seq_id: object, position: int) -> tuple[int, int] | None: ...

    def free(self, seq_id: object) -> None: ...


@dataclass
class PrefixCacheStats:
    """Prefix-cache traffic, in blocks: ``queries`` full prompt blocks looked up, ``hits`` of them found."""

    queries: int = 0
    hits: int = 0


def cdiv(num_tokens: int, block_size: int) -> int:
    """Blocks that ``num_tokens`` tokens take: the ceiling of the division, in integers."""
    return -(-num_tokens // block_size)


@contextmanager
def scratch_sequence(blocks: KVBlockAllocator, seq_id: object, token_ids: list[int]) -> Iterator[None]:
    """Blocks for a throw-away sequence (start-up calibration), freed on exit; its lookups stay out of the hit rate."""
    counted = blocks.prefix_cache_stats.queries, blocks.prefix_cache_stats.hits
    blocks.allocate(seq_id, token_ids)
    try:
        yield
    finally:
        blocks.free(seq_id)
        blocks.prefix_cache_stats.queries, blocks.prefix_cache_stats.hits = counted


@dataclass
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks registered so far


class KVCacheManager:
    """Allocates KV blocks to sequences from a ``BlockPool``. All methods take a sequence id (any hashable)."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size, self.enable_prefix_caching = num_blocks, block_size, enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._seqs: dict[object, _SeqBlocks] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # --- capacity -------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (truly free, plus cached ones that may be evicted)."""
        return self.block_pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.block_pool.num_cached_blocks

    def block_table(self, seq_id: object) -> list[int]:
        return self._seqs[seq_id].table

    def has_seq(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    # --- allocation -------------------------------------------------------------------------------------

    def _full_block_hashes(self, token_ids: list[int], start: int = 0, parent: int | None = None) -> list[int]:
        bs = self.block_size
        hashes = []
        for i in range(start, len(token_ids) // bs):
            parent = chain_hash(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            hashes.append(parent)
        return hashes

    def _lookup_prefix(self, token_ids: list[int], use_cache: bool = True) -> list[int]:
        """Block ids of the longest cached prefix of full blocks (verified token by token)."""
        if not self.enable_prefix_caching or not use_cache:
            return []
        bs, hits = self.block_size, []
        for i, h in enumerate(self._full_block_hashes(token_ids)):
            bid = self.block_pool.get_cached_block(h, tuple(token_ids[i * bs : (i + 1) * bs]))
            if bid is None:
                break
            hits.append(bid)
        # The last prompt token must be computed to produce logits: never serve the whole prompt from cache.
        if hits and len(hits) * bs >= len(token_ids):
            hits.pop()
        return hits

    def can_allocate(self, token_ids: list[int], use_cache: bool = True) -> bool:
        hits = self._lookup_prefix(token_ids, use_cache)
        reusable_free = sum(1 for b in hits if self.block_pool.blocks[b].ref_count == 0)
        return cdiv(len(token_ids), self.block_size) - len(hits) <= self.num_free_blocks - reusable_free

    def allocate(self, seq_id: object, token_ids: list[int], use_cache: bool = True) -> int:
        """Give a new sequence blocks for its prompt. Returns how many prompt tokens are already cached
        (their KV need not be computed); ``use_cache=False`` takes no hits (the prompt's logits are wanted).
        Raises ``MemoryError`` if the blocks are not there: call ``can_allocate`` first."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not token_ids:
            raise ValueError("cannot allocate blocks for an empty sequence")
        if not self.can_allocate(token_ids, use_cache):
            raise MemoryError(f"not enough free KV blocks for {len(token_ids)} tokens")
        hits = self._lookup_prefix(token_ids, use_cache)
        if use_cache:  # a prompt that bypasses the cache made no lookup: it is not cache traffic
            self.prefix_cache_stats.queries += len(token_ids) // self.block_size
        self.prefix_cache_stats.hits += len(hits)
        seq = _SeqBlocks()
        for bid in hits:
            self.block_pool.touch(bid)
            seq.table.append(bid)
            seq.hashes.append(self.block_pool.blocks[bid].block_hash)  # type: ignore[arg-type]
        for _ in range(cdiv(len(token_ids), self.block_size) - len(hits)):
            seq.table.append(self.block_pool.get_new_block())
        self._seqs[seq_id] = seq
        return len(hits) * self.block_size

    def can_append(self, seq_id: object, num_tokens: int) -> bool:
        """Whether the sequence can grow to ``num_tokens`` tokens with the blocks that are free now."""
        return cdiv(num_tokens, self.block_size) - len(self._seqs[seq_id].table) <= self.num_free_blocks

    def append_slots(self, seq_id: object, num_tokens: int) -> None:
        """Grow the sequence's table to hold ``num_tokens`` tokens (call ``can_append`` first)."""
        seq = self._seqs[seq_id]
        missing = cdiv(num_tokens, self.block_size) - len(seq.table)
        if missing > self.num_free_blocks:
            raise MemoryError(f"not enough free KV blocks to grow {seq_id!r} to {num_tokens} tokens")
        for _ in range(missing):
            seq.table.append(self.block_pool.get_new_block())

    def truncate(self, seq_id: object, num_tokens: int) -> None:
        """Shrink a sequence to ``num_tokens`` tokens (speculative rollback), freeing emptied blocks."""
        seq = self._seqs[seq_id]
        keep = cdiv(num_tokens, self.block_size)
        if num_tokens % self.block_size and keep <= len(seq.table):
            # The new last block is cut in the middle and will be written again: it must be this
            # sequence's alone, and it no longer holds the tokens its cache entry promises.
            block = self.block_pool.blocks[seq.table[keep - 1]]
            if block.ref_count > 1:
                raise ValueError(f"cannot truncate {seq_id!r} inside block {block.block_id}, which other sequences "
                                 f"share (a rollback may not reach into a shared prefix)")
            self.block_pool.uncache(block.block_id)
        while len(seq.table) > keep:
            self.block_pool.free_block(seq.table.pop())
        del seq.hashes[num_tokens // self.block_size :]

    def register_computed(self, seq_id: object, token_ids: list[int]) -> None:
        """Publish the sequence's newly *full* blocks in the prefix cache, once their KV is written.
        ``token_ids`` are all tokens whose KV is now in the cache."""
        if not self.enable_prefix_caching:
            return
        seq = self._seqs[seq_id]
        bs = self.block_size
        parent = seq.hashes[-1] if seq.hashes else None
        for i, h in enumerate(self._full_block_hashes(token_ids, len(seq.hashes), parent), start=len(seq.hashes)):
            seq.hashes.append(h)  # a block cached already (a shared hit, or the same tokens elsewhere) stays as is
            self.block_pool.cache_full_block(seq.table[i], h, tuple(token_ids[i * bs : (i + 1) * bs]))

    def fork(self, parent_id: object, child_id: object) -> None:
        """Give ``child_id`` the parent's blocks without copying any: the same table, every block's reference count
        raised. Beam search forks a beam that has several surviving continuations (``beam_search.py``); the
        shared blocks stay read-only until one of the sharers writes, see ``copy_on_write``."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        parent = self._seqs[parent_id]
        for bid in parent.table:
            self.block_pool.touch(bid)
        self._seqs[child_id] = _SeqBlocks(list(parent.table), list(parent.hashes))

    def copy_on_write(self, seq_id: object, position: int) -> tuple[int, int] | None:
        """Make the block that will hold token ``position`` of the sequence its own before it is written.

        If other sequences share that block (after a ``fork``), the sequence takes a fresh block in its place and
        the caller must copy the KV of the shared block into it: returns ``(source, destination)``. Returns None if
        the block is already private, or not allocated yet (``append_slots`` will give a fresh one). A full block
        is never written again, so only a sequence's last, partly filled block is ever copied."""
        seq = self._seqs[seq_id]
        index = position // self.block_size
        if index >= len(seq.table) or self.block_pool.blocks[seq.table[index]].ref_count == 1:
            return None
        if not self.num_free_blocks:
            raise MemoryError(f"no free KV block to copy block {seq.table[index]} of {seq_id!r} into")
        src, dst = seq.table[index], self.block_pool.get_new_block()
        self.block_pool.free_block(src)
        seq.table[index] = dst
        return src, dst

    def free(self, seq_id: object) -> None:
        """Release a finished, aborted or preempted sequence's blocks. Tail blocks are released first so
        that, under LRU eviction, a shared prefix outlives the private ends of the sequences using it."""
        seq = self._seqs.pop(seq_id)
        for bid in reversed(seq.table):
            self.block_pool.free_block(bid)

    def check_invariants(self) -> None:
        """Every block is in exactly one state and reference counts match the tables (used by tests)."""
        refs = [0] * self.num_blocks
        for seq in self._seqs.values():
            for bid in seq.table:
                refs[bid] += 1
        self.block_pool.check_invariants(refs)
