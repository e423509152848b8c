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
    # Sequences attended together: decodes in one group, prompt chunks in another, so a mixed step does
    # not pad every decode row to the longest chunk. Each: (batch rows, new tokens T, context S).
    groups: list[tuple[torch.Tensor, int, int]]
    null_slot: int | None  # masked keys read this all-zero slot (no zeroing needed after the gather)

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device, null_slot: int | None = None) -> "PagedAttentionMetadata":
        """``context_lens[i]``: tokens of sequence i once this step's are added; ``query_lens[i]``: new ones.
        ``null_slot``: a cache slot that always holds zeros (``PagedKVCache`` keeps one); without it the
        reference zeroes masked keys after gathering them."""
        b = len(context_lens)
        t_max, s_max = max(query_lens), max(context_lens)
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long, device=device)
        ctx = torch.tensor(context_lens, device=device)
        qlen = torch.tensor(query_lens, device=device)
        s = torch.arange(s_max, device=device)
        key_slots = tables.gather(1, (s // block_size).expand(b, -1).clamp(max=width - 1)) * block_size + s % block_size
        key_valid = s[None, :] < ctx[:, None]  # [B, S]
        key_slots = torch.where(key_valid, key_slots, torch.full_like(key_slots, null_slot or 0))
        t = torch.arange(t_max, device=device)
        q_pos = (ctx - qlen)[:, None] + t[None, :]  # [B, T] position of each new token
        q_valid = t[None, :] < qlen[:, None]
        starts = torch.cumsum(qlen, 0) - qlen
        query_index = torch.where(q_valid, starts[:, None] + t[None, :], torch.zeros_like(q_pos))
        mask = key_valid[:, None, :] & (s[None, None, :] <= q_pos[:, :, None])  # [B, T, S]
        # padded query rows attend to key 0 so their (discarded) output stays finite
        mask = mask | (~q_valid[:, :, None] & (s[None, None, :] == 0))
        slot_mapping = key_slots.gather(1, q_pos.clamp(max=s_max - 1))[q_valid]
        groups = []
        for rows in ([i for i, n in enumerate(query_lens) if n == 1], [i for i, n in enumerate(query_lens) if n > 1]):
            if rows:
                groups.append((torch.tensor(rows, device=device), max(query_lens[i] for i in rows),
                               max(context_lens[i] for i in rows)))
        return cls(slot_mapping, query_index, q_valid, key_slots, key_valid, mask[:, None], int(qlen.sum()),
                   tables.to(torch.int32), ctx.to(torch.int32), t_max == 1, groups, null_slot)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: PagedAttentionMetadata) -> torch.Tensor:
    """Attention of the packed new queries ``q`` ``[N, Hq, D]`` over the paged cache (already holding
    this step's keys/values). Gathers each sequence's keys through its block table into a padded
    ``[B, Hkv, S, D]`` tensor and runs dense masked attention; returns ``[N, Hq, D]``."""
    n, hq, d = q.shape
    hkv = k_cache.shape[-2]
    k_flat, v_flat = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    packed = torch.empty_like(q)
    for rows, t, s in meta.groups:
        b = rows.numel()
        slots = meta.key_slots[rows, :s].reshape(-1)
        keys = k_flat.index_select(0, slots).view(b, s, hkv, d)
        values = v_flat.index_select(0, slots).view(b, s, hkv, d)
        if meta.null_slot is None:
            # Slots past a sequence's end hold whatever an earlier owner left (even NaN): zero them, since
            # a masked score still multiplies its value (0 * NaN = NaN).
            valid = meta.key_valid[rows, :s, None, None]
            keys, values = torch.where(valid, keys, 0), torch.where(valid, values, 0)
        q_index, q_valid = meta.query_index[rows, :t], meta.query_valid[rows, :t]
        qb = q[q_index].transpose(1, 2)  # [b, Hq, T, D]
        out = F.scaled_dot_product_attention(qb, keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=meta.mask[rows, :, :t, :s], enable_gqa=True)
        packed[q_index[q_valid]] = out.transpose(1, 2)[q_valid]
    return packed


class PagedKVCache:
    """The preallocated block pool and an ``AttentionBackend`` over it for one step at a time."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        # One extra block at the end is the *null block*: all zeros, never handed out. Masked key positions
        # gather from it, so stale (even NaN) data in free blocks can never reach the output. The rest is
        # left uninitialised: the OS commits the pages only as blocks are first used.
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, num_blocks].zero_()
        self.v[:, num_blocks].zero_()
        self.null_slot = num_blocks * block_size
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
        self.k[layer].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        self.v[layer].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
        return paged_attention_reference(q, self.k[layer], self.v[layer], meta)
