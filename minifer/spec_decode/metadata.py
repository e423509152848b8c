"""What a proposer hands the speculator: ``Draft`` (tokens, and for a sampled request the distributions they
were drawn from) and ``DraftProposer``, the seam every proposer meets (n-gram, draft model, EAGLE).

Sampled drafts keep their distributions because rejection sampling needs ``q`` to stay lossless; a greedy
request's draft needs only its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from minifer.request import Request
from minifer.sample.rejection_sampler import probs_from_logits
from minifer.sample.sampler import greedy_argmax


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [k, V] the distributions they were drawn from (sampled rows)
    match_len: int = 0  # n-gram drafts: the length of the match that found them (0: a draft model's)


def draw_drafts(seqs: list[Request], active: list[int], logits: torch.Tensor, drafts: list[Draft],
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

    def propose(self, seqs: list[Request], ks: list[int], vocab_size: int) -> list[Draft]: ...

    def rollback(self, seq: Request, num_valid: int) -> None: ...

    def release(self, request_id: object) -> None: ...
