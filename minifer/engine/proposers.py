"""Draft proposers for speculative decoding: who guesses the next ``k`` tokens of each decoding sequence.

- ``NgramProposer``: prompt lookup (vLLM's ``"ngram"``), no model, no cache; the guess is deterministic;
- ``DraftModelProposer``: a small model with the target's tokenizer (``"draft_model"``), run ``k`` decode steps
  over its *own* paged KV cache.

Both, and ``eagle.EagleProposer``, meet the speculator through ``DraftProposer`` (``propose``, ``rollback``,
``release``); ``speculative.py`` verifies what they propose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from minifer.engine.block_manager import BlockManager
from minifer.engine.runner import ModelRunner
from minifer.engine.sequence import Sequence
from minifer.layers.paged_attention import PagedKVCache
from minifer.models.llama import LlamaForCausalLM
from minifer.sampling import greedy_argmax
from minifer.spec.ngram import ngram_match
from minifer.spec.rejection import one_hot_draft_probs, probs_from_logits

if TYPE_CHECKING:
    from minifer.engine.speculative import SpeculativeConfig


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [k, V] the distributions they were drawn from (sampled rows)
    match_len: int = 0  # n-gram drafts: the length of the match that found them (0: a draft model's)


def draw_drafts(seqs: list[Sequence], active: list[int], logits: torch.Tensor, drafts: list[Draft],
                probs: dict[int, list[torch.Tensor]]) -> None:
    """One draft token for each sequence ``seqs[i]``, ``i`` in ``active``, from its row of ``logits``: the greedy
    token for a greedy sequence, else one drawn with the sequence's generator, whose distribution joins
    ``probs[i]`` (rejection sampling needs it)."""
    q = probs_from_logits(logits[:, None, :], [seqs[i].params for i in active])[:, 0]
    for r, i in enumerate(active):
        seq = seqs[i]
        if seq.params.greedy:  # the draft takes the bias too, or it proposes what the target rules out
            tok = int(greedy_argmax(logits[r : r + 1], seq.params))
        else:
            tok = int(torch.multinomial(q[r], 1, generator=seq.generator))
            probs[i].append(q[r])
        drafts[i].tokens.append(tok)


def stack_probs(drafts: list[Draft], probs: dict[int, list[torch.Tensor]]) -> list[Draft]:
    for i, p in probs.items():
        if p:
            drafts[i].probs = torch.stack(p)
    return drafts


class DraftProposer(Protocol):
    """The seam between the speculator and whatever drafts tokens.

    ``propose(seqs, ks, vocab_size)`` returns one ``Draft`` per sequence: at most ``ks[i]`` tokens (none when
    ``ks[i]`` is 0) and, for a sampled (non-greedy) sequence, ``probs`` ``[len(tokens), vocab_size]``, the
    distributions they were drawn from (rejection sampling needs them to stay lossless). The target's KV slots
    for the drafts are reserved by the caller. ``rollback(seq, num_valid)``: only the first ``num_valid`` tokens
    of ``seq`` are real now (the rest were rejected); forget anything kept beyond them. ``release(request_id)``:
    the request is gone; free what the proposer holds for it."""

    def propose(self, seqs: list[Sequence], ks: list[int], vocab_size: int) -> list[Draft]: ...

    def rollback(self, seq: Sequence, num_valid: int) -> None: ...

    def release(self, request_id: object) -> None: ...


class NgramProposer:
    """Prompt lookup: no model, no cache; a deterministic guess (``q`` is one-hot)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def lookup(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """Up to ``k`` draft tokens and the length of the match that found them."""
        return ngram_match(seq.all_token_ids, k, self.cfg.prompt_lookup_max, self.cfg.prompt_lookup_min)

    def propose(self, seqs: list[Sequence], ks: list[int], vocab_size: int) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, ks):
            tokens, n = self.lookup(seq, k) if k else ([], 0)
            drafts.append(self.draft(seq, tokens, n, vocab_size))
        return drafts

    @staticmethod
    def draft(seq: Sequence, tokens: list[int], match_len: int, vocab_size: int) -> Draft:
        return Draft(tokens, None if seq.params.greedy or not tokens else one_hot_draft_probs([tokens], vocab_size)[0],
                     match_len)

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        pass

    def release(self, request_id: object) -> None:
        pass


class DraftModelProposer:
    """A small model with its own paged KV cache, run ``k`` decode steps per engine step.

    ``computed[rid]``: how many of the request's tokens the draft cache holds. Each proposal first feeds
    the tokens it has not seen (the prompt the first time; afterwards the one or two tokens the last
    verification added), then decodes its own guesses one at a time."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        cfg = model.config
        w = model.lm_head.weight
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                                  cfg.head_dim, w.dtype, w.device)
        self.runner = ModelRunner(model, self.cache, self.blocks)
        self.computed: dict[object, int] = {}

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        rid = seq.request_id
        if not self.blocks.has_seq(rid):
            if self.blocks.blocks_needed(num_tokens) > self.blocks.num_free_blocks:
                return False
            self.blocks.allocate(rid, seq.token_slice(0, 1))
            self.computed[rid] = 0
        if not self.blocks.can_append(rid, num_tokens):
            return False
        self.blocks.append_slots(rid, num_tokens)
        return True

    def propose(self, seqs: list[Sequence], ks: list[int], vocab_size: int) -> list[Draft]:
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

    def rollback(self, seq: Sequence, num_valid: int) -> None:
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
