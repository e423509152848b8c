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

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """Cache slot of each token position of one sequence: its block's id times ``block_size`` plus the
    offset inside the block. (``PagedAttentionMetadata.build`` does the same for a batch, in tensors.)"""
    return [block_table[p // block_size] * block_size + p % block_size for p in positions]


@dataclass
class PagedAttentionMetadata:
    slot_mapping: torch.Tensor  # [N] cache slot of each new token
    query_index: torch.Tensor  # [B, T] index into the packed tokens of each (sequence, new-token) pair
    query_valid: torch.Tensor  # [B, T] False for the padding of sequences with fewer new tokens
    key_slots: torch.Tensor  # [B, S] cache slot of each key of each sequence (0 where masked)
    key_valid: torch.Tensor  # [B, S] False past each sequence's context
    mask: torch.Tensor  # [B, 1, T, S] True where query t of sequence b may attend to key s
    num_tokens: int
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padded with 0), for the Triton kernels
    context_lens: torch.Tensor  # [B] int32
    is_decode: bool  # every sequence brings exactly one new token

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device) -> "PagedAttentionMetadata":
        """``context_lens[i]``: tokens of sequence i once this step's are added; ``query_lens[i]``: new ones."""
        b = len(context_lens)
        t_max, s_max = max(query_lens), max(context_lens)
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long, device=device)
        ctx = torch.tensor(context_lens, device=device)
        qlen = torch.tensor(query_lens, device=device)
        s = torch.arange(s_max, device=device)
        key_slots = tables.gather(1, (s // block_size).expand(b, -1).clamp(max=width - 1)) * block_size + s % block_size
        key_valid = s[None, :] < ctx[:, None]  # [B, S]
        key_slots = torch.where(key_valid, key_slots, torch.zeros_like(key_slots))
        t = torch.arange(t_max, device=device)
        q_pos = (ctx - qlen)[:, None] + t[None, :]  # [B, T] position of each new token
        q_valid = t[None, :] < qlen[:, None]
        starts = torch.cumsum(qlen, 0) - qlen
        query_index = torch.where(q_valid, starts[:, None] + t[None, :], torch.zeros_like(q_pos))
        mask = key_valid[:, None, :] & (s[None, None, :] <= q_pos[:, :, None])  # [B, T, S]
        # padded query rows attend to key 0 so their (discarded) output stays finite
        mask = mask | (~q_valid[:, :, None] & (s[None, None, :] == 0))
        slot_mapping = key_slots.gather(1, q_pos.clamp(max=s_max - 1))[q_valid]
        return cls(slot_mapping, query_index, q_valid, key_slots, key_valid, mask[:, None], int(qlen.sum()),
                   tables.to(torch.int32), ctx.to(torch.int32), t_max == 1)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: PagedAttentionMetadata) -> torch.Tensor:
    """Attention of the packed new queries ``q`` ``[N, Hq, D]`` over the paged cache (already holding
    this step's keys/values). Gathers each sequence's keys through its block table into a padded
    ``[B, Hkv, S, D]`` tensor and runs dense masked attention; returns ``[N, Hq, D]``."""
    n, hq, d = q.shape
    hkv = k_cache.shape[-2]
    k_flat, v_flat = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    # Slots past a sequence's end hold whatever an earlier owner left (even NaN): zero them, since a
    # masked score still multiplies its value (0 * NaN = NaN).
    valid = meta.key_valid[:, :, None, None]
    keys = torch.where(valid, k_flat[meta.key_slots], 0).transpose(1, 2)  # [B, Hkv, S, D]
    values = torch.where(valid, v_flat[meta.key_slots], 0).transpose(1, 2)
    qb = q[meta.query_index].transpose(1, 2)  # [B, Hq, T, D]
    out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=meta.mask, enable_gqa=True)
    out = out.transpose(1, 2)  # [B, T, Hq, D]
    packed = torch.empty_like(q)
    packed[meta.query_index[meta.query_valid]] = out[meta.query_valid]
    return packed


class PagedKVCache:
    """The preallocated block pool and an ``AttentionBackend`` over it for one step at a time."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Uninitialised on purpose: attention never reads a slot before it is written (masked slots are
        # zeroed after the gather), and the OS commits the pages only as blocks are first used.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.meta: PagedAttentionMetadata | None = None
        # On a GPU, decode steps use the Triton kernels (minifer/kernels/paged_attention.py); the
        # reference above is the CPU path and the oracle the kernels are tested against.
        from minifer.kernels import HAS_TRITON

        self.use_triton = HAS_TRITON and torch.device(device).type == "cuda"

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        hkv, d = k.shape[1], k.shape[2]
        if self.use_triton and meta.is_decode:
            from minifer.kernels.paged_attention import paged_decode_attention, store_kv

            store_kv(k, v, self.k[layer], self.v[layer], meta.slot_mapping)
            return paged_decode_attention(q, self.k[layer], self.v[layer], meta.block_tables, meta.context_lens)
        self.k[layer].view(-1, hkv, d)[meta.slot_mapping] = k
        self.v[layer].view(-1, hkv, d)[meta.slot_mapping] = v
        return paged_attention_reference(q, self.k[layer], self.v[layer], meta)
