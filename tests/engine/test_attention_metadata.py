"""The one attention-metadata builder (``PagedAttentionMetadata.build``) and the one slot formula (``slot_mapping``)
read against what they must hold, written out here from the block tables: every new token's slot, every key's slot
(the null slot past a sequence's context), the causal masks, on ragged contexts that end mid-block, on a block
boundary and at one token; then the greedy sampling shortcut (``ModelRunner.fast_greedy``) against ``sample``, and
the engine's greedy tokens the same with it on and off."""

from __future__ import annotations

import random

import pytest
import torch

import minifer
from minifer import SamplingParams
from minifer.worker.model_runner import ModelRunner
from minifer.attention.backends.paged import PagedAttentionMetadata, slot_mapping

BS = 16


def _slot(table: list[int], p: int) -> int:
    return table[p // BS] * BS + p % BS


def _ragged(rng: random.Random, b: int) -> tuple[list[list[int]], list[int]]:
    ids = rng.sample(range(200), 6 * b)
    tables = [ids[6 * i : 6 * i + rng.randint(1, 6)] for i in range(b)]
    ctx = [rng.choice([len(t) * BS, len(t) * BS - rng.randint(1, 15), 1 + (len(t) - 1) * BS]) for t in tables]
    return tables, ctx


def test_slot_mapping_takes_one_sequences_lists_or_a_batch_of_tensors():
    table, positions = [7, 2, 9], [0, 15, 16, 17, 40, 47]
    assert slot_mapping(table, positions, BS) == [_slot(table, p) for p in positions] == [112, 127, 32, 33, 152, 159]
    assert slot_mapping(table, [], BS) == []
    tables = torch.tensor([[7, 2, 9], [4, 0, 0]])
    got = slot_mapping(tables, torch.tensor([[0, 17, 47], [3, 15, 1]]), BS)
    assert got.tolist() == [[112, 33, 159], [67, 79, 65]]


@pytest.mark.parametrize("null", [None, 3200])
def test_decode_metadata_holds_each_tokens_slot_and_masks_the_keys_past_its_context(null):
    rng = random.Random(0)
    for _ in range(20):
        b = rng.randint(1, 9)
        tables, ctx = _ragged(rng, b)
        meta = PagedAttentionMetadata.build(tables, ctx, [1] * b, BS, torch.device("cpu"), null_slot=null)
        assert meta.slot_mapping.tolist() == [_slot(t, c - 1) for t, c in zip(tables, ctx)]
        assert meta.is_decode and meta.covers_all_in_order and meta.num_tokens == b and meta.query_lens == [1] * b
        assert meta.context_lens.tolist() == ctx and meta.block_tables.dtype == torch.int32
        assert [row[: len(t)] for row, t in zip(meta.block_tables.tolist(), tables)] == tables
        (g,) = meta.groups
        s = max(ctx)
        assert g.is_decode and (g.num_seqs, g.num_queries, g.num_keys) == (b, 1, s)
        want = [[_slot(t, p) if p < c else (null or 0) for p in range(s)] for t, c in zip(tables, ctx)]
        assert g.key_slots.view(b, s).tolist() == want
        valid = torch.tensor([[p < c for p in range(s)] for c in ctx])
        assert torch.equal(g.key_valid[:, :, 0, 0], valid) and torch.equal(g.mask[:, 0, 0], valid)
        assert g.out_index.tolist() == list(range(b)) and g.query_valid.all()


def test_a_mixed_step_groups_decodes_and_chunks_with_causal_masks():
    tables, ctx, qlen = [[3, 8], [5], [1, 6, 2]], [20, 9, 40], [1, 4, 1]
    meta = PagedAttentionMetadata.build(tables, ctx, qlen, BS, torch.device("cpu"), null_slot=999)
    assert meta.slot_mapping.tolist() == [_slot(tables[0], 19)] + [_slot(tables[1], p) for p in range(5, 9)] + [
        _slot(tables[2], 39)]
    assert not meta.is_decode and not meta.covers_all_in_order
    decode, chunk = meta.groups
    assert decode.out_index.tolist() == [0, 5] and decode.num_keys == 40
    assert chunk.out_index.tolist() == [1, 2, 3, 4] and (chunk.num_queries, chunk.num_keys) == (4, 9)
    assert chunk.key_slots.tolist() == [_slot(tables[1], p) for p in range(9)]
    # the chunk's token at position 5 + t sees keys 0..5 + t
    assert chunk.mask[0, 0].tolist() == [[k <= 5 + t for k in range(9)] for t in range(4)]


def test_engine_tokens_are_the_same_with_every_row_through_sample(target_llm, monkeypatch):
    prompts = [{"prompt_token_ids": [(13 * i + j) % 2000 + 1 for j in range(5 + 9 * i)]} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in target_llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(ModelRunner, "fast_greedy", False)
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == fast


def test_greedy_fast_path_returns_what_sample_returns(monkeypatch):
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: both paths keep the first index
    seqs = [SimpleNamespace(params=SamplingParams(temperature=0), generator=None) for _ in range(6)]
    fast = ModelRunner.sample(seqs, logits)
    monkeypatch.setattr(ModelRunner, "fast_greedy", False)
    ref = ModelRunner.sample(seqs, logits)
    assert fast.token_ids == ref.token_ids and fast.token_ids[2] == 7
    assert fast.sampled_logprob == ref.sampled_logprob and fast.logprobs == ref.logprobs == [None] * 6


def test_greedy_fast_path_leaves_every_other_request_to_sample():
    from minifer.sample.sampler import _plain_greedy

    assert _plain_greedy(SamplingParams(temperature=0))
    for kw in ({"temperature": 0.5}, {"logprobs": 0}, {"logit_bias": {3: 1.0}}, {"repetition_penalty": 1.2},
               {"min_tokens": 2}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}):
        assert not _plain_greedy(SamplingParams(**{"temperature": 0, **kw})), kw
