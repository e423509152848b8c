"""The paged KV cache's block manager: allocation, prefix caching, eviction, and no leaks under random use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import minifer.core.kv_cache_manager as bm
from minifer_course.block_order import fifo_manager
from minifer.core.kv_cache_manager import KVCacheManager, cdiv, scratch_sequence

pytestmark = pytest.mark.core  # the fast tier (tests/README.md)


def test_allocate_grow_free_returns_every_block():
    m = KVCacheManager(num_blocks=8, block_size=4)
    assert m.allocate("a", list(range(6))) == 0
    assert len(m.block_table("a")) == 2 and m.num_free_blocks == 6
    m.append_slots("a", 9)
    assert len(m.block_table("a")) == 3
    m.free("a")
    m.check_invariants()
    assert m.num_free_blocks == 8


def test_prefix_hit_shares_blocks_and_keeps_last_token_uncached():
    m = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(100, 112))  # three full blocks
    m.allocate("a", prompt)
    m.register_computed("a", prompt)
    # same 8-token prefix, different tail: two blocks are shared
    assert m.allocate("b", prompt[:8] + [1, 2, 3]) == 8
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.block_pool.blocks[m.block_table("a")[0]].ref_count == 2
    # an identical prompt: the last block is recomputed so the last token yields logits
    assert m.allocate("c", prompt) == 8
    m.check_invariants()
    for s in "abc":
        m.free(s)
    m.check_invariants()
    assert m.num_free_blocks == 10 and m.num_cached_blocks == 3  # kept after release


def test_cached_blocks_evicted_lru_only_when_needed():
    m = KVCacheManager(num_blocks=4, block_size=2)
    m.allocate("a", [1, 2, 3, 4])
    m.register_computed("a", [1, 2, 3, 4])
    m.free("a")
    assert m.num_cached_blocks == 2 and m.num_free_blocks == 4
    m.allocate("b", [9, 9, 9, 9, 9, 9])  # needs 3 blocks: 2 truly free + evict one cached
    assert m.num_cached_blocks == 1
    m.check_invariants()
    # the tail block [3, 4] was released first, so it was the one evicted; the prefix [1, 2] survives
    m.free("b")
    assert m.allocate("c", [1, 2, 7]) == 2


def test_hash_collision_never_serves_wrong_tokens(monkeypatch):
    monkeypatch.setattr(bm, "chain_hash", lambda parent, tokens: 42)  # every block collides
    m = KVCacheManager(num_blocks=8, block_size=2)
    m.allocate("a", [1, 2, 3])
    m.register_computed("a", [1, 2, 3])
    assert m.allocate("b", [5, 6, 7]) == 0  # same hash, different tokens: a miss
    assert m.allocate("c", [1, 2, 8]) == 2  # same tokens: a verified hit
    m.check_invariants()


def test_truncate_frees_emptied_blocks():
    m = KVCacheManager(num_blocks=6, block_size=4)
    m.allocate("a", list(range(5)))
    m.append_slots("a", 13)
    assert len(m.block_table("a")) == 4
    m.truncate("a", 6)
    assert len(m.block_table("a")) == 2 and m.num_free_blocks == 4
    m.check_invariants()


def test_truncate_into_a_cached_block_uncaches_it_and_refuses_shared_ones():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("a", list(range(9)))
    m.register_computed("a", list(range(9)))
    m.allocate("b", list(range(9)))  # shares blocks 0 and 1 with "a"
    with pytest.raises(ValueError, match="share"):
        m.truncate("a", 6)
    m.free("b")
    m.truncate("a", 6)  # block 1 is a's alone now: it leaves the prefix cache
    assert m.allocate("c", list(range(9))) == 4
    m.check_invariants()


def test_out_of_blocks_is_reported_not_corrupting():
    m = KVCacheManager(num_blocks=2, block_size=4)
    assert not m.can_allocate(list(range(9)))
    with pytest.raises(MemoryError):
        m.allocate("a", list(range(9)))
    m.check_invariants()
    assert m.num_free_blocks == 2
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0)


def test_fork_shares_every_block_and_copy_on_write_privatises_the_last():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.allocate("a", list(range(6)))  # one full block, one holding 2 of 4 tokens
    m.fork("a", "b")
    assert m.block_table("b") == m.block_table("a") and [m.block_pool.blocks[i].ref_count for i in m.block_table("a")] == [2, 2]
    assert m.num_free_blocks == 6  # a fork takes no block
    with pytest.raises(ValueError, match="already has blocks"):
        m.fork("a", "b")
    shared = m.block_table("a")[1]
    src, dst = m.copy_on_write("b", 6)  # b writes token 6 into the shared, partly filled block: copy it first
    assert src == shared and m.block_table("b") == [m.block_table("a")[0], dst] and dst != shared
    assert m.copy_on_write("a", 6) is None  # a is now the block's only holder: it writes in place
    assert m.copy_on_write("a", 8) is None  # the next block does not exist yet: append_slots gives a fresh one
    m.check_invariants()
    m.free("a")
    m.free("b")
    m.check_invariants()
    assert m.num_free_blocks == 8


def test_copy_on_write_without_a_free_block_changes_nothing():
    m = KVCacheManager(num_blocks=2, block_size=4)
    m.allocate("a", list(range(6)))
    m.fork("a", "b")
    with pytest.raises(MemoryError, match="no free KV block"):
        m.copy_on_write("b", 6)
    assert m.block_table("b") == m.block_table("a")
    m.check_invariants()


def test_copy_blocks_copies_keys_values_and_scales_in_every_layer():
    import torch

    from minifer.attention.backends.paged import PagedKVCache

    for kv_dtype in ("auto", "int8"):
        cache = PagedKVCache(3, 6, 4, 2, 8, torch.float32, "cpu", kv_cache_dtype=kv_dtype)
        tensors = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if kv_dtype == "int8" else [])
        for i, t in enumerate(tensors):
            t.copy_(torch.randint(-100, 100, t.shape, generator=torch.Generator().manual_seed(i)).to(t.dtype))
        before = [t.clone() for t in tensors]
        cache.copy_blocks([(1, 4), (4, 2)])  # every source is read before any destination is written
        for t, b in zip(tensors, before):
            assert torch.equal(t[:, 4], b[:, 1]) and torch.equal(t[:, 2], b[:, 4])
            for other in (0, 1, 3, 5):
                assert torch.equal(t[:, other], b[:, other])


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "grow", "register", "truncate", "free", "fork", "write"]), st.integers(0, 5),
              st.lists(st.integers(0, 3), min_size=1, max_size=14), st.integers(1, 30)),
    max_size=60)


@pytest.mark.parametrize("cls", [KVCacheManager, fifo_manager])  # the benchmark's FIFO variant must hold up too
@settings(max_examples=200, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), num_blocks=st.integers(1, 12),
       caching=st.booleans())
def test_random_workloads_leak_nothing(cls, ops, block_size, num_blocks, caching):
    m = cls(num_blocks, block_size, enable_prefix_caching=caching)
    tokens: dict[int, list[int]] = {}
    for op, sid, toks, n in ops:
        if op == "alloc" and sid not in tokens:
            if m.can_allocate(toks):
                m.allocate(sid, toks)
                tokens[sid] = list(toks)
        elif sid in tokens:
            if op == "grow":
                new = tokens[sid] + toks
                if m.can_append(sid, len(new)):
                    m.append_slots(sid, len(new))
                    tokens[sid] = new
            elif op == "register":
                m.register_computed(sid, tokens[sid])
            elif op == "truncate":
                keep = min(n, len(tokens[sid]))
                try:
                    m.truncate(sid, keep)
                except ValueError:  # refused: it would cut into a block other sequences share
                    continue
                tokens[sid] = tokens[sid][:keep]
            elif op == "free":
                m.free(sid)
                del tokens[sid]
            elif op == "fork" and n % 6 not in tokens:  # beam search: a child shares all its parent's blocks
                m.fork(sid, n % 6)
                tokens[n % 6] = list(tokens[sid])
            elif op == "write":  # about to write the token after the last: make its block private first
                try:
                    m.copy_on_write(sid, len(tokens[sid]))
                except MemoryError:
                    pass
        m.check_invariants()
        for sid, t in tokens.items():
            assert len(m.block_table(sid)) >= cdiv(len(t), m.block_size)
    for sid in list(tokens):
        m.free(sid)
    m.check_invariants()
    assert m.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in m.block_pool.blocks)


def test_scratch_sequence_is_freed_and_not_counted_as_cache_traffic():
    m = KVCacheManager(8, 4, enable_prefix_caching=True)
    m.allocate("a", list(range(8)))
    m.register_computed("a", list(range(8)))
    stats = m.prefix_cache_stats
    before = m.num_free_blocks, stats.queries, stats.hits
    with pytest.raises(RuntimeError):
        with scratch_sequence(m, "__scratch__", list(range(8))):  # the same tokens: a prefix-cache hit
            assert m.has_seq("__scratch__") and stats.hits == 1
            raise RuntimeError("a failed calibration pass")
    assert not m.has_seq("__scratch__")
    assert (m.num_free_blocks, stats.queries, stats.hits) == before


def test_lowest_free_block_goes_out_first_whatever_the_order_blocks_came_back_in():
    """History (the order sequences finish, rollbacks) must not scatter later sequences over the pool."""
    m = KVCacheManager(12, 2, enable_prefix_caching=False)
    for sid in range(5):
        m.allocate(sid, [1, 2, 3])  # two blocks each: 0-9 in use
    for sid in (3, 0, 4, 1):
        m.free(sid)
    m.truncate(2, 1)  # a rollback frees block 5
    m.allocate("new", list(range(9)))
    assert m.block_table("new") == [0, 1, 2, 3, 5]
    m.check_invariants()
    fifo = fifo_manager(12, 2)  # the textbook queue hands the history on
    for sid in range(5):
        fifo.allocate(sid, [1, 2, 3])
    for sid in (3, 0, 4, 1):
        fifo.free(sid)
    fifo.allocate("new", list(range(9)))
    assert fifo.block_table("new") == [10, 11, 7, 6, 1]
