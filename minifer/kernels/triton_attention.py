"""Paged attention in Triton: new K/V into their cache slots (vLLM's ``reshape_and_cache``), and decode attention
over block tables (vLLM's ``paged_attention``), both matching the reference in ``minifer/attention/backends/paged.py``.

Decode (one new query per sequence) is where paging matters most. A program takes one (sequence, KV head) pair
and walks the sequence's block table one block of ``block_size`` tokens at a time, keeping an *online softmax*
(running max and sum, as in FlashAttention), so the whole context never has to sit in memory at once. The query
heads that share the KV head (GQA) run in the same program, so each K/V block is read once for the group: decode
is bandwidth-bound, and that re-use is the point of grouped-query attention.

An 8-bit cache (``kv_cache_dtype="int8"`` or ``"fp8"``, ``minifer/quantization/kv_cache.py``) goes through the same
kernel, one byte per number dequantized in registers (``codes * scale``: a scale per token and head, or one static
scale per head), so a step reads half the bytes of a 16-bit cache. PyTorch quantizes and writes the new tokens.

Chapter 02 (the 8-bit cache: chapter 05); tests: ``tests/kernels/test_kernels.py``, under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minifer.kernels.fp8 import fp8_native, fp8_to_f32


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, row: tl.constexpr, BLOCK: tl.constexpr):
    """Copy token ``i``'s keys and values (``row = kv_heads * head_dim`` numbers each) to its slot."""
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < row
    tl.store(k_cache_ptr + slot * row + offs, tl.load(k_ptr + i * row + offs, mask=m), mask=m)
    tl.store(v_cache_ptr + slot * row + offs, tl.load(v_ptr + i * row + offs, mask=m), mask=m)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``k``, ``v``: ``[N, Hkv, D]`` (contiguous); caches ``[num_blocks, block_size, Hkv, D]``."""
    n, hkv, d = k.shape
    row = hkv * d
    store_kv_kernel[(n,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping, row=row,
                          BLOCK=triton.next_power_of_2(row))


KV_FLOAT, KV_INT8, KV_FP8 = 0, 1, 2  # what the cache holds: the model's floats, int8 codes, fp8 e4m3 bits
SCALES_NONE, SCALES_TOKEN, SCALES_HEAD = 0, 1, 2  # float16 [blocks, block_size, Hkv] | float32 [Hkv]


@triton.jit
def _load_kv(cache_ptr, scale_ptr, base, slots, kvh, kv_mask, tm, HKV: tl.constexpr, KV: tl.constexpr,
             SCALES: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """One block's keys or values ``[BS, D]`` in float32: loaded as stored, dequantized in registers."""
    x = tl.load(cache_ptr + base, mask=kv_mask, other=0)
    if KV == 2:
        f = fp8_to_f32(x, FP8_NATIVE)
        if not FP8_NATIVE:
            f = f * 256.0  # the bit-level decode gives the value times 2^-8
    else:
        f = x.to(tl.float32)
    if SCALES == 1:
        f = f * tl.load(scale_ptr + slots * HKV + kvh, mask=tm, other=0.0).to(tl.float32)[:, None]
    elif SCALES == 2:
        f = f * tl.load(scale_ptr + kvh)
    return f


@triton.jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, ctx_ptr, out_ptr, scale,
                        table_stride, k_scale_ptr, v_scale_ptr, HKV: tl.constexpr, GROUP: tl.constexpr,
                        GROUP_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BS_P2: tl.constexpr, KV: tl.constexpr = 0, SCALES: tl.constexpr = 0,
                        FP8_NATIVE: tl.constexpr = False):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, D_P2)
    t = tl.arange(0, BS_P2)
    gm, dm = g < GROUP, d < D
    heads = kvh * GROUP + g  # the query heads that read this KV head
    q = tl.load(q_ptr + (b * HKV * GROUP + heads)[:, None] * D + d[None, :], mask=gm[:, None] & dm[None, :],
                other=0.0).to(tl.float32)
    m_i = tl.full((GROUP_P2,), float("-inf"), tl.float32)
    l_i = tl.zeros((GROUP_P2,), tl.float32)
    acc = tl.zeros((GROUP_P2, D_P2), tl.float32)
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    for i in range(0, num_blocks):
        block = tl.load(tables_ptr + b * table_stride + i).to(tl.int64)
        pos = i * BLOCK_SIZE + t
        tm = (t < BLOCK_SIZE) & (pos < ctx)
        slots = block * BLOCK_SIZE + t
        base = slots[:, None] * (HKV * D) + kvh * D + d[None, :]
        kv_mask = tm[:, None] & dm[None, :]
        k = _load_kv(k_cache_ptr, k_scale_ptr, base, slots, kvh, kv_mask, tm, HKV, KV, SCALES, FP8_NATIVE)  # [BS, D]
        v = _load_kv(v_cache_ptr, v_scale_ptr, base, slots, kvh, kv_mask, tm, HKV, KV, SCALES, FP8_NATIVE)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BS]
        s = tl.where(tm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (b * HKV * GROUP + heads)[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=gm[:, None] & dm[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           kv_cache_dtype: str = "auto") -> torch.Tensor:
    """One query per sequence. ``q``: ``[B, Hq, D]``; caches ``[num_blocks, block_size, Hkv, D]``;
    ``block_tables``: ``[B, max_blocks]`` int32/int64; ``context_lens``: ``[B]`` (>= 1). Returns ``[B, Hq, D]``.

    An 8-bit cache (``kv_cache_dtype`` ``"int8"``: int8 codes, ``"fp8"``: e4m3 bits as uint8) comes with its
    scales: float16 ``[num_blocks, block_size, Hkv]`` (one per token and head) or float32 ``[Hkv]`` (static)."""
    b, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    kv, scales = _cache_format(k_cache, k_scale, v_scale, kv_cache_dtype)
    if kv == KV_FP8:
        k_cache, v_cache = k_cache.view(torch.int8), v_cache.view(torch.int8)  # the bit decode wants signed bytes
    native = kv == KV_FP8 and fp8_native(k_cache.device)
    group = hq // hkv
    out = torch.empty_like(q)
    paged_decode_kernel[(b, hkv)](
        q.contiguous(), k_cache, v_cache, block_tables, context_lens, out, d ** -0.5, block_tables.stride(0),
        k_cache if k_scale is None else k_scale, v_cache if v_scale is None else v_scale,  # unread without scales
        HKV=hkv, GROUP=group, GROUP_P2=max(triton.next_power_of_2(group), 1), D=d, D_P2=triton.next_power_of_2(d),
        BLOCK_SIZE=block_size, BS_P2=triton.next_power_of_2(block_size), KV=kv, SCALES=scales, FP8_NATIVE=native)
    return out


def _cache_format(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                  kv_cache_dtype: str) -> tuple[int, int]:
    """The kernel's ``KV`` and ``SCALES`` for a cache and its scales, or a ValueError naming the mismatch."""
    if kv_cache_dtype == "auto":
        if k_scale is not None or v_scale is not None:
            raise ValueError("a 16/32-bit cache (kv_cache_dtype='auto') takes no scales")
        return KV_FLOAT, SCALES_NONE
    want = {"int8": torch.int8, "fp8": torch.uint8}.get(kv_cache_dtype)
    if want is None or k_cache.dtype != want:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a cache of {want}, got {k_cache.dtype}")
    if k_scale is None or v_scale is None or k_scale.shape != v_scale.shape:
        raise ValueError("an 8-bit cache needs k_scale and v_scale of one shape")
    if k_scale.shape == k_cache.shape[:-1] and k_scale.dtype == torch.float16:
        scales = SCALES_TOKEN
    elif k_scale.shape == k_cache.shape[2:3] and k_scale.dtype == torch.float32:
        scales = SCALES_HEAD
    else:
        raise ValueError(f"scales must be float16 {tuple(k_cache.shape[:-1])} (per token and head) or float32 "
                         f"({k_cache.shape[2]},) (per head), got {k_scale.dtype} {tuple(k_scale.shape)}")
    if not (k_scale.is_contiguous() and v_scale.is_contiguous()):
        raise ValueError("k_scale and v_scale must be contiguous")
    return (KV_INT8 if kv_cache_dtype == "int8" else KV_FP8), scales
