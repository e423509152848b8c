"""The bucketed decode attention (``compilation_config={"decode_attention": "bucketed"}``, ``layers.decode_attention``)
against the padded reference a learner reads: the same attention output on random odd shapes over a poisoned cache,
and the same greedy float32 tokens through the engine (speed is measured by ``python -m minifer.bench cpu_peer``,
never here)."""

from __future__ import annotations

import random

import pytest
import torch

import minifer
from minifer import SamplingParams
from minifer.bench.decode_attention import shuffled_block_tables
from minifer.engine.decode_metadata import DecodeMetadataBuilder
from minifer.layers import decode_attention
from minifer.layers.decode_attention import BucketedDecodeIndexer, length_buckets
from minifer.layers.paged_attention import PagedAttentionMetadata, PagedKVCache


def _step(seed: int, mixed: bool):
    """A random step over a cache whose every slot but the step's sequences' holds NaN."""
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 3])
    hq, d, bs, b = hkv * rng.choice([1, 2, 4]), rng.choice([8, 12, 32]), rng.choice([1, 3, 5, 16]), rng.randint(1, 9)
    ctx = [rng.randint(1, 70) for _ in range(b)]
    qlens = [rng.randint(2, c) if mixed and c > 1 and rng.random() < 0.4 else 1 for c in ctx]
    tables, num_blocks = shuffled_block_tables(ctx, bs, rng, spare=3)
    cache = PagedKVCache(1, num_blocks, bs, hkv, d, torch.float32, "cpu")
    cache.k[:, :num_blocks] = float("nan")
    cache.v[:, :num_blocks] = float("nan")
    g = torch.Generator().manual_seed(seed)
    for t, c, n in zip(tables, ctx, qlens):  # the cached keys before this step's
        for p in range(c - n):
            cache.k[0, t[p // bs], p % bs] = torch.randn(hkv, d, generator=g)
            cache.v[0, t[p // bs], p % bs] = torch.randn(hkv, d, generator=g)
    n = sum(qlens)
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    return cache, tables, ctx, qlens, q, k, v


@pytest.mark.parametrize("mixed", [False, True], ids=["decode-only", "mixed"])
@pytest.mark.parametrize("seed", range(8))
def test_bucketed_attention_matches_the_reference_and_reads_no_stale_slot(seed, mixed):
    cache, tables, ctx, qlens, q, k, v = _step(seed, mixed)
    build = lambda: PagedAttentionMetadata.build(tables, ctx, qlens, cache.block_size, torch.device("cpu"),
                                                 null_slot=cache.null_slot)
    cache.meta = build()
    want = cache.attend(0, q, k, v)
    assert torch.isfinite(want).all()
    for cost in (0, 16, 512):  # 0: a bucket for every distinct length
        meta = build()
        BucketedDecodeIndexer(k.shape[1], k.shape[2], torch.float32, torch.device("cpu"), cost).attach(meta, ctx)
        assert (meta.decode_index is not None) == (1 in qlens)
        cache.meta = meta
        got = cache.attend(0, q, k, v)
        assert torch.isfinite(got).all()  # no NaN from a free slot reached the output
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_decode_only_metadata_of_the_fast_builder_gets_the_same_output():
    cache, tables, ctx, _, q, k, v = _step(3, mixed=False)
    cache.meta = PagedAttentionMetadata.build(tables, ctx, [1] * len(ctx), cache.block_size, torch.device("cpu"),
                                              null_slot=cache.null_slot)
    want = cache.attend(0, q, k, v)
    meta = DecodeMetadataBuilder(cache.block_size, torch.device("cpu")).build(tables, ctx, cache.null_slot)
    BucketedDecodeIndexer(k.shape[1], k.shape[2], torch.float32, torch.device("cpu"), 0).attach(meta, ctx)
    assert len(meta.decode_index.buckets) == len(set(ctx))
    cache.meta = meta
    torch.testing.assert_close(cache.attend(0, q, k, v), want, atol=2e-6, rtol=1e-5)


def test_length_buckets_cut_where_the_padding_saved_exceeds_a_call():
    assert length_buckets([5]) == ([0], [0])
    assert length_buckets([80, 100, 90], cost_keys=512) == ([1, 2, 0], [0])  # 10 x 2 + 20 padded keys: one bucket
    assert length_buckets([10, 300, 20], cost_keys=512) == ([1, 2, 0], [0, 1])  # 280 x 2 keys saved by a second
    assert length_buckets([10, 300, 20, 12, 9], cost_keys=512) == ([1, 2, 3, 0, 4], [0, 1])
    order, starts = length_buckets([3, 900, 64, 65, 7, 1], cost_keys=0)
    assert sorted(order) == list(range(6)) and starts == list(range(6))  # every distinct length its own bucket


def greedy(llm, prompts, n=24):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def bucket_counts(monkeypatch):
    """The number of buckets of every step that attended in buckets (so a test can check the lever ran)."""
    seen: list[int] = []
    real = BucketedDecodeIndexer.build

    def spy(self, *args, **kwargs):
        index = real(self, *args, **kwargs)
        seen.append(len(index.buckets))
        return index

    monkeypatch.setattr(BucketedDecodeIndexer, "build", spy)
    return seen


# one long prompt beside short ones: contexts hundreds of tokens apart, decode steps split in buckets, and more
# prompts than slots, so prompts are prefilled beside running decodes (mixed steps)
PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 2000 + 1 for j in range(n)]}
           for i, n in enumerate([300, 12, 20, 9, 40, 15, 150, 11, 33, 5])]


def test_greedy_tokens_identical_to_the_eager_engine(target_llm, bucket_counts):
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", max_num_seqs=6,
                      compilation_config={"decode_attention": "bucketed"})
    assert llm.engine.runner._decode_index is not None
    assert greedy(llm, PROMPTS) == greedy(target_llm, PROMPTS)
    assert max(bucket_counts) >= 2  # the lever did split steps: the identity is not the reference's alone


def test_greedy_tokens_identical_when_the_cache_preempts(bucket_counts):
    kw = dict(dtype="float32", device="cpu", max_num_seqs=10, block_size=4, max_num_batched_tokens=64)
    want = greedy(minifer.LLM("tinystories-target", num_kv_blocks=400, **kw), PROMPTS)
    tight = minifer.LLM("tinystories-target", num_kv_blocks=130, compilation_config={"decode_attention": "bucketed"},
                        **kw)
    assert greedy(tight, PROMPTS) == want
    assert tight.stats()["num_preemptions"] > 0 and bucket_counts


def test_greedy_tokens_identical_with_prefix_cache_hits(bucket_counts):
    system = [0] + list(range(100, 164))  # 65 tokens: 4 full blocks of 16, shared by every prompt
    prompts = [{"prompt_token_ids": system + [300 + i] * (1 + 9 * i)} for i in range(5)]
    cold = minifer.LLM("tinystories-target", dtype="float32", device="cpu", enable_prefix_caching=False)
    warm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", max_num_seqs=2,
                       compilation_config={"decode_attention": "bucketed"})
    assert greedy(warm, prompts) == greedy(cold, prompts)
    assert warm.stats()["prefix_cache_hit_rate"] > 0 and bucket_counts


@pytest.mark.parametrize("value, message", [("flat", "decode_attention must be one of"),
                                            (True, "decode_attention must be one of")])
def test_bad_decode_attention_is_named(value, message):
    with pytest.raises(ValueError, match=message):
        minifer.LLM("tinystories-draft", device="cpu", compilation_config={"decode_attention": value})


def test_padded_is_the_reference_and_8bit_caches_keep_it():
    llm = minifer.LLM("tinystories-draft", device="cpu", compilation_config={"decode_attention": "padded"})
    assert llm.engine.runner._decode_index is None
    int8 = minifer.LLM("tinystories-draft", device="cpu", kv_cache_dtype="int8",
                       compilation_config={"decode_attention": "bucketed"})
    assert int8.engine.runner._decode_index is None  # dequantized as gathered: the reference's path
    assert decode_attention.decode_indexer(int8.model, object()) is None  # a backend of its own attends its way


def test_composes_with_the_compiled_decoder_and_column_major_weights(tiny_checkpoint, bucket_counts):
    folder = tiny_checkpoint("qwen3")[1]  # a tiny two-layer model keeps the compilation short
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 90 + 1 for j in range(3 + 9 * i)]} for i in range(6)]
    eager = minifer.LLM(folder, dtype="float32", device="cpu", max_num_seqs=4)
    fast = minifer.LLM(folder, dtype="float32", device="cpu", max_num_seqs=4, compilation_config={
        "level": 3, "column_major_weights": True, "decode_attention": "bucketed"})
    assert fast.model.compiled is not None and fast.engine.runner._decode_index is not None
    fast.engine.runner._decode_index.cost_keys = 0  # contexts here are short: a bucket for every distinct length
    assert greedy(fast, prompts, n=12) == greedy(eager, prompts, n=12)
    assert max(bucket_counts) >= 2
