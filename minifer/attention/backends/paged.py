"""Attention over a paged KV cache (vLLM's PagedAttention), PyTorch reference — the CPU path.

Storage: per layer, ``k`` and ``v`` of shape ``[num_blocks, block_size, kv_heads, head_dim]``. A token at
position ``p`` of a sequence lives in slot ``table[p // block_size] * block_size + p % block_size``.

A step's batch is *ragged*: sequence ``i`` brings ``q_len[i]`` new tokens (a whole prompt, a prefill
chunk, or one decode token) on top of ``context_len[i] - q_len[i]`` tokens already cached. The new
tokens travel packed (``[N, heads, head_dim]``); ``PagedAttentionMetadata`` holds, once per step, what
every layer needs: where to write the new keys/values (``slot_mapping``) and, for reading, the slot of
every key of every sequence (gathered through the block tables) with the causal mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from minifer.attention.layer import AttentionBackend
from minifer.quantization.kv_cache import (bytes_per_value, check_kv_cache_dtype, code_dtype, dequantize_kv,
                                          quantize_kv, static_scale)


def slot_mapping(block_table: list[int] | torch.Tensor, positions: list[int] | torch.Tensor,
                 block_size: int) -> list[int] | torch.Tensor:
    """Cache slot of each token position: its block's id times ``block_size`` plus the offset inside the block.
    Either one sequence as Python lists (chapter 02's exercise writes this form; returns a list), or a batch as
    tensors, ``block_table`` ``[B, W]`` and ``positions`` ``[B, n]``, each row's positions looked up in its own table
    (returns ``[B, n]``). Every slot the engine writes or reads is computed here."""
    if not isinstance(block_table, torch.Tensor):
        table, pos = torch.tensor(block_table, dtype=torch.long), torch.tensor(positions, dtype=torch.long)
        return slot_mapping(table, pos, block_size).tolist()
    return block_table.gather(-1, positions // block_size) * block_size + positions % block_size


@dataclass
class AttentionGroup:
    """Sequences attended in one dense SDPA call, with every index it needs precomputed (once per step,
    not once per layer). Decodes form one group and prompt chunks another, so a mixed step does not pad
    every decode row to the longest chunk."""

    key_slots: torch.Tensor  # [b * S] cache slot of each key of each sequence (the null slot where masked)
    key_valid: torch.Tensor  # [b, S, 1, 1] False past each sequence's context
    mask: torch.Tensor  # [b, 1, T, S] True where query t may attend to key s
    query_index: torch.Tensor  # [b, T] index into the packed tokens (0 for padding)
    out_index: torch.Tensor  # [n] packed index of each real (non-padding) query, in [b, T] order
    query_valid: torch.Tensor  # [b, T]
    num_seqs: int
    num_queries: int  # T
    num_keys: int  # S
    is_decode: bool  # one new token per sequence: no padding, and GQA folds into the query axis


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [N] cache slot of each new token
    groups: list[AttentionGroup]
    num_tokens: int
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padded with 0), for the Triton kernels
    context_lens: torch.Tensor  # [B] int32
    is_decode: bool  # every sequence brings exactly one new token
    null_slot: int | None  # masked keys read this all-zero slot (no zeroing needed after the gather)
    covers_all_in_order: bool  # a single group whose outputs are the packed tokens in order
    query_lens: list[int] | None = None  # new tokens of each sequence (for a backend that attends sequence by sequence)

    @classmethod
    def decode_only(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    null_slot: int | None) -> "PagedAttentionMetadata":
        """What the Triton decode path reads, and nothing else (no host work: CUDA graphs replay it)."""
        return cls(slot_mapping, [], slot_mapping.shape[0], block_tables, context_lens, True, null_slot, True)

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device, null_slot: int | None = None) -> "PagedAttentionMetadata":
        """``context_lens[i]``: tokens of sequence i once this step's are added; ``query_lens[i]``: new ones.
        ``null_slot``: a cache slot that always holds zeros (``PagedKVCache`` keeps one); without it the
        reference zeroes masked keys after gathering them."""
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long, device=device)
        ctx = torch.tensor(context_lens, device=device)
        qlen = torch.tensor(query_lens, device=device)
        starts = torch.cumsum(qlen, 0) - qlen
        # the slot of every position of every sequence up to the longest context: its keys, its new tokens among them
        key_slots = slot_mapping(tables, torch.arange(max(context_lens), device=device).expand(len(tables), -1),
                                 block_size)
        num_tokens = sum(query_lens)
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens), device=device), qlen)
        pos = (ctx - qlen)[seq_of_token] + torch.arange(num_tokens, device=device) - starts[seq_of_token]
        groups = []
        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        chunk_rows = [i for i, n in enumerate(query_lens) if n > 1]
        for rows in (decode_rows, chunk_rows):
            if rows:
                r = slice(None) if len(rows) == len(query_lens) else rows
                longest = (max(query_lens[i] for i in rows), max(context_lens[i] for i in rows))
                groups.append(cls._group(key_slots[r], ctx[r], qlen[r], starts[r], longest, null_slot))
        in_order = len(groups) == 1 and (not chunk_rows or len(chunk_rows) == len(query_lens))
        return cls(key_slots[seq_of_token, pos], groups, num_tokens, tables.to(torch.int32),
                   ctx.to(torch.int32), not chunk_rows, null_slot, in_order, list(query_lens))

    @staticmethod
    def _group(key_slots: torch.Tensor, ctx: torch.Tensor, qlen: torch.Tensor, starts: torch.Tensor,
               longest: tuple[int, int], null_slot: int | None) -> AttentionGroup:
        """``key_slots``: ``[b, S]`` the slot of every position of the group's sequences (``S`` at least their
        longest context); ``longest``: their most new tokens and their longest context."""
        b = key_slots.shape[0]
        t_max, s_max = longest
        device = key_slots.device
        s = torch.arange(s_max, device=device)
        key_slots = key_slots[:, :s_max]
        key_valid = s[None, :] < ctx[:, None]  # [b, S]
        key_slots = torch.where(key_valid, key_slots, torch.full_like(key_slots, null_slot or 0))
        t = torch.arange(t_max, device=device)
        q_pos = (ctx - qlen)[:, None] + t[None, :]  # [b, T] position of each new token
        q_valid = t[None, :] < qlen[:, None]
        query_index = torch.where(q_valid, starts[:, None] + t[None, :], torch.zeros_like(q_pos))
        mask = key_valid[:, None, :] & (s[None, None, :] <= q_pos[:, :, None])  # [b, T, S]
        # padded query rows attend to key 0 so their (discarded) output stays finite
        mask = mask | (~q_valid[:, :, None] & (s[None, None, :] == 0))
        return AttentionGroup(key_slots.reshape(-1), key_valid[:, :, None, None], mask[:, None].contiguous(),
                              query_index, query_index[q_valid], q_valid, b, t_max, s_max, t_max == 1)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: PagedAttentionMetadata, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Attention of the packed new queries ``q`` ``[N, Hq, D]`` over the paged cache (already holding
    this step's keys/values). Gathers each sequence's keys through its block table into a padded
    ``[B, S, Hkv, D]`` tensor and runs dense masked attention; returns ``[N, Hq, D]``. A quantized cache
    (``kv_cache_dtype`` int8/fp8, chapter 05) passes its per-(token, head) scales, or its static per-head scales
    ``[Hkv]``, and is dequantized as it is gathered."""
    n, hq, d = q.shape
    hkv = k_cache.shape[-2]
    k_flat, v_flat = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    packed = None if meta.covers_all_in_order else torch.empty_like(q)
    for g in meta.groups:
        b, t, s = g.num_seqs, g.num_queries, g.num_keys
        keys = k_flat.index_select(0, g.key_slots).view(b, s, hkv, d)
        values = v_flat.index_select(0, g.key_slots).view(b, s, hkv, d)
        if k_scale is not None and k_scale.dim() == 1:  # static: one scale per head
            keys = dequantize_kv(keys, k_scale.view(1, 1, hkv), kv_cache_dtype, q.dtype)
            values = dequantize_kv(values, v_scale.view(1, 1, hkv), kv_cache_dtype, q.dtype)
        elif k_scale is not None:
            keys = dequantize_kv(keys, k_scale.reshape(-1, hkv).index_select(0, g.key_slots).view(b, s, hkv),
                                 kv_cache_dtype, q.dtype)
            values = dequantize_kv(values, v_scale.reshape(-1, hkv).index_select(0, g.key_slots).view(b, s, hkv),
                                   kv_cache_dtype, q.dtype)
        if meta.null_slot is None:
            # Slots past a sequence's end hold whatever an earlier owner left (even NaN): zero them, since
            # a masked score still multiplies its value (0 * NaN = NaN).
            keys, values = torch.where(g.key_valid, keys, 0), torch.where(g.key_valid, values, 0)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [b, Hkv, S, D]
        if g.is_decode:
            # One query per sequence: the Hq/Hkv query heads that share a KV head become that head's
            # "query positions" (same mask row), so SDPA needs no GQA expansion of the keys.
            qb = q.index_select(0, g.out_index).view(b, hkv, hq // hkv, d)
            out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=g.mask).reshape(b, hq, d)
        else:
            qb = q[g.query_index].transpose(1, 2)  # [b, Hq, T, D]
            out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=g.mask, enable_gqa=True)
            out = out.transpose(1, 2)[g.query_valid]
        if packed is None:
            return out
        packed[g.out_index] = out
    return packed


class PagedAttentionBackend(AttentionBackend, Protocol):
    """The engine's attention backend over a paged KV cache (chapter 02); ``PagedKVCache`` below is the reference.
    The engine builds one (``LLMEngine``'s ``attention_backend``) as ``backend(num_layers, num_blocks, block_size,
    num_kv_heads, head_dim, dtype, device, kv_cache_dtype, kv_cache_scales)``, sized in memory as ``PagedKVCache``.

    Before each forward the runner sets ``meta`` (a ``PagedAttentionMetadata``: every new token's slot
    ``block * block_size + offset``, every sequence's block table and context length), and clears it after;
    ``attend(layer, q, k, v)`` writes the step's keys and values into their slots and returns, for every new query,
    attention over its sequence's cached tokens up to its own position. Two blocks past ``num_blocks`` are the
    backend's own: padding rows write to ``scratch_slot`` (in block ``scratch_block``), and masked reads gather
    from ``null_slot``, which stays zero. ``calibrate_scales(run)`` runs ``run()`` once to set static 8-bit scales;
    ``use_triton`` says decode steps run the Triton kernels (and may be captured in CUDA graphs)."""

    block_size: int
    meta: PagedAttentionMetadata | None
    scratch_block: int
    scratch_slot: int
    null_slot: int
    kv_cache_dtype: str
    kv_cache_scales: str
    use_triton: bool

    def calibrate_scales(self, run_prefill: Callable[[], object]) -> None: ...


class PagedKVCache:
    """The preallocated block pool and an ``AttentionBackend`` over it for one step at a time."""

    RESERVED_BLOCKS = 2  # allocated beyond ``num_blocks`` and never handed out: the scratch and null blocks

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: str = "auto",
                 kv_cache_scales: str = "token") -> None:
        # Two extra blocks, never handed out. The last is the *null block*: all zeros; masked key positions
        # gather from it, so stale (even NaN) data in free blocks can never reach the output. The one
        # before is a *scratch block*: the padding rows of a CUDA-graph decode write there. The rest is
        # left uninitialised: the OS commits the pages only as blocks are first used.
        check_kv_cache_dtype(kv_cache_dtype, kv_cache_scales)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_cache_scales = kv_cache_scales if kv_cache_dtype != "auto" else "token"
        self.calibrating = False  # static scales: True during the start-up calibration pass
        shape = (num_layers, num_blocks + self.RESERVED_BLOCKS, block_size, num_kv_heads, head_dim)
        store = dtype if kv_cache_dtype == "auto" else code_dtype(kv_cache_dtype)
        self.k = torch.empty(shape, dtype=store, device=device)
        self.v = torch.empty(shape, dtype=store, device=device)
        self.k[:, num_blocks:].zero_()
        self.v[:, num_blocks:].zero_()
        self.k_scale = self.v_scale = None
        if kv_cache_dtype != "auto" and self.kv_cache_scales == "head":  # static: [layers, heads], set by calibration
            self.k_scale = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
        elif kv_cache_dtype != "auto":  # one float16 scale per (token, head); zero in the null block
            self.k_scale = torch.zeros(shape[:-1], dtype=torch.float16, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=torch.float16, device=device)
        self.scratch_block = num_blocks
        self.scratch_slot = num_blocks * block_size
        self.null_slot = (num_blocks + 1) * block_size
        self.block_size = block_size
        self.meta: PagedAttentionMetadata | None = None
        # On a GPU, decode steps use the Triton kernels (minifer/kernels/triton_attention.py); the
        # reference above is the CPU path and the oracle the kernels are tested against.
        from minifer.kernels import HAS_TRITON

        # An 8-bit cache too: the decode kernel dequantizes as it loads (the reference path, as it gathers).
        self.use_triton = HAS_TRITON and torch.device(device).type == "cuda"

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        kv_cache_dtype: str = "auto", kv_cache_scales: str = "token") -> int:
        per_value = bytes_per_value(kv_cache_dtype, dtype, head_dim, kv_cache_scales)
        return round(2 * num_layers * block_size * num_kv_heads * head_dim * per_value)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks, ``(source, destination)``, in every layer: keys, values and per-token scales (the
        copy-on-write of ``KVCacheManager.copy_on_write``). All sources are read before any destination is written."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.k.device)
        dst = torch.tensor([d for _, d in pairs], device=self.k.device)
        tensors = [self.k, self.v]
        if self.k_scale is not None and self.kv_cache_scales == "token":
            tensors += [self.k_scale, self.v_scale]
        for t in tensors:
            t[:, dst] = t[:, src]

    def calibrate_scales(self, run_prefill) -> None:
        """Static per-head scales: ``run_prefill()`` runs one forward over a calibration prompt from position 0;
        this records each layer's largest key and value magnitude per head, then fixes the scales from them."""
        if self.kv_cache_scales != "head":
            return
        self.k_scale.zero_()
        self.v_scale.zero_()
        self.calibrating = True
        try:
            run_prefill()
        finally:
            self.calibrating = False
        self.k_scale.copy_(static_scale(self.k_scale, self.kv_cache_dtype))
        self.v_scale.copy_(static_scale(self.v_scale, self.kv_cache_dtype))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this step's keys and values into their slots (``meta.slot_mapping``), then attend. Three paths,
        one per situation that needs its own:

        - a decode step on CUDA (``use_triton``): the Triton kernel walks each sequence's block table with an online
          softmax, reading only its context (an 8-bit cache dequantized in registers); it does no host work, so CUDA
          graphs capture it;
        - every other step (any step on the CPU, prompt chunks and verification on a GPU): the PyTorch reference
          gathers each sequence's keys into a padded batch for dense SDPA, dequantizing an 8-bit cache as it
          gathers; it is also the oracle the kernel is tested against;
        - the start-up pass that sets static 8-bit scales (``calibrating``): one prompt from position 0 whose own
          keys are all there are, attended causally while their magnitudes are recorded, before any scale exists
          to quantize them with."""
        if self.calibrating:
            return self._calibrate(layer, q, k, v)
        meta = self.meta
        scales = (None, None) if self.k_scale is None else (self.k_scale[layer], self.v_scale[layer])
        kernel = self.use_triton and meta.is_decode
        self._store(layer, k, v, meta.slot_mapping, kernel)
        if kernel:
            from minifer.kernels.triton_attention import paged_decode_attention

            return paged_decode_attention(q, self.k[layer], self.v[layer], meta.block_tables, meta.context_lens,
                                          *scales, self.kv_cache_dtype)
        return paged_attention_reference(q, self.k[layer], self.v[layer], meta, *scales, self.kv_cache_dtype)

    def _calibrate(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Record the largest key and value magnitude per head, and attend the prompt to itself."""
        for scales, x in ((self.k_scale, k), (self.v_scale, v)):
            scales[layer] = torch.maximum(scales[layer], x.float().abs().amax(dim=(0, 2)))
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kernel: bool) -> None:
        """Write new keys and values to their slots: as they are (``kernel``: with the Triton copy beside the decode
        kernel, vLLM's ``reshape_and_cache``), or as 8-bit codes, with the static per-head scales or each (token,
        head) with its own scale written beside it."""
        hkv, d = k.shape[1], k.shape[2]
        if self.kv_cache_dtype == "auto" and kernel:
            from minifer.kernels.triton_attention import store_kv

            store_kv(k, v, self.k[layer], self.v[layer], slot_mapping)
            return
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if self.kv_cache_dtype == "auto":
                codes = x
            elif self.kv_cache_scales == "head":
                codes, _ = quantize_kv(x, self.kv_cache_dtype, scales[layer])
            else:
                codes, scale = quantize_kv(x, self.kv_cache_dtype)
                scales[layer].view(-1, hkv).index_copy_(0, slot_mapping, scale)
            cache[layer].view(-1, hkv, d).index_copy_(0, slot_mapping, codes)
