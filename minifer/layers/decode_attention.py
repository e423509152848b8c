"""Decode attention in length buckets, indexed once per step: the CPU's fast decode attention.

The reference (``paged_attention_reference``) pads every sequence of a decode step to the batch's *longest*
context; in a continuous batch contexts of 20 and 280 tokens sit side by side, so much of what SDPA reads and
multiplies is padding.

Here the sequences are sorted by context length and cut into a few buckets, each padded only to its own longest
context (``length_buckets``): greedily, a new bucket starts where the (row, key) pairs it stops padding outnumber
``BUCKET_COST_KEYS``, the measured cost of one more bucket. ``BucketedDecodeIndexer`` builds, once per step, what
every layer reuses (one gather index, the row order, each bucket's additive float mask, where the reference converts
its boolean mask again in every layer); a layer then runs two gathers, one SDPA call per bucket and one permutation
back (``bucketed_decode_attention``). Masked keys read the cache's all-zero null slot, so stale or NaN data cannot
leak, and the gather buffers are kept from step to step (a fresh megabyte-sized tensor is often a fresh ``mmap``,
whose page faults cost more than the copy).

Greedy tokens are the reference's (same keys, same order; the suite checks it). A switch, off by default
(``LLM(compilation_config={"decode_attention": "bucketed"})``; chapter 02 teaches the padded reference), for the
decode rows of any step over a float cache on the CPU: a mixed step's prompt chunks stay on the reference
(``BucketedDecodeIndex.rest``); 8-bit caches and the GPU's Triton kernels attend their own way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# one more bucket costs about as much as attending this many more (sequence, key) pairs; see the docstring
BUCKET_COST_KEYS = 1024
DECODE_ATTENTION = ("padded", "bucketed")  # compilation_config["decode_attention"]: the reference, this module


def length_buckets(context_lens: list[int], cost_keys: int = BUCKET_COST_KEYS) -> tuple[list[int], list[int]]:
    """The rows sorted by context length, longest first, and where each bucket of them starts (its first row in that
    order): a new bucket starts at the first row where the padding it saves, ``(longest - own) * rows left``,
    exceeds ``cost_keys``."""
    order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    starts, head = [0], context_lens[order[0]]
    for at, i in enumerate(order):
        if (head - context_lens[i]) * (len(order) - at) > cost_keys:
            starts.append(at)
            head = context_lens[i]
    return order, starts


@dataclass
class DecodeBucket:
    rows: int  # sequences in the bucket
    keys: int  # its longest context: every row's keys are padded to it
    offset: int  # where its rows' key slots start in ``BucketedDecodeIndex.key_slots``
    first_row: int  # its first row in the sorted order
    bias: torch.Tensor | None  # [rows, 1, 1, keys] 0 / -inf, or None when every row has ``keys`` keys


@dataclass
class BucketedDecodeIndex:
    """What every layer of a step reads to attend its decode rows in buckets, built once per step."""

    key_slots: torch.Tensor  # [sum(rows * keys)] cache slot of every (bucket row, key), null slot where masked
    order: torch.Tensor | None  # [b] packed row of each sorted decode row; None: the packed rows 0..b-1 in order
    inverse: torch.Tensor | None  # [b] sorted position of each packed row (a decode-only step out of order)
    buckets: list[DecodeBucket]
    keys: torch.Tensor  # [sum(rows * keys), Hkv, D] where each layer gathers its keys (reused by every layer)
    values: torch.Tensor
    rest: Any = None  # a mixed step: its metadata without the decode rows (prompt chunks, which the reference attends)


class BucketedDecodeIndexer:
    """Builds a step's ``BucketedDecodeIndex`` and keeps the gather buffers from step to step (grown as needed), for
    one model's KV heads, head size and dtype."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 cost_keys: int = BUCKET_COST_KEYS) -> None:
        self.shape, self.dtype, self.device, self.cost_keys = (num_kv_heads, head_dim), dtype, device, cost_keys
        self._buffers = (torch.empty(0, *self.shape, dtype=dtype, device=device),) * 2

    def _workspace(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._buffers[0].shape[0] < n:
            n = max(n, 2 * self._buffers[0].shape[0])
            self._buffers = tuple(torch.empty(n, *self.shape, dtype=self.dtype, device=self.device) for _ in "kv")
        return self._buffers

    def attach(self, meta, context_lens: list[int]) -> None:
        """Give a step's ``PagedAttentionMetadata`` (``context_lens``: its sequences', packed order) the
        ``decode_index`` of its decode rows; a step without decode rows keeps none."""
        if not meta.groups or not meta.groups[0].is_decode or meta.null_slot is None:
            return
        if meta.is_decode and meta.covers_all_in_order:
            meta.decode_index = self.build(meta.groups[0].key_slots, context_lens)
            return
        packed, rows, ctx = 0, [], []  # a mixed step: the decode rows' packed positions and contexts
        for n, c in zip(meta.query_lens, context_lens):
            if n == 1:
                rows.append(packed)
                ctx.append(c)
            packed += n
        rest = dataclasses.replace(meta, groups=meta.groups[1:], covers_all_in_order=False, is_decode=False)
        meta.decode_index = self.build(meta.groups[0].key_slots, ctx, rows, rest)

    def build(self, key_slots: torch.Tensor, context_lens: list[int], packed_rows: list[int] | None = None,
              rest=None) -> BucketedDecodeIndex:
        """``key_slots``: ``[b, S]`` slots of every decode row's keys up to the longest context ``S``, the null slot
        past each one's own (the reference's decode group, ``AttentionGroup.key_slots``); ``context_lens[i]``: row
        i's keys, this step's included; ``packed_rows[i]``: its query's index among the step's packed tokens (None:
        ``i``, a decode-only step); ``rest``: the step's metadata for everything else."""
        b = len(context_lens)
        order, starts = length_buckets(context_lens, self.cost_keys)
        device = key_slots.device
        perm = None if order == sorted(order) else torch.tensor(order, device=device)
        slots = key_slots.view(b, -1) if perm is None else key_slots.view(b, -1).index_select(0, perm)
        ctx = torch.tensor([context_lens[i] for i in order], device=device)
        pieces, buckets, offset = [], [], 0
        for first, end in zip(starts, starts[1:] + [b]):
            rows, keys = end - first, context_lens[order[first]]
            pieces.append(slots[first:end, :keys].reshape(-1))
            bias = None
            if context_lens[order[end - 1]] != keys:  # the scores' dtype: the queries', the model's
                valid = torch.arange(keys, device=device)[None, :] < ctx[first:end, None]
                bias = torch.zeros(rows, 1, 1, keys, dtype=self.dtype, device=device)
                bias.masked_fill_(~valid[:, None, None, :], float("-inf"))
            buckets.append(DecodeBucket(rows, keys, offset, first, bias))
            offset += rows * keys
        k_buf, v_buf = self._workspace(offset)
        if packed_rows is None:
            inverse = None if perm is None else torch.argsort(perm)
        else:
            perm, inverse = torch.tensor([packed_rows[i] for i in order], device=device), None
        return BucketedDecodeIndex(torch.cat(pieces) if len(pieces) > 1 else pieces[0], perm, inverse, buckets,
                                   k_buf[:offset], v_buf[:offset], rest)


def bucketed_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              index: BucketedDecodeIndex, into: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the decode rows' queries (``q`` ``[N, Hq, D]``, the step's packed queries) over one layer's
    paged float cache (``[blocks, block_size, Hkv, D]``, already holding this step's keys). Returns ``[N, Hq, D]``:
    a decode-only step's output, or ``into`` (a mixed step's output for ``index.rest``) with the decode rows
    written in. The query heads sharing a KV head become its query rows, so SDPA needs no GQA expansion."""
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[-2]
    keys = torch.index_select(k_cache.view(-1, hkv, d), 0, index.key_slots, out=index.keys)
    values = torch.index_select(v_cache.view(-1, hkv, d), 0, index.key_slots, out=index.values)
    qs = q if index.order is None else q.index_select(0, index.order)
    outs = []
    for g in index.buckets:
        span = slice(g.offset, g.offset + g.rows * g.keys)
        kb = keys[span].view(g.rows, g.keys, hkv, d).transpose(1, 2)  # [rows, Hkv, keys, D]
        vb = values[span].view(g.rows, g.keys, hkv, d).transpose(1, 2)
        qb = qs[g.first_row : g.first_row + g.rows].view(g.rows, hkv, hq // hkv, d)
        outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=g.bias))
    out = (torch.cat(outs) if len(outs) > 1 else outs[0]).view(-1, hq, d)
    if into is not None:
        return into.index_copy_(0, index.order, out)
    return out if index.inverse is None else out.index_select(0, index.inverse)


def set_decode_attention(model: torch.nn.Module, mode: str) -> None:
    """``compilation_config["decode_attention"]``: the model's runners attend decode steps this way (``"padded"``, the
    reference, or ``"bucketed"``). The CPU only: on a GPU the Triton kernels read the block tables directly."""
    if mode not in DECODE_ATTENTION:
        raise ValueError(f"compilation_config: decode_attention must be one of {list(DECODE_ATTENTION)} (padded: the "
                         f"reference, every row padded to the longest context; bucketed: length buckets), got {mode!r}")
    if mode != "padded" and model.lm_head.weight.device.type != "cpu":
        raise ValueError(f"compilation_config: decode_attention={mode!r} is a CPU path; this model is on "
                         f"{model.lm_head.weight.device.type}, where decode steps run the Triton kernels")
    model.decode_attention = mode


def decode_indexer(model: torch.nn.Module, cache: Any) -> BucketedDecodeIndexer | None:
    """The indexer a runner over ``model`` and ``cache`` attaches to each decode step, or None: the model asked for
    the padded reference, or the cache is not a float ``PagedKVCache`` on the CPU (8-bit caches, GPU kernels and
    other backends attend their own way)."""
    if getattr(model, "decode_attention", "padded") != "bucketed" or getattr(cache, "kv_cache_dtype", None) != "auto":
        return None
    if getattr(cache, "use_triton", True) or not hasattr(cache, "k"):
        return None
    return BucketedDecodeIndexer(cache.k.shape[-2], cache.k.shape[-1], cache.k.dtype, cache.k.device)
