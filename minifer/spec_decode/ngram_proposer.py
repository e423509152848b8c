"""Prompt-lookup decoding: n-gram proposals, a draft that needs no model (vLLM's ``"ngram"`` method).

Much generated text repeats its context: code edits, summaries and retrieval answers copy spans of the
prompt, and a story repeats its characters' names. If the last few tokens occurred earlier, the tokens
that followed them then are a good guess for what follows now. The guess costs a search over the
sequence, not a forward pass, so even a modest acceptance rate pays off; when nothing matches, the step
simply decodes one token as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from minifer.sample.rejection_sampler import one_hot_draft_probs
from minifer.spec_decode.metadata import Draft

if TYPE_CHECKING:
    from minifer.engine.speculative import SpeculativeConfig
    from minifer.request import Request

__all__ = ["NgramProposer", "ngram_match", "ngram_propose"]


def ngram_propose(token_ids: Sequence[int], k: int, prompt_lookup_max: int, prompt_lookup_min: int) -> list[int]:
    """Up to ``k`` draft tokens for a sequence whose tokens so far (prompt and output) are ``token_ids``.

    For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last ``n`` tokens are the
    pattern; the first ``n`` with an earlier occurrence wins (a longer match is a more specific context),
    and among its occurrences the most recent one (the nearest context). The proposal is what followed that
    occurrence, at most ``k`` tokens and fewer where the sequence ends first; ``[]`` when no ``n`` matches.
    (The occurrence may overlap the pattern itself: in ``a b a b a b`` the pattern ``a b`` last occurred
    two tokens earlier and is followed by ``a b``.)

    Cost: O(len(token_ids)) for a bounded ``prompt_lookup_max`` (one vectorised pass finds the positions of the
    last token, then each longer ``n`` narrows them). vLLM's proposer finds the longest match with KMP and,
    among equally long matches, takes the earliest; this one takes the most recent.
    """
    return ngram_match(token_ids, k, prompt_lookup_max, prompt_lookup_min)[0]


def ngram_match(token_ids: Sequence[int], k: int, prompt_lookup_max: int,
                prompt_lookup_min: int) -> tuple[list[int], int]:
    """``ngram_propose``'s draft and the length ``n`` of the match that produced it (0: no match).

    The engine's adaptive speculation uses ``n``: a draft found by a 4-token match is accepted far more
    often than one found by a single repeated token, so it is worth verifying under more load."""
    for name, value in (("k", k), ("prompt_lookup_max", prompt_lookup_max), ("prompt_lookup_min", prompt_lookup_min)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if k < 1:
        raise ValueError(f"k (the number of tokens to propose) must be >= 1, got {k}")
    if not 1 <= prompt_lookup_min <= prompt_lookup_max:
        raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got prompt_lookup_min="
                         f"{prompt_lookup_min}, prompt_lookup_max={prompt_lookup_max}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be a flat sequence of token ids, got shape {tokens.shape}")
    total = len(tokens)
    if total < 2:
        return [], 0
    # `ends`: the last index of every earlier occurrence of the last n tokens (never the suffix itself,
    # which ends at total - 1); n = 1 first, then each step keeps those whose token n back matches too.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    best_end, best_n = (int(ends[-1]), 1) if ends.size and prompt_lookup_min == 1 else (-1, 0)
    n = 1
    while ends.size and n < prompt_lookup_max:
        n += 1
        ends = ends[ends >= n - 1]
        ends = ends[tokens[ends - (n - 1)] == tokens[total - n]]
        if ends.size and n >= prompt_lookup_min:
            best_end, best_n = int(ends[-1]), n
    if best_end < 0:
        return [], 0
    return tokens[best_end + 1 : best_end + 1 + k].tolist(), best_n


class NgramProposer:
    """Prompt lookup: no model, no cache; a deterministic guess (``q`` is one-hot)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def lookup(self, seq: Request, k: int) -> tuple[list[int], int]:
        """Up to ``k`` draft tokens and the length of the match that found them."""
        return ngram_match(seq.all_token_ids, k, self.cfg.prompt_lookup_max, self.cfg.prompt_lookup_min)

    def propose(self, seqs: list[Request], ks: list[int], vocab_size: int) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, ks):
            tokens, n = self.lookup(seq, k) if k else ([], 0)
            drafts.append(self.draft(seq, tokens, n, vocab_size))
        return drafts

    @staticmethod
    def draft(seq: Request, tokens: list[int], match_len: int, vocab_size: int) -> Draft:
        return Draft(tokens, None if seq.params.greedy or not tokens else one_hot_draft_probs([tokens], vocab_size)[0],
                     match_len)

    def rollback(self, seq: Request, num_valid: int) -> None:
        pass

    def release(self, request_id: object) -> None:
        pass
