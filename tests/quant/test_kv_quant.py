"""The 8-bit KV cache: codes and scales round-trip within their step, attention over a quantized paged
cache equals attention over the dequantized values, the engine keeps (nearly) the same greedy tokens and
all its invariants, and the memory it saves is what the format promises."""

from __future__ import annotations

import pytest
import torch

from minifer import LLM, SamplingParams
from minifer_course.kv_quant import sequences_that_fit
from minifer.quantization.kv_cache import dequantize_kv, quantize_kv
from minifer.attention.backends.paged import PagedAttentionMetadata, PagedKVCache, paged_attention_reference


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


def test_engine_with_int8_kv_is_closer_than_fp8_and_keeps_its_invariants_under_preemption(heldout_stories):
    """int8 codes carry 7 bits of mantissa against fp8's 3: teacher-forced through the cache (float32 weights,
    a float32-cache reference continuation), its error must be well under fp8's, measured in the same run. A
    cache too small for the batch then preempts and recomputes, and must end with every block free."""
    prompts = [" ".join(s.split()[:8]) for s in heldout_stories[:12]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = LLM("tinystories-target", dtype=torch.float32)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in ref.generate(prompts[:6], params, use_tqdm=False)]
    want = _teacher_forced_logprobs(ref, seqs)
    err = {fmt: (_teacher_forced_logprobs(LLM("tinystories-target", dtype=torch.float32, kv_cache_dtype=fmt,
                                              share_weights_with=ref), seqs) - want).abs().mean().item()
           for fmt in ("int8", "fp8")}
    assert 0 < err["int8"] <= 0.5 * err["fp8"], err
    tight = LLM("tinystories-target", kv_cache_dtype="int8", block_size=4, num_kv_blocks=60, max_num_seqs=12,
                share_weights_with=ref)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    stats = tight.stats()
    assert stats["kv_cache_dtype"] == "int8" and stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    tight.engine.kv_cache_manager.check_invariants()


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


def _teacher_forced_logprobs(llm, token_ids: list[list[int]]) -> torch.Tensor:
    """Each token's log-probability given the tokens before it, read through ``llm``'s paged cache.

    Prefill attention reads the keys and values back from the cache, so a quantized cache changes every
    position after the first; teacher forcing keeps every format on the same tokens (a free-running
    comparison would diverge at the first flipped argmax and then compare unrelated continuations)."""
    outs = llm.generate([{"prompt_token_ids": ids} for ids in token_ids],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([lp[t].logprob for o, ids in zip(outs, token_ids)
                         for lp, t in zip(o.prompt_logprobs[1:], ids[1:])])


def _within_control(err: float, control: float, factor: float = 2.0) -> bool:
    """The static-scale cache may cost at most ``factor`` times the per-token-scale cache's error."""
    return err <= factor * control


def test_static_fp8_kv_doubles_what_fits_and_costs_at_most_twice_the_per_token_error(heldout_stories):
    """Only the cache's format differs: float32 weights, a float32-cache reference continuation, and the error
    of each 8-bit cache measured teacher-forced against the float32 cache in the same run. Per-token fp8
    scales are the control; static per-head scales (half the scale bytes, calibrated once) must stay within
    twice its error, and a zeroed or saturated static cache must fail that same check. (Free-running greedy
    agreement depends on where the first near-tie falls and is reported by ``minifer_course.kv_quant``.)"""
    prompts = [" ".join(s.split()[:8]) for s in heldout_stories[:8]]
    budget = dict(dtype=torch.float32, kv_cache_memory=2**24)
    ref = LLM("tinystories-target", **budget)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    want = _teacher_forced_logprobs(ref, seqs)

    per_token = LLM("tinystories-target", kv_cache_dtype="fp8", kv_cache_scales="token", share_weights_with=ref, **budget)
    static = LLM("tinystories-target", kv_cache_dtype="fp8", kv_cache_scales="head", share_weights_with=ref, **budget)
    # fp8 doubles what fits against a bf16 cache, the format it replaces in practice (float32's is 4x)
    bf16 = {k: LLM("tinystories-target", dtype=torch.bfloat16, kv_cache_memory=2**24, **extra).stats()["kv_blocks_total"]
            for k, extra in (("auto", {}), ("fp8", dict(kv_cache_dtype="fp8", kv_cache_scales="head")))}
    reserved = 2  # the scratch and null blocks each cache allocates from the same budget
    assert bf16["fp8"] + reserved == 2 * (bf16["auto"] + reserved)
    scales = static.engine.kv_cache.k_scale
    assert torch.isfinite(scales).all() and (scales > 0).all() and (scales != 1).all()  # calibrated, not defaults

    control = (_teacher_forced_logprobs(per_token, seqs) - want).abs().mean().item()
    err = (_teacher_forced_logprobs(static, seqs) - want).abs().mean().item()
    assert 0 < control < 0.1, control  # fp8 is lossy, and a few hundredths of a nat on average
    assert _within_control(err, control), (err, control)
    assert static.stats()["kv_blocks_free"] == static.stats()["kv_blocks_total"]

    # The same check must catch a broken cache: scales 10^6 too large put every value under fp8's smallest
    # subnormal (zeros), scales 1000x too small saturate the codes at fp8's largest value.
    cache = static.engine.kv_cache
    calibrated = cache.k_scale.clone(), cache.v_scale.clone()
    for factor in (1e6, 1e-3):
        cache.k_scale.copy_(calibrated[0] * factor)
        cache.v_scale.copy_(calibrated[1] * factor)
        broken = (_teacher_forced_logprobs(static, seqs) - want).abs().mean().item()
        assert not _within_control(broken, control), (factor, broken, control)
    with pytest.raises(ValueError, match="kv_cache_scales"):
        LLM("tinystories-target", kv_cache_dtype="int8", kv_cache_scales="block")


def test_kv_quant_benchmark_table_has_both_scale_layouts():
    from minifer_course.kv_quant import memory_table
    from minifer.model_loader import load_config, resolve_model

    cfg = load_config(resolve_model("Qwen/Qwen3-0.6B", need_weights=False))
    rows = {(r["model_dtype"], r["kv_cache_dtype"], r["kv_cache_scales"]): r
            for r in memory_table(cfg, [300] * 4000, budget=2**32)}
    auto = rows["bfloat16", "auto", None]
    assert rows["bfloat16", "int8", "head"]["bytes_per_token"] * 2 == auto["bytes_per_token"]
    assert rows["bfloat16", "fp8", "head"]["vs_model_dtype"] >= 1.99  # whole blocks: doubles within rounding
    assert 1.9 < rows["bfloat16", "int8", "token"]["vs_model_dtype"] < 1.99
