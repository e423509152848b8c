"""Paged-attention kernels in Triton: write new K/V into their cache slots, and decode attention.

Both follow the reference in ``minifer/layers/paged_attention.py``; ``tests/test_kernels.py`` checks
them against it under the interpreter on random and odd shapes, and ``aot.py`` compiles them for sm_80
and sm_90.

Decode attention (one new query per sequence) is where paging matters most: a program handles one
(sequence, KV head) pair and walks that sequence's block table, loading one KV block of ``block_size``
tokens at a time and keeping an *online softmax* (running max and sum, as in FlashAttention), so the
whole context never has to sit in memory at once. All query heads that share the KV head (GQA) are
processed by the same program, so each K/V block is read once for the whole group — decode is
bandwidth-bound, and that re-use is the point of grouped-query attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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


@triton.jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, ctx_ptr, out_ptr, scale,
                        table_stride, HKV: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                        D: tl.constexpr, D_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, BS_P2: tl.constexpr):
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
        base = (block * BLOCK_SIZE + t)[:, None] * (HKV * D) + kvh * D + d[None, :]
        kv_mask = tm[:, None] & dm[None, :]
        k = tl.load(k_cache_ptr + base, mask=kv_mask, other=0.0).to(tl.float32)  # [BS, D]
        v = tl.load(v_cache_ptr + base, mask=kv_mask, other=0.0).to(tl.float32)
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
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """One query per sequence. ``q``: ``[B, Hq, D]``; caches ``[num_blocks, block_size, Hkv, D]``;
    ``block_tables``: ``[B, max_blocks]`` int32/int64; ``context_lens``: ``[B]`` (>= 1). Returns ``[B, Hq, D]``."""
    b, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    group = hq // hkv
    out = torch.empty_like(q)
    paged_decode_kernel[(b, hkv)](
        q.contiguous(), k_cache, v_cache, block_tables, context_lens, out, d ** -0.5, block_tables.stride(0),
        HKV=hkv, GROUP=group, GROUP_P2=max(triton.next_power_of_2(group), 1), D=d, D_P2=triton.next_power_of_2(d),
        BLOCK_SIZE=block_size, BS_P2=triton.next_power_of_2(block_size))
    return out
