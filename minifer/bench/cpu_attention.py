"""Decode attention that gathers every layer's keys and values in one go per step (issue 28), a CPU lever.

The reference (``paged_attention_reference``) gathers a decode batch's keys and values through the block tables
in every layer: 2 x num_layers gathers a step, each a separate op with its own dispatch and allocation. The
slots to read are the same in every layer (the gather index is built once per step); only the layer differs. So
``StepGatherKVCache`` reads all layers' cached keys and values with one gather each at the step's first layer,
and each layer then writes its own new token's key and value into that copy (and, as always, into the cache)
before attending: the same numbers reach the same SDPA call, so the tokens are identical to the reference's.

Measured, it is slower (0.70x alone at 64 and at 16 slots, ``benchmarks/results/cpu_peer.json`` at commit 64e1dd5):
one gather of all layers at 64 slots is ~56 MB of keys and values, which leaves the caches, while each per-layer
gather is read back by its attention while still cached. So it is not part of the fast path; it stays as a
measured counter-example. It applies to decode-only steps with a float cache on the CPU; everything else (prefill, mixed steps, 8-bit
caches, the GPU's Triton path) is the reference's. Select it with ``LLM(attention_backend=StepGatherKVCache)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minifer.layers.paged_attention import PagedAttentionMetadata, PagedKVCache


class StepGatherKVCache(PagedKVCache):
    """``PagedKVCache`` whose decode steps gather all layers at once (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._step: tuple | None = None  # (the step's metadata, its gathered keys, values, new-token rows)

    def _fast(self, meta: PagedAttentionMetadata) -> bool:
        # decode-only: one group whose rows are the packed tokens in order (``covers_all_in_order``)
        return (meta is not None and meta.is_decode and meta.covers_all_in_order and not self.use_triton
                and not self.calibrating and self.kv_cache_dtype == "auto" and meta.null_slot is not None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        if not self._fast(meta):
            return super().attend(layer, q, k, v)
        g = meta.groups[0]
        b, s = g.num_seqs, g.num_keys
        hq, hkv, d = q.shape[1], k.shape[1], k.shape[2]
        if self._step is None or self._step[0] is not meta:  # the step's first layer: one gather for all layers
            layers = self.k.shape[0]
            keys = self.k.view(layers, -1, hkv, d).index_select(1, g.key_slots)  # [L, b * S, Hkv, D]
            values = self.v.view(layers, -1, hkv, d).index_select(1, g.key_slots)
            # where each sequence's new token sits in that copy: its last position, context - 1
            newest = torch.arange(b, device=k.device) * s + meta.context_lens.long() - 1
            self._step = (meta, keys, values, newest)
        _, keys, values, newest = self._step
        self.k[layer].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        self.v[layer].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
        lk, lv = keys[layer].index_copy_(0, newest, k), values[layer].index_copy_(0, newest, v)
        lk, lv = lk.view(b, s, hkv, d).transpose(1, 2), lv.view(b, s, hkv, d).transpose(1, 2)  # [b, Hkv, S, D]
        out = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), lk, lv, attn_mask=g.mask)
        return out.reshape(b, hq, d)
