"""The attention metadata of a pure decode step, built with a handful of tensor ops.

``PagedAttentionMetadata.build`` handles any ragged batch (prompt chunks beside decodes, a causal mask per query, a
slot for every new token through a ``repeat_interleave``). That generality is what a learner reads, and its thirty
or so small tensor ops are a large share of a small model's decode step, a cost a static batch's contiguous cache
does not pay. When every sequence brings one token, most of it is known in Python: each new token sits at
``context - 1``, its slot is one block-table lookup, the only group is the decode group, and a key is valid exactly
before the context's end. ``DecodeMetadataBuilder`` builds the same metadata from those facts (every tensor equal to
``build``'s, checked by the suite), keeping its ``arange``s from step to step (``ModelRunner.fast_decode_metadata``).
"""

from __future__ import annotations

import torch

from minifer.layers.paged_attention import AttentionGroup, PagedAttentionMetadata


class DecodeMetadataBuilder:
    """``PagedAttentionMetadata`` of pure decode steps on one device, with its index ranges cached."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size, self.device = block_size, device
        self._range = torch.arange(0, device=device)
        self._offsets = torch.arange(block_size, device=device)

    def _arange(self, n: int) -> torch.Tensor:
        if self._range.numel() < n:
            self._range = torch.arange(max(n, 2 * self._range.numel()), device=self.device)
        return self._range[:n]

    def build(self, block_tables: list[list[int]], context_lens: list[int],
              null_slot: int | None) -> PagedAttentionMetadata:
        """The metadata ``PagedAttentionMetadata.build(block_tables, context_lens, [1] * b, ...)`` returns."""
        bs, b = self.block_size, len(block_tables)
        width, s_max = max(len(t) for t in block_tables), max(context_lens)
        new_slots = [t[(c - 1) // bs] * bs + (c - 1) % bs for t, c in zip(block_tables, context_lens)]
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long, device=self.device)
        ctx = torch.tensor(context_lens, device=self.device)
        s = self._arange(s_max)
        key_valid = s[None, :] < ctx[:, None]  # [b, S]
        key_slots = (tables[:, :, None] * bs + self._offsets).view(b, width * bs)[:, :s_max]
        key_slots = torch.where(key_valid, key_slots, null_slot or 0)
        rows = self._arange(b)
        group = AttentionGroup(key_slots.reshape(-1), key_valid[:, :, None, None], key_valid[:, None, None, :],
                               rows[:, None], rows, torch.ones(b, 1, dtype=torch.bool, device=self.device), b, 1,
                               s_max, True)
        return PagedAttentionMetadata(torch.tensor(new_slots, device=self.device), [group], b, tables.to(torch.int32),
                                      ctx.to(torch.int32), True, null_slot, True, [1] * b)
