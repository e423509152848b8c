"""The engine's two step-overhead cuts against the general code a learner reads: the pure-decode metadata builder
(``engine.decode_metadata``) against ``PagedAttentionMetadata.build`` (every field equal, on ragged contexts that end
mid-block, on a block boundary and at one token), the greedy sampling shortcut (``ModelRunner.fast_greedy``) against
``sample``, and the engine's greedy tokens the same with both on and off."""

from __future__ import annotations

import random

import torch

import minifer
from minifer import SamplingParams
from minifer.engine.decode_metadata import DecodeMetadataBuilder
from minifer.engine.runner import ModelRunner
from minifer.layers.paged_attention import PagedAttentionMetadata


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b


def test_decode_metadata_equals_the_general_build():
    rng = random.Random(0)
    builder = DecodeMetadataBuilder(16, torch.device("cpu"))
    for trial in range(20):
        b = rng.randint(1, 9)
        tables = [rng.sample(range(200), rng.randint(1, 6)) for _ in range(b)]
        ctx = [rng.choice([len(t) * 16, len(t) * 16 - rng.randint(1, 15), 1 + (len(t) - 1) * 16]) for t in tables]
        null = None if trial % 5 == 0 else 3200
        ref = PagedAttentionMetadata.build(tables, ctx, [1] * b, 16, torch.device("cpu"), null_slot=null)
        got = builder.build(tables, ctx, null)
        for field in ("slot_mapping", "num_tokens", "block_tables", "context_lens", "is_decode", "null_slot",
                      "covers_all_in_order", "query_lens"):
            _same(getattr(got, field), getattr(ref, field))
        assert len(got.groups) == len(ref.groups) == 1
        for field in ("key_slots", "key_valid", "mask", "query_index", "out_index", "query_valid", "num_seqs",
                      "num_queries", "num_keys", "is_decode"):
            _same(getattr(got.groups[0], field), getattr(ref.groups[0], field))


def test_engine_tokens_are_the_same_with_the_general_metadata(target_llm, monkeypatch):
    prompts = [{"prompt_token_ids": [(13 * i + j) % 2000 + 1 for j in range(5 + 9 * i)]} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    fast = [o.outputs[0].token_ids for o in target_llm.generate(prompts, params, use_tqdm=False)]
    calls = []
    real = DecodeMetadataBuilder.build
    monkeypatch.setattr(DecodeMetadataBuilder, "build", lambda self, *a: calls.append(1) or real(self, *a))
    assert [o.outputs[0].token_ids for o in target_llm.generate(prompts, params, use_tqdm=False)] == fast
    assert len(calls) > 30  # the decode steps did take the fast path
    monkeypatch.setattr(ModelRunner, "fast_decode_metadata", False)
    monkeypatch.setattr(ModelRunner, "fast_greedy", False)
    calls.clear()
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == fast and not calls


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
    from minifer.sampling import _plain_greedy

    assert _plain_greedy(SamplingParams(temperature=0))
    for kw in ({"temperature": 0.5}, {"logprobs": 0}, {"logit_bias": {3: 1.0}}, {"repetition_penalty": 1.2},
               {"min_tokens": 2}, {"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}):
        assert not _plain_greedy(SamplingParams(**{"temperature": 0, **kw})), kw
