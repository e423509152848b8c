"""The 8-bit KV cache: codes and scales round-trip within their step, attention over a quantized paged
cache equals attention over the dequantized values, the engine keeps (nearly) the same greedy tokens and
all its invariants, and the memory it saves is what the format promises."""

from __future__ import annotations

import pytest
import torch

from minifer import LLM, SamplingParams
from minifer.bench.kv_quant import sequences_that_fit
from minifer.layers.kv_quant import dequantize_kv, quantize_kv
from minifer.layers.paged_attention import PagedAttentionMetadata, PagedKVCache, paged_attention_reference


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_round_trip_error_is_within_the_format(fmt):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 24, generator=gen) * torch.logspace(-3, 2, 37)[:, None, None]
    x[5] = 0  # an all-zero token keeps a valid scale and decodes to zeros
    codes, scales = quantize_kv(x, fmt)
    assert codes.shape == x.shape and scales.shape == x.shape[:2] and scales.dtype == torch.float16
    back = dequantize_kv(codes, scales, fmt, torch.float32)
    assert torch.all(back[5] == 0)
    absmax = x.abs().amax(-1, keepdim=True)
    # int8: half a step of absmax/127; e4m3: 3 mantissa bits, relative 2^-4 of the value; plus the fp16
    # rounding of the scale, and a step of at least the smallest scale (2^-14) for tiny tokens
    step = torch.clamp(absmax / 127 if fmt == "int8" else absmax / 448, min=2**-14)
    bound = step * 0.51 if fmt == "int8" else x.abs() / 16 + step * 2**-9
    assert torch.all((back - x).abs() <= bound + absmax * 2e-3 + 1e-7)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_paged_attention_over_a_quantized_cache(fmt):
    gen = torch.Generator().manual_seed(1)
    block_size, hq, hkv, d = 4, 6, 2, 16
    ctx, qlen = [9, 5, 13], [1, 5, 3]
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    cache = PagedKVCache(1, 9, block_size, hkv, d, torch.float32, "cpu", kv_cache_dtype=fmt)
    meta = PagedAttentionMetadata.build(tables, ctx, qlen, block_size, torch.device("cpu"), null_slot=cache.null_slot)
    k = torch.randn(sum(ctx), hkv, d, generator=gen)
    v = torch.randn(sum(ctx), hkv, d, generator=gen)
    # write the whole context through the cache's own path, then attend with the last qlen tokens as queries
    all_meta = PagedAttentionMetadata.build(tables, ctx, ctx, block_size, torch.device("cpu"), null_slot=cache.null_slot)
    cache.meta = all_meta
    cache.attend(0, torch.randn(sum(ctx), hq, d), k, v)
    q = torch.randn(sum(qlen), hq, d, generator=gen)
    got = paged_attention_reference(q, cache.k[0], cache.v[0], meta, cache.k_scale[0], cache.v_scale[0], fmt)
    # the oracle: a float cache holding the dequantized values
    want = _attention_over(q, meta, all_meta.slot_mapping, 9, block_size,
                           *(dequantize_kv(*quantize_kv(x, fmt), fmt, torch.float32) for x in (k, v)))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def _attention_over(q, meta, slots, num_blocks, block_size, keys, values):
    """Attention over a float paged cache holding ``keys``/``values`` ``[N, Hkv, D]`` at ``slots``."""
    hkv, d = keys.shape[1:]
    dense = PagedKVCache(1, num_blocks, block_size, hkv, d, torch.float32, "cpu")
    dense.k[0].view(-1, hkv, d).index_copy_(0, slots, keys)
    dense.v[0].view(-1, hkv, d).index_copy_(0, slots, values)
    return paged_attention_reference(q, dense.k[0], dense.v[0], meta)


def test_engine_with_int8_kv_keeps_the_tokens_and_invariants(heldout_stories):
    prompts = [" ".join(s.split()[:8]) for s in heldout_stories[:12]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM("tinystories-target").generate(prompts, params, use_tqdm=False)]
    tight = LLM("tinystories-target", kv_cache_dtype="int8", block_size=4, num_kv_blocks=60, max_num_seqs=12)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    agree = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) / sum(map(len, want))
    assert agree >= 0.95, agree  # measured 0.99 on 32 held-out openings (benchmarks/results/kv_quant.json)
    stats = tight.stats()
    assert stats["kv_cache_dtype"] == "int8" and stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    tight.engine.block_manager.check_invariants()


def test_int8_kv_nearly_doubles_what_fits():
    for head_dim, at_least in ((32, 1.88), (128, 1.96)):  # the scales cost 2 bytes per head_dim codes
        bf16 = PagedKVCache.bytes_per_block(28, 16, 8, head_dim, torch.bfloat16)
        int8 = PagedKVCache.bytes_per_block(28, 16, 8, head_dim, torch.bfloat16, "int8")
        assert bf16 / int8 >= at_least
        lengths = [300] * 10_000
        assert sequences_that_fit(int8, 16, lengths, 2**30) >= at_least * 0.99 * sequences_that_fit(bf16, 16, lengths, 2**30)
    llm_auto = LLM("tinystories-target", kv_cache_memory=2**24)
    llm_int8 = LLM("tinystories-target", kv_cache_memory=2**24, kv_cache_dtype="int8")
    assert llm_int8.stats()["kv_blocks_total"] >= 3.5 * llm_auto.stats()["kv_blocks_total"]  # vs float32 on CPU


def test_bad_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("tinystories-target", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="continuous"):
        LLM("tinystories-target", batching="static", kv_cache_dtype="int8")


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_static_per_head_scales_saturate_and_attend_like_the_dequantized_values(fmt):
    gen = torch.Generator().manual_seed(2)
    block_size, hq, hkv, d = 4, 4, 2, 16
    ctx, qlen = [7, 12], [2, 1]
    tables = [[0, 1], [2, 3, 4]]
    cache = PagedKVCache(1, 6, block_size, hkv, d, torch.float32, "cpu", kv_cache_dtype=fmt, kv_cache_scales="head")
    assert cache.k_scale.shape == (1, hkv) and PagedKVCache.bytes_per_block(
        1, block_size, hkv, d, torch.float32, fmt, "head") == 2 * block_size * hkv * d  # one byte per number
    # calibration: a prefill of 5 tokens from position 0 records each head's largest magnitude
    calib_k, calib_v = torch.randn(5, hkv, d, generator=gen), torch.randn(5, hkv, d, generator=gen)
    cal_meta = PagedAttentionMetadata.build([[4, 5]], [5], [5], block_size, torch.device("cpu"), null_slot=cache.null_slot)

    def prefill():
        cache.meta = cal_meta
        out = cache.attend(0, torch.randn(5, hq, d, generator=gen), calib_k, calib_v)
        assert out.shape == (5, hq, d) and torch.isfinite(out).all()

    cache.calibrate_scales(prefill)
    qmax = 127.0 if fmt == "int8" else 448.0
    assert torch.allclose(cache.k_scale[0], calib_k.abs().amax(dim=(0, 2)) * 2 / qmax)
    # write a context with an outlier 10x beyond the calibrated range: it saturates at the range's edge
    k = torch.randn(sum(ctx), hkv, d, generator=gen)
    v = torch.randn(sum(ctx), hkv, d, generator=gen)
    k[3, 1, 0] = 10 * float(calib_k[:, 1].abs().max())
    all_meta = PagedAttentionMetadata.build(tables, ctx, ctx, block_size, torch.device("cpu"), null_slot=cache.null_slot)
    cache.meta = all_meta
    cache.attend(0, torch.randn(sum(ctx), hq, d), k, v)
    stored = dequantize_kv(cache.k[0].view(-1, hkv, d)[all_meta.slot_mapping], cache.k_scale[0].view(1, hkv), fmt,
                           torch.float32)
    assert stored[3, 1, 0] == pytest.approx(float(cache.k_scale[0, 1]) * qmax, rel=1e-6)
    # attention over the codes equals attention over a float cache holding their dequantized values
    meta = PagedAttentionMetadata.build(tables, ctx, qlen, block_size, torch.device("cpu"), null_slot=cache.null_slot)
    q = torch.randn(sum(qlen), hq, d, generator=gen)
    got = paged_attention_reference(q, cache.k[0], cache.v[0], meta, cache.k_scale[0], cache.v_scale[0], fmt)
    slots = all_meta.slot_mapping
    want = _attention_over(q, meta, slots, 6, block_size,
                           *(dequantize_kv(codes[0].view(-1, hkv, d)[slots], scale[0].view(1, hkv), fmt, torch.float32)
                             for codes, scale in ((cache.k, cache.k_scale), (cache.v, cache.v_scale))))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_engine_with_static_fp8_kv_doubles_what_fits_and_keeps_the_tokens(heldout_stories):
    prompts = [" ".join(s.split()[:8]) for s in heldout_stories[:12]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm = LLM("tinystories-target", kv_cache_dtype="fp8", kv_cache_scales="head", dtype=torch.bfloat16,
              kv_cache_memory=2**24)
    bf16 = LLM("tinystories-target", dtype=torch.bfloat16, kv_cache_memory=2**24)
    # The reference is the same bf16 model with a bf16 cache, so that only the cache's format differs: against
    # float32, bf16's own rounding already changes greedy paths (on one Intel Xeon 78% of bf16's tokens matched
    # float32's, on an AMD EPYC more), which would make the bound depend on the CPU's bf16 kernels.
    want = [o.outputs[0].token_ids for o in bf16.generate(prompts, params, use_tqdm=False)]
    reserved = 2  # the scratch and null blocks each cache allocates from the same budget
    assert llm.stats()["kv_blocks_total"] + reserved == 2 * (bf16.stats()["kv_blocks_total"] + reserved)
    scales = llm.engine.kv_cache.k_scale
    assert torch.isfinite(scales).all() and (scales > 0).all() and (scales != 1).all()  # calibrated, not defaults
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    agree = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) / sum(map(len, want))
    assert agree >= 0.75, agree  # 0.83 measured (Intel Xeon); a cache of saturated or zeroed codes gives far less
    assert llm.stats()["kv_cache_scales"] == "head" and llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    with pytest.raises(ValueError, match="kv_cache_scales"):
        LLM("tinystories-target", kv_cache_dtype="int8", kv_cache_scales="block")


def test_kv_quant_benchmark_table_has_both_scale_layouts():
    from minifer.bench.kv_quant import memory_table
    from minifer.loader import load_config, resolve_model

    cfg = load_config(resolve_model("Qwen/Qwen3-0.6B", need_weights=False))
    rows = {(r["model_dtype"], r["kv_cache_dtype"], r["kv_cache_scales"]): r
            for r in memory_table(cfg, [300] * 4000, budget=2**32)}
    auto = rows["bfloat16", "auto", None]
    assert rows["bfloat16", "int8", "head"]["bytes_per_token"] * 2 == auto["bytes_per_token"]
    assert rows["bfloat16", "fp8", "head"]["vs_model_dtype"] >= 1.99  # whole blocks: doubles within rounding
    assert 1.9 < rows["bfloat16", "int8", "token"]["vs_model_dtype"] < 1.99
