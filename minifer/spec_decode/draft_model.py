"""The draft-model proposer (vLLM's ``"draft_model"``): a small model with the target's tokenizer, run ``k``
decode steps per engine step over its *own* paged KV cache.

It meets the speculator through ``DraftProposer``
(``metadata.py``: ``propose``, ``rollback``, ``release``), as the n-gram and EAGLE proposers do; ``speculative.py``
verifies what it proposes.
"""

from __future__ import annotations

import torch

from minifer.attention.backends.paged import PagedKVCache
from minifer.core.kv_cache_manager import KVCacheManager, cdiv
from minifer.models.llama import LlamaForCausalLM
from minifer.request import Request
from minifer.spec_decode.metadata import Draft, draw_drafts, stack_probs
from minifer.worker.model_runner import ModelRunner


class DraftModelProposer:
    """A small model with its own paged KV cache, run ``k`` decode steps per engine step.

    ``computed[rid]``: how many of the request's tokens the draft cache holds. Each proposal first feeds
    the tokens it has not seen (the prompt the first time; afterwards the one or two tokens the last
    verification added), then decodes its own guesses one at a time."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        w = model.lm_head.weight
        self.blocks = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self.cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                                  cfg.head_dim, w.dtype, w.device)
        self.runner = ModelRunner(model, self.cache, self.blocks)
        self.computed: dict[object, int] = {}

    def _reserve(self, seq: Request, num_tokens: int) -> bool:
        rid = seq.request_id
        if not self.blocks.has_seq(rid):
            if cdiv(num_tokens, self.blocks.block_size) > self.blocks.num_free_blocks:
                return False
            self.blocks.allocate(rid, seq.token_slice(0, 1))
            self.computed[rid] = 0
        if not self.blocks.can_append(rid, num_tokens):
            return False
        self.blocks.append_slots(rid, num_tokens)
        return True

    def propose(self, seqs: list[Request], ks: list[int], vocab_size: int) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        active = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k and self._reserve(s, s.num_tokens + k - 1)]
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        step = 0
        while active:
            rids, starts, chunks = [], [], []
            for i in active:
                seq = seqs[i]
                if step == 0:  # catch up on what the draft has not seen, up to the last token
                    start = self.computed[seq.request_id]
                    chunk = seq.token_slice(start, seq.num_tokens)
                else:
                    start, chunk = seq.num_tokens + step - 1, drafts[i].tokens[-1:]
                rids.append(seq.request_id)
                starts.append(start)
                chunks.append(chunk)
            logits = self.runner.forward(rids, starts, chunks, [1] * len(active))
            for r, i in enumerate(active):
                self.computed[seqs[i].request_id] = starts[r] + len(chunks[r])
            draw_drafts(seqs, active, logits, drafts, probs)
            step += 1
            active = [i for i in active if len(drafts[i].tokens) < ks[i]]
        return stack_probs(drafts, probs)

    def rollback(self, seq: Request, num_valid: int) -> None:
        """Keep the draft's KV of the first ``num_valid`` tokens of the sequence, free the rest."""
        rid = seq.request_id
        if rid in self.computed and self.computed[rid] > num_valid:
            self.computed[rid] = num_valid
        if self.blocks.has_seq(rid):
            self.blocks.truncate(rid, max(self.computed.get(rid, 0), 1))

    def release(self, request_id: object) -> None:
        self.computed.pop(request_id, None)
        if self.blocks.has_seq(request_id):
            self.blocks.free(request_id)
