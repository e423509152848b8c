"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples.

This is the only place that touches the KV tensors: the scheduler and block manager decide *which*
tokens and *where* they go; the runner packs them (``input_ids``, ``positions``), builds the step's
``PagedAttentionMetadata`` once for all layers, and asks the model for logits only at the last token of
each sequence that completes its prompt or decodes this step.
"""

from __future__ import annotations

import torch

from minifer.engine.block_manager import BlockManager
from minifer.engine.scheduler import ScheduledBatch
from minifer.layers.paged_attention import PagedAttentionMetadata, PagedKVCache
from minifer.models.llama import LlamaForCausalLM
from minifer.sampling import SampleResult, sample


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, blocks: BlockManager) -> None:
        self.model, self.cache, self.blocks = model, cache, blocks
        self.device = model.lm_head.weight.device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int], SampleResult | None]:
        """Run one step. Returns the indices (into ``batch.seqs``) of the sequences that sampled a token,
        and the sampling result for them."""
        ids: list[int] = []
        positions: list[int] = []
        tables, ctx_lens = [], []
        sampling_rows: list[int] = []
        last_token_index: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            ids.extend(seq.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            tables.append(self.blocks.block_table(seq.request_id))
            ctx_lens.append(start + n)
            if start + n == seq.num_tokens:  # prompt complete (or a decode token): sample the next one
                sampling_rows.append(i)
                last_token_index.append(len(ids) - 1)
        dev = self.device
        self.cache.meta = PagedAttentionMetadata.build(tables, ctx_lens, batch.num_new_tokens,
                                                       self.cache.block_size, dev, null_slot=self.cache.null_slot)
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.cache)
        self.cache.meta = None
        if not sampling_rows:
            return [], None
        logits = self.model.compute_logits(hidden[torch.tensor(last_token_index, device=dev)])
        seqs = [batch.seqs[i] for i in sampling_rows]
        seen = None
        if any(s.params.repetition_penalty != 1 for s in seqs):
            seen = torch.zeros(len(seqs), logits.shape[-1], dtype=torch.bool, device=dev)
            for r, s in enumerate(seqs):
                seen[r, torch.tensor(s.all_token_ids, device=dev)] = True
        return sampling_rows, sample(logits, [s.params for s in seqs], [s.generator for s in seqs], seen)
