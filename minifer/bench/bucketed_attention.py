"""Decode attention in length buckets, so a short sequence is not padded to the longest context (issue 28), a CPU lever.

The reference (``paged_attention_reference``) attends a decode batch as one dense group: every sequence's keys are
gathered to the batch's longest context and the rest is masked. With contexts of 10 and 280 tokens side by side
(the headline workload at 64 slots), most of the gathered keys and most of the attention's arithmetic are padding.

``BucketedKVCache`` splits a decode-only step's sequences by context length into a few groups, each padded only to
its own longest context, and builds their gather indices once, at the step's first layer; every layer then reuses
them. The split is ``decode_buckets``: contexts rounded up to powers of two, then neighbouring buckets merged while a
separate group would save fewer gathered keys than ``GROUP_COST_KEYS``, the fixed cost of one more group (an SDPA
call, two gathers, a scatter of its outputs), counted in keys. Each sequence meets the same keys, in the same
order, with fewer masked ones after them, so the tokens are the reference's. Select it with
``LLM(attention_backend=BucketedKVCache)``; prefill, mixed steps, 8-bit caches and the GPU's Triton path are the
reference's, unchanged.

Measured alone through the engine it is slower: 0.89x at 16 slots and 0.92x at 64 (``benchmarks/results/cpu_peer.json``
at commit 02ed262, rounds 0.64-1.00). On the bundled model a layer's attention over a few hundred keys is cheap next
to the fixed cost of each extra group (two gathers, an SDPA call, a scatter of its outputs), so, like
``cpu_attention.StepGatherKVCache``, it is not part of the fast path: a measured counter-example, kept beside the benchmark rather than in the engine's
layers (it plugs in through the ``attention_backend`` seam like any other backend).
"""

from __future__ import annotations

import torch

from minifer.layers.paged_attention import PagedAttentionMetadata, PagedKVCache, paged_attention_reference

# one more attention group costs about as much as gathering and attending this many more keys (of one sequence)
GROUP_COST_KEYS = 1024


def decode_buckets(context_lens: list[int], group_cost: int = GROUP_COST_KEYS) -> list[list[int]]:
    """Rows of a decode batch grouped by context length (longest first), each group padded to its own longest:
    power-of-two buckets, then neighbours merged while merging pads fewer than ``group_cost`` extra keys."""
    order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (context_lens[groups[-1][0]] - 1).bit_length() == (context_lens[i] - 1).bit_length():
            groups[-1].append(i)
        else:
            groups.append([i])
    merged = [groups[0]]
    for g in groups[1:]:
        extra = len(g) * (context_lens[merged[-1][0]] - context_lens[g[0]])  # padding g's rows would gain
        if extra < group_cost:
            merged[-1] += g
        else:
            merged.append(g)
    return merged


def bucketed_metadata(meta: PagedAttentionMetadata, block_size: int) -> PagedAttentionMetadata:
    """``meta`` (a decode-only step's) with its one decode group split by ``decode_buckets``."""
    rows = decode_buckets(meta.context_lens.tolist())
    if len(rows) == 1:
        return meta
    tables, ctx = meta.block_tables.long(), meta.context_lens.long()
    ones = torch.ones_like(ctx)
    starts = torch.arange(len(ctx), device=ctx.device)  # one new token per sequence, packed in order
    groups = []
    for r in rows:
        index = torch.tensor(r, device=ctx.device)
        groups.append(PagedAttentionMetadata._group(tables[index], ctx[index], ones[index], starts[index], block_size,
                                                    meta.null_slot))
    return PagedAttentionMetadata(meta.slot_mapping, groups, meta.num_tokens, meta.block_tables, meta.context_lens,
                                  True, meta.null_slot, False, meta.query_lens)


class BucketedKVCache(PagedKVCache):
    """``PagedKVCache`` whose decode-only steps attend in length buckets (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._step: tuple[PagedAttentionMetadata, PagedAttentionMetadata] | None = None  # (the step's, bucketed)

    def _applies(self, meta: PagedAttentionMetadata | None) -> bool:
        return (meta is not None and meta.is_decode and meta.covers_all_in_order and not self.use_triton
                and not self.calibrating and self.kv_cache_dtype == "auto" and meta.null_slot is not None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self.meta
        if not self._applies(meta):
            return super().attend(layer, q, k, v)
        if self._step is None or self._step[0] is not meta:  # the step's first layer: its buckets, for all layers
            self._step = (meta, bucketed_metadata(meta, self.block_size))
        hkv, d = k.shape[1], k.shape[2]
        self.k[layer].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
        self.v[layer].view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)
        return paged_attention_reference(q, self.k[layer], self.v[layer], self._step[1])
