"""The graders of exercises 02 (the KV cache in blocks) and 03 (continuous batching): minifer's own implementations
pass them, the classic mistakes fail them with a hint that names the mistake, correct variants pass."""

from __future__ import annotations

from collections import OrderedDict, deque

import pytest
import torch

import minifer.core.kv_cache_manager as _bm
from minifer_course.kv_memory import parallel_sampling_blocks
from minifer_course.grading import batching, paging
from minifer.core.kv_cache_manager import KVCacheManager
from minifer.attention.backends.paged import PagedAttentionMetadata, paged_attention_reference
from minifer.attention.backends.paged import slot_mapping as ref_slot_mapping




def _ref_paged_attention(q, k_cache, v_cache, block_table, context_len):
    """minifer's batched reference, for one sequence (the exercise's signature)."""
    meta = PagedAttentionMetadata.build([block_table], [context_len], [q.shape[0]], k_cache.shape[1], q.device)
    return paged_attention_reference(q, k_cache, v_cache, meta)


class _BlockManagerAdapter(KVCacheManager):
    """minifer's KVCacheManager under the exercise's attribute names (the grader patches its chain_hash)."""

    def __init__(self, num_blocks, block_size, hash_fn=None):
        super().__init__(num_blocks, block_size)

    cache = property(lambda self: self.block_pool._cache)
    tables = property(lambda self: {s: q.table for s, q in self._seqs.items()})
    ref_count = property(lambda self: [b.ref_count for b in self.block_pool.blocks])


class _ForkingBlockManager(_BlockManagerAdapter):
    """minifer's fork and copy_on_write, with the exercise's given ``grow``."""

    def grow(self, seq_id, num_tokens):
        self.append_slots(seq_id, num_tokens)


REFERENCES = [
    (paging.check_slot_mapping, ref_slot_mapping, "slot_mapping: 6/6 checks passed"),
    (paging.check_paged_attention, _ref_paged_attention, "paged_attention: 8/8 checks passed"),
    (paging.check_prefix_allocator, _BlockManagerAdapter, "prefix_allocator: 11/11 checks passed"),
    (batching.check_schedule_step, batching._schedule_with_minifer, "schedule_step: 11/11 checks passed"),
    (paging.check_parallel_sampling_blocks, parallel_sampling_blocks, "parallel_sampling_blocks: 8/8 checks passed"),
    (paging.check_forking_allocator, _ForkingBlockManager, "forking_allocator: 9/9 checks passed"),
]


@pytest.mark.parametrize("grader, reference, summary", REFERENCES,
                         ids=lambda v: getattr(v, "__name__", None))
def test_graders_pass_minifers_own_implementation(grader, reference, summary, capsys):
    grader(reference)
    first = capsys.readouterr().out
    assert first.splitlines()[-1] == summary
    grader(reference)
    assert capsys.readouterr().out == first, "the report must be deterministic (nbval compares it)"


def test_scheduler_scenarios_match_minifers_scheduler():
    """Every hand-written expected answer is what minifer's Scheduler does on the same state."""
    for label, kwargs, want, _ in batching.SCHEDULER_SCENARIOS:
        assert batching._schedule_with_minifer(**kwargs) == want, label


def test_the_paged_reference_is_dense_causal_attention():
    """The grader's answer key agrees with plain causal attention on the unpaged keys and values."""
    gen = torch.Generator().manual_seed(0)
    ctx, t, hq, hkv, d, bs = 13, 5, 6, 2, 8, 4
    table = [5, 0, 7, 2]
    k, v, q = (torch.randn(ctx, hkv, d, generator=gen), torch.randn(ctx, hkv, d, generator=gen),
               torch.randn(t, hq, d, generator=gen))
    k_cache, v_cache = torch.full((8, bs, hkv, d), float("nan")), torch.full((8, bs, hkv, d), float("nan"))
    slots = ref_slot_mapping(table, list(range(ctx)), bs)
    k_cache.view(-1, hkv, d)[slots], v_cache.view(-1, hkv, d)[slots] = k, v
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("thd,shd->hts", q, kk) / d ** 0.5
    allowed = torch.arange(ctx)[None, :] <= (ctx - t + torch.arange(t))[:, None]
    dense = torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(_ref_paged_attention(q, k_cache, v_cache, table, ctx), dense)


def test_the_allocator_grader_restores_chain_hash():
    original = _bm.chain_hash
    paging.check_prefix_allocator(_BlockManagerAdapter)
    assert _bm.chain_hash is original


# Classic mistakes.

def _slots_swapped(table, positions, bs):
    return [table[p % bs] * bs + p // bs for p in positions]


def _slots_block_not_scaled(table, positions, bs):
    return [table[p // bs] + p % bs for p in positions]


def _slots_no_table(table, positions, bs):
    return list(positions)


def _paged(q, k_cache, v_cache, table, ctx, *, offset=True, interleave=True, whole_blocks=False, scale=True):
    """A correct single-sequence paged attention with switches for the classic mistakes."""
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    s = len(table) * bs if whole_blocks else ctx  # whole_blocks: read the last block's garbage tail too
    pos = torch.arange(s)
    slots = torch.tensor(table)[pos // bs] * bs + pos % bs
    k, v = k_cache.reshape(-1, hkv, d)[slots], v_cache.reshape(-1, hkv, d)[slots]
    rep = (lambda x: x.repeat_interleave(hq // hkv, 1)) if interleave else (lambda x: x.repeat(1, hq // hkv, 1))
    k, v = rep(k), rep(v)
    scores = torch.einsum("thd,shd->hts", q, k) / (d ** 0.5 if scale else 1.0)
    q_pos = (ctx - t if offset else 0) + torch.arange(t)
    allowed = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] < ctx)
    return torch.einsum("hts,shd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


class _Allocator:
    """A correct prefix-caching allocator (the notebook's) with switches for the classic mistakes."""

    def __init__(self, num_blocks, block_size, hash_fn=_bm.chain_hash, *, verify=True, keep_last=True, evict=True,
                 lru=True, tail_first=True, unpark=True, uncache_evicted=True, stop_at_miss=True, park_cached=True):
        self.block_size, self.hash_fn = block_size, hash_fn
        self.verify, self.keep_last, self.evict, self.lru = verify, keep_last, evict, lru
        self.tail_first, self.unpark, self.uncache_evicted = tail_first, unpark, uncache_evicted
        self.stop_at_miss, self.park_cached = stop_at_miss, park_cached
        self.ref_count, self.block_hash = [0] * num_blocks, [None] * num_blocks
        self.block_tokens = [()] * num_blocks
        self.free_list, self.evictable = deque(range(num_blocks)), OrderedDict()
        self.cache, self.tables, self.seq_hashes = {}, {}, {}

    num_free_blocks = property(lambda self: len(self.free_list) + len(self.evictable))

    def blocks_needed(self, n):
        return -(-n // self.block_size)

    def full_block_hashes(self, tokens, start=0, parent=None):
        bs, out = self.block_size, []
        for i in range(start, len(tokens) // bs):
            parent = self.hash_fn(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            out.append(parent)
        return out

    def can_allocate(self, tokens):
        hits = self.lookup_prefix(tokens)
        parked = sum(1 for b in hits if self.ref_count[b] == 0)
        return self.blocks_needed(len(tokens)) - len(hits) <= self.num_free_blocks - parked

    def register_computed(self, seq_id, tokens):
        table, hashes, bs = self.tables[seq_id], self.seq_hashes[seq_id], self.block_size
        for i, h in enumerate(self.full_block_hashes(tokens, len(hashes), hashes[-1] if hashes else None),
                              start=len(hashes)):
            hashes.append(h)
            b = table[i]
            if self.block_hash[b] is None and h not in self.cache:
                self.block_hash[b], self.block_tokens[b] = h, tuple(tokens[i * bs:(i + 1) * bs])
                self.cache[h] = b

    def lookup_prefix(self, tokens):
        bs, hits = self.block_size, []
        for i, h in enumerate(self.full_block_hashes(tokens)):
            b = self.cache.get(h)
            if b is None or (self.verify and self.block_tokens[b] != tuple(tokens[i * bs:(i + 1) * bs])):
                if self.stop_at_miss:
                    break
                continue
            hits.append(b)
        if self.keep_last and hits and len(hits) * bs >= len(tokens):
            hits.pop()
        return hits

    def take_free_block(self):
        if self.free_list:
            b = self.free_list.popleft()
        elif not self.evict:
            raise MemoryError("no free block")
        else:
            b, _ = self.evictable.popitem(last=not self.lru)
            if self.uncache_evicted:
                del self.cache[self.block_hash[b]]
                self.block_hash[b], self.block_tokens[b] = None, ()
        self.ref_count[b] = 1
        return b

    def allocate(self, seq_id, tokens):
        hits = self.lookup_prefix(tokens)
        table = []
        for b in hits:
            if self.ref_count[b] == 0 and self.unpark:
                del self.evictable[b]
            self.ref_count[b] += 1
            table.append(b)
        while len(table) < self.blocks_needed(len(tokens)):
            table.append(self.take_free_block())
        self.tables[seq_id] = table
        self.seq_hashes[seq_id] = [self.block_hash[b] for b in hits]
        return len(hits) * self.block_size

    def free(self, seq_id):
        table = self.tables.pop(seq_id)
        del self.seq_hashes[seq_id]
        for b in reversed(table) if self.tail_first else table:
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                if self.block_hash[b] is not None and self.park_cached:
                    self.evictable[b] = None
                else:
                    self.free_list.append(b)


class _ForkingAllocator(_Allocator):
    """The notebook's fork and copy_on_write, with switches for the classic mistakes."""

    def __init__(self, num_blocks, block_size, hash_fn=_bm.chain_hash, *, own_table=True, own_hashes=True,
                 add_refs=True, copy_private=False, drop_ref=True, replace=True):
        super().__init__(num_blocks, block_size, hash_fn)
        self.own_table, self.own_hashes, self.add_refs = own_table, own_hashes, add_refs
        self.copy_private, self.drop_ref, self.replace = copy_private, drop_ref, replace

    def grow(self, seq_id, num_tokens):
        table = self.tables[seq_id]
        while len(table) < self.blocks_needed(num_tokens):
            table.append(self.take_free_block())

    def fork(self, parent_id, child_id):
        table, hashes = self.tables[parent_id], self.seq_hashes[parent_id]
        self.tables[child_id] = list(table) if self.own_table else table
        self.seq_hashes[child_id] = list(hashes) if self.own_hashes else hashes
        for b in table:
            self.ref_count[b] += self.add_refs

    def copy_on_write(self, seq_id, position):
        table, index = self.tables[seq_id], position // self.block_size
        if index >= len(table) or (self.ref_count[table[index]] == 1 and not self.copy_private):
            return None
        shared, fresh = table[index], self.take_free_block()
        self.ref_count[shared] -= self.drop_ref
        if self.replace:
            table[index] = fresh
        return shared, fresh


def _forking_with(**mistake):
    return lambda num_blocks, block_size, hash_fn=_bm.chain_hash: _ForkingAllocator(num_blocks, block_size, hash_fn,
                                                                                    **mistake)


def _allocator_with(**mistake):
    return lambda num_blocks, block_size, hash_fn=_bm.chain_hash: _Allocator(num_blocks, block_size, hash_fn,
                                                                             **mistake)


def _schedule(running, waiting, free_blocks, block_size, max_num_seqs, token_budget, *, oldest_victim=False,
              admit_after_preemption=False, skip_ahead=False, chunk_blocks_only=False, no_chunking=False,
              keep_victim_blocks=False, in_place=False):
    """The notebook's schedule_step with switches for the classic mistakes."""
    running = running if in_place else list(running)
    scheduled, preempted = [], []
    budget, free = token_budget, free_blocks
    i = 0
    while i < len(running) and budget > 0:
        req = running[i]
        n = min(req.num_tokens - req.num_computed, budget)
        need = -(-(req.num_computed + n) // block_size) - req.num_blocks
        while need > free:
            victim = running.pop(0 if oldest_victim else -1)
            free += 0 if keep_victim_blocks else victim.num_blocks
            preempted.append(victim.name)
            if victim is req:
                break
        if preempted and preempted[-1] == req.name:
            break
        free -= max(need, 0)
        scheduled.append((req.name, n))
        budget -= n
        i += 1
    for req in waiting:
        if budget <= 0 or len(running) >= max_num_seqs or (preempted and not admit_after_preemption):
            break
        n = req.num_tokens if no_chunking else min(req.num_tokens, budget)
        need = -(-(n if chunk_blocks_only else req.num_tokens) // block_size)
        if need > free:
            if skip_ahead:
                continue
            break
        free -= need
        running.append(req)
        scheduled.append((req.name, n))
        budget -= n
    return scheduled, preempted


def _ps_blocks(p, o, n, bs, shared, common=lambda p, bs: (p - 1) // bs, times_n=True, honour_shared=True):
    own = -(-(p + o) // bs)
    if not shared and honour_shared:
        return n * own
    c = min(common(p, bs), own)
    return c + (n if times_n else 1) * (own - c)


WRONG = [
    (paging.check_slot_mapping, _slots_swapped, "`//` and `%` are swapped"),
    (paging.check_slot_mapping, _slots_block_not_scaled, "multiply it by block_size"),
    (paging.check_slot_mapping, _slots_no_table, "look its block up in the block table"),
    (paging.check_slot_mapping, lambda t, ps, bs: [t[p // bs] * bs + p % bs + 0.4 for p in ps],
     r"slot_mapping: 28\.4 is not a whole number"),
    (paging.check_paged_attention, lambda *a: _paged(*a, offset=False), "check 2/8"),
    (paging.check_paged_attention, lambda *a: _paged(*a, interleave=False), "repeat_interleave"),
    (paging.check_paged_attention, lambda *a: _paged(*a, whole_blocks=True), r"0 \* NaN is NaN"),
    (paging.check_paged_attention, lambda *a: _paged(*a, scale=False), "check 1/8"),
    (paging.check_prefix_allocator, _allocator_with(verify=False), "compare the cached block's tokens"),
    (paging.check_prefix_allocator, _allocator_with(keep_last=False), "drop the last hit"),
    (paging.check_prefix_allocator, _allocator_with(evict=False), "check 6/11 .*MemoryError"),
    (paging.check_prefix_allocator, _allocator_with(lru=False), "check 6/11"),
    (paging.check_prefix_allocator, _allocator_with(tail_first=False), "check 6/11"),
    (paging.check_prefix_allocator, _allocator_with(stop_at_miss=False), "(?s)check 8/11.*break, not continue"),
    (paging.check_prefix_allocator, _allocator_with(park_cached=False),
     "(?s)check 5/11.*blocks in `evictable`.*goes to the evictable LRU"),
    (paging.check_prefix_allocator, _allocator_with(unpark=False), "num_free_blocks is"),
    (paging.check_prefix_allocator, _allocator_with(uncache_evicted=False), "blocks in the prefix cache"),
    (batching.check_schedule_step, lambda *a: _schedule(*a, oldest_victim=True), "preempt running\\[-1\\]"),
    (batching.check_schedule_step, lambda *a: _schedule(*a, admit_after_preemption=True), "admit nobody"),
    (batching.check_schedule_step, lambda *a: _schedule(*a, skip_ahead=True), "no skipping ahead"),
    (batching.check_schedule_step, lambda *a: _schedule(*a, chunk_blocks_only=True), "whole prompt"),
    (batching.check_schedule_step, lambda *a: _schedule(*a, no_chunking=True), "chunked prefill"),
    (batching.check_schedule_step, lambda *a: _schedule(*a, keep_victim_blocks=True), "add its blocks"),
    (batching.check_schedule_step, lambda *a: _schedule(*a, in_place=True), "modified the `running`"),
    (paging.check_parallel_sampling_blocks, lambda *a: _ps_blocks(*a, common=lambda p, bs: p // bs),
     "never taken from the cache"),
    (paging.check_parallel_sampling_blocks, lambda *a: _ps_blocks(*a, common=lambda p, bs: -(-p // bs)),
     "partly filled block cannot be shared"),
    (paging.check_parallel_sampling_blocks, lambda *a: _ps_blocks(*a, common=lambda p, bs: 0),
     "held once, not once per completion"),
    (paging.check_parallel_sampling_blocks, lambda *a: _ps_blocks(*a, times_n=False), "multiply them by n"),
    (paging.check_parallel_sampling_blocks, lambda *a: _ps_blocks(*a, honour_shared=False), "no prefix cache"),
    (paging.check_forking_allocator, _forking_with(add_refs=False), r"(?s)check 1/9.*ref_count"),
    (paging.check_forking_allocator, _forking_with(own_table=False), r"(?s)check 2/9.*list\(\.\.\.\)"),
    (paging.check_forking_allocator, _forking_with(own_hashes=False), r"(?s)check 3/9.*copy seq_hashes too"),
    (paging.check_forking_allocator, _forking_with(copy_private=True), r"(?s)check 4/9.*expected None"),
    (paging.check_forking_allocator, _forking_with(drop_ref=False), r"(?s)check 3/9.*drop one reference from it"),
    (paging.check_forking_allocator, _forking_with(replace=False), r"(?s)check 3/9.*table\[index\] = fresh"),
]


@pytest.mark.parametrize("grader, wrong, match", WRONG, ids=[m for _, _, m in WRONG])
def test_graders_reject_classic_mistakes(grader, wrong, match, capsys):
    with pytest.raises(AssertionError, match=match):
        grader(wrong)
    assert "  FAIL  " in capsys.readouterr().out


def test_graders_accept_the_correct_variants():
    paging.check_slot_mapping(lambda t, ps, bs: torch.tensor([t[p // bs] * bs + p % bs for p in ps]))  # a tensor
    paging.check_paged_attention(_paged)
    paging.check_prefix_allocator(_Allocator)
    batching.check_schedule_step(_schedule)
    paging.check_parallel_sampling_blocks(_ps_blocks)
    paging.check_forking_allocator(_forking_with())


# --- exercise 03: preemption by recompute, update_from_output -------------------------------------------------

from minifer.core.sched.scheduler import preempt_by_recompute  # noqa: E402
from minifer.request import RequestStatus  # noqa: E402
from minifer.core.sched.scheduler import Scheduler  # noqa: E402


def _preempt(running, waiting, blocks, *, oldest=False, free=True, reset=True, front=True, keep_tokens=True,
             status=True, pop=True):
    """The notebook's preempt with switches for the classic mistakes."""
    victim = running[0 if oldest else -1]
    if pop:
        running.remove(victim)
    if free:
        blocks.free(victim.request_id)
    if reset:
        victim.num_computed_tokens = 0
    if status:
        victim.status = RequestStatus.WAITING
    if not keep_tokens:
        victim.output_token_ids.clear()  # "a fresh start": the generated tokens are lost
    (waiting.appendleft if front else waiting.append)(victim)
    return victim


def _update(self, batch, sampled, result, tokenizer=None, *, count_computed=True, free_first=False,
            free_before_appending=False, free=True, register=True, return_batch=False):
    """The notebook's update_from_output with switches for the classic mistakes."""
    if count_computed:
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
    if free_before_appending:  # nothing has finished yet: the finished ones are never freed
        for seq in sampled:
            if seq.is_finished:
                self.finish(seq)
    for seq, token, logprob, entry in zip(sampled, result.token_ids, result.sampled_logprob, result.logprobs):
        seq.append_token(token, logprob, entry, tokenizer)
    if free_first:  # frees, then publishes the freed sequence's blocks
        for seq in sampled:
            if seq.is_finished:
                self.finish(seq)
    if register:
        for seq in batch.seqs:
            self.blocks.register_computed(seq.request_id, seq.token_slice(0, seq.num_computed_tokens))
    if free and not free_first and not free_before_appending:
        for seq in sampled:
            if seq.is_finished:
                self.finish(seq)
    return list(batch.seqs) if return_batch else sampled


def _wrong_update(**mistake):
    return lambda self, batch, sampled, result, tokenizer=None: _update(self, batch, sampled, result, tokenizer,
                                                                         **mistake)


STEP_REFERENCES = [
    (batching.check_preempt, preempt_by_recompute, "preempt: 6/6 checks passed"),
    (batching.check_update_from_output, Scheduler.update_from_output, "update_from_output: 13/13 checks passed"),
]


@pytest.mark.parametrize("grader, reference, summary", STEP_REFERENCES, ids=["preempt", "update_from_output"])
def test_exercise_03_graders_pass_minifers_own(grader, reference, summary, capsys):
    test_graders_pass_minifers_own_implementation(grader, reference, summary, capsys)


STEP_WRONG = [
    (batching.check_preempt, lambda *a: _preempt(*a, oldest=True), r"(?s)check 1/6.*preempted the oldest.*running\[-1\]"),
    (batching.check_preempt, lambda *a: _preempt(*a, free=False), r"(?s)check 1/6.*blocks\.free\(victim\.request_id\)"),
    (batching.check_preempt, lambda *a: _preempt(*a, reset=False), r"(?s)check 1/6.*num_computed_tokens to 0"),
    (batching.check_preempt, lambda *a: _preempt(*a, front=False), r"(?s)check 2/6.*at the back.*appendleft"),
    (batching.check_preempt, lambda *a: _preempt(*a, keep_tokens=False), r"(?s)check 1/6.*lost the tokens"),
    (batching.check_preempt, lambda *a: _preempt(*a, status=False), r"(?s)RequestStatus\.WAITING"),
    (batching.check_preempt, lambda *a: _preempt(*a, pop=False), r"(?s)still in `running`"),
    (batching.check_update_from_output, _wrong_update(count_computed=False), r"(?s)check 1/13.*num_computed_tokens"),
    (batching.check_update_from_output, _wrong_update(free_before_appending=True), r"(?s)check 1/13.*self\.finish"),
    (batching.check_update_from_output, _wrong_update(free=False), r"(?s)check 1/13.*self\.finish"),
    (batching.check_update_from_output, _wrong_update(free_first=True), r"(?s)KeyError.*free last"),
    (batching.check_update_from_output, _wrong_update(register=False), r"(?s)check 1/13.*cached_blocks.*register_computed"),
    (batching.check_update_from_output, _wrong_update(return_batch=True), r"(?s)check 3/13.*returned.*`sampled`"),
]


@pytest.mark.parametrize("grader, wrong, match", STEP_WRONG, ids=[m[:40] for _, _, m in STEP_WRONG])
def test_exercise_03_graders_reject_classic_mistakes(grader, wrong, match, capsys):
    test_graders_reject_classic_mistakes(grader, wrong, match, capsys)


def test_exercise_03_graders_accept_the_notebooks_variants():
    batching.check_preempt(_preempt)
    batching.check_update_from_output(_update)


# --- exercise 02: the forking allocator serving shared blocks in the engine ----------------------------------


@pytest.mark.slow
def test_a_correct_forking_allocator_serves_parallel_sampling_and_beam_search(capsys):
    from minifer_course.grading.forking_engine import check_forking_in_engine

    check_forking_in_engine(_forking_with())
    assert capsys.readouterr().out.rstrip().endswith("5/5 checks passed")


@pytest.mark.slow
def test_beams_that_never_copy_on_write_are_caught_in_the_engine(monkeypatch):
    """A fork without copy-on-write, let past its grader: beam search in the engine tells."""
    from minifer_course.grading import forking_engine

    monkeypatch.setattr(forking_engine, "check_forking_allocator", lambda cls: None)
    with pytest.raises(AssertionError, match="(?s)check 5/5.*the beams of prompt .*copy_on_write"):
        forking_engine.check_forking_in_engine(_forking_with(copy_private=False, drop_ref=False, replace=False))


def test_a_wrong_fork_never_reaches_the_engine():
    from minifer_course.grading.forking_engine import check_forking_in_engine

    with pytest.raises(AssertionError, match="(?s)check 1/5.*does not go into the engine.*ref_count"):
        check_forking_in_engine(_forking_with(add_refs=False))
