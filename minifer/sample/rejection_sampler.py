"""Verifying draft tokens: the step that makes speculative decoding lossless.

A cheap proposer guesses ``k`` tokens; the target scores the context plus all ``k`` guesses in **one** forward,
which gives its distribution at ``k + 1`` positions (after the context, after draft token 1, ..., after draft token
``k``). This module turns them into the 1 to ``k + 1`` tokens the step emits:

* **greedy** (:func:`verify_greedy`): keep the drafts while each equals the target's argmax, then emit the
  target's own token, either at the first mismatch or, when all ``k`` matched, the **bonus** token after
  them. The output is exactly what plain greedy decoding with the target would produce.
* **sampled** (:func:`rejection_sample`): the modified rejection sampling of Leviathan et al. (2023) and
  Chen et al. (2023). Draft token ``x`` was drawn from ``q``; accept it with probability
  ``min(1, p(x) / q(x))``; on the first rejection emit a token from the **residual**
  ``normalize(max(p - q, 0))`` and stop. Each emitted token is then distributed *exactly* as ``p`` at its
  position given the tokens before it, whatever ``q`` is: a token is emitted either by acceptance,
  ``q(x) · min(1, p(x)/q(x)) = min(p(x), q(x))``, or by rejection then the residual,
  ``(1 - Σ_y min(p(y), q(y))) · max(p(x) - q(x), 0) / Σ_y max(p(y) - q(y), 0)``; both sums equal the total
  variation distance, so the second term is ``max(p(x) - q(x), 0)``, and ``min(p, q) + max(p - q, 0) = p``.
  A better draft only makes acceptance likelier; it never changes what comes out.

``p`` and ``q`` must come from the *same* logits processing (temperature, top-k, top-p, min-p), which
:func:`probs_from_logits` applies exactly as :func:`minifer.sample.sampler.sample` does. The batch is ragged:
row ``i`` proposed ``k_i`` tokens (possibly 0); tensors are padded to the longest row and the padding is
never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from minifer.sample.sampler import process_logits
from minifer.sampling_params import SamplingParams

__all__ = ["verify_greedy", "rejection_sample", "probs_from_logits", "one_hot_draft_probs", "Verifier",
           "RejectionVerifier"]


def _check_drafts(draft_tokens: Sequence[Sequence[int]], batch: int, positions: int, name: str,
                  vocab: int | None = None) -> list[int]:
    """Validate the ragged draft lists against a ``[batch, positions, ...]`` tensor; return each row's k."""
    if len(draft_tokens) != batch:
        raise ValueError(f"{name} has {batch} rows but draft_tokens has {len(draft_tokens)}")
    ks = [len(d) for d in draft_tokens]
    if ks and max(ks) + 1 > positions:
        raise ValueError(f"{name} has {positions} positions per row, but a row proposed {max(ks)} draft tokens "
                         f"(needs k + 1 = {max(ks) + 1}: one per draft token plus the bonus position)")
    if vocab is not None:
        for i, d in enumerate(draft_tokens):
            if any(not 0 <= t < vocab for t in d):
                raise ValueError(f"draft_tokens[{i}] = {list(d)} has a token outside the vocabulary [0, {vocab})")
    return ks


def verify_greedy(draft_tokens: list[list[int]], target_argmax: torch.Tensor) -> list[list[int]]:
    """Greedy verification of a ragged batch of drafts.

    ``target_argmax[i, j]`` (``[B, max_k + 1]``) is the target's greedy token after the context and the
    first ``j`` draft tokens of row ``i``. Returns, per row, the longest prefix of drafts that agrees with
    it, then the target's token at the first disagreement (or the bonus ``target_argmax[i, k_i]`` when all
    ``k_i`` agree): between 1 and ``k_i + 1`` tokens, the same as ``k_i + 1`` steps of greedy decoding
    would give up to its first disagreement with the draft.
    """
    if target_argmax.dim() != 2:
        raise ValueError(f"target_argmax must be [batch, max_k + 1], got shape {list(target_argmax.shape)}")
    _check_drafts(draft_tokens, target_argmax.shape[0], target_argmax.shape[1], "target_argmax")
    target = target_argmax.tolist()  # one device sync for the whole batch
    out: list[list[int]] = []
    for draft, row in zip(draft_tokens, target):
        n = 0
        while n < len(draft) and draft[n] == row[n]:
            n += 1
        out.append(list(draft[:n]) + [int(row[n])])
    return out


def _check_rejection_inputs(draft_tokens: list[list[int]], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                            generators: list) -> list[int]:
    """``rejection_sample``'s inputs checked against each other; returns each row's number of draft tokens."""
    if draft_probs.dim() != 3 or target_probs.dim() != 3:
        raise ValueError(f"draft_probs must be [batch, max_k, vocab] and target_probs [batch, max_k + 1, vocab], "
                         f"got shapes {list(draft_probs.shape)} and {list(target_probs.shape)}")
    batch, positions, vocab = target_probs.shape
    if draft_probs.shape[0] != batch or draft_probs.shape[2] != vocab:
        raise ValueError(f"draft_probs {list(draft_probs.shape)} and target_probs {list(target_probs.shape)} must "
                         f"agree on batch and vocabulary")
    if len(generators) != batch:
        raise ValueError(f"got {len(generators)} generators for a batch of {batch}")
    ks = _check_drafts(draft_tokens, batch, positions, "target_probs", vocab)
    if draft_probs.shape[1] < max(ks, default=0):
        raise ValueError(f"draft_probs has {draft_probs.shape[1]} positions per row, but a row proposed "
                         f"{max(ks, default=0)} draft tokens")
    return ks


def rejection_sample(draft_tokens: list[list[int]], draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generators: list[torch.Generator | None]) -> list[list[int]]:
    """Lossless verification of sampled drafts (modified rejection sampling).

    ``draft_probs`` ``[B, max_k, V]`` is ``q``: row ``i`` position ``j`` is the distribution draft token
    ``draft_tokens[i][j]`` was drawn from. ``target_probs`` ``[B, max_k + 1, V]`` is ``p`` at the same
    positions plus the bonus one. Both must be processed alike (:func:`probs_from_logits`); they need not be
    normalised exactly. Returns per row the accepted drafts followed by one token drawn from the residual
    (at the first rejection) or from ``p`` at position ``k_i`` (the bonus, when all were accepted, or the
    only token of a row with ``k_i = 0``).

    Randomness: row ``i`` draws only from ``generators[i]`` (``None``: the default generator of the tensors'
    device), in a fixed order: ``torch.rand(k_i)`` (one uniform per draft token, all drawn even if an
    early one is rejected), then one ``torch.multinomial(dist, 1)``. A seeded request therefore reproduces
    whatever else shares its batch.

    Edge cases: draft token ``x`` is accepted iff ``u < p(x) / q(x)`` with ``u ~ U[0, 1)``; the strict ``<``
    never accepts a token the target excludes (``p(x) = 0``), and ``q(x) = 0`` (impossible for a token really
    drawn from ``q``, but a caller may be wrong) counts as a rejection rather than a division by zero. If
    ``max(p - q, 0)`` has no mass (``p`` and ``q`` equal up to rounding), the token is drawn from ``p``.
    """
    ks = _check_rejection_inputs(draft_tokens, draft_probs, target_probs, generators)
    batch, max_k = target_probs.shape[0], max(ks, default=0)
    if batch == 0:
        return []
    dev = target_probs.device
    p, q = target_probs.float(), draft_probs.float()
    k_of_row = torch.tensor(ks, device=dev)

    # p(x) / q(x) of every draft token, for the whole batch in one gather (padding: token 0, never used).
    tokens = torch.tensor([list(d) + [0] * (max_k - len(d)) for d in draft_tokens], dtype=torch.long, device=dev)
    tokens = tokens.reshape(batch, max_k, 1)
    p_x, q_x = p[:, :max_k].gather(-1, tokens)[..., 0], q[:, :max_k].gather(-1, tokens)[..., 0]
    ratio = torch.where(q_x > 0, p_x / q_x, torch.zeros_like(p_x))

    # Uniforms row by row, each from its row's generator; then the accepted count of every row at once.
    u = torch.ones(batch, max_k, device=dev)
    for i, (k, gen) in enumerate(zip(ks, generators)):
        if k:
            u[i, :k] = torch.rand(k, generator=gen, device=dev)
    padding = torch.arange(max_k, device=dev) >= k_of_row[:, None]
    rejected = ~(u < ratio) | padding  # `~(u < r)`, not `u >= r`: a NaN ratio rejects
    # the first rejected position; a row whose drafts were all accepted stops at its padding, i.e. at k_i
    num_accepted = (torch.where(rejected.any(-1), rejected.int().argmax(-1), k_of_row) if max_k
                    else torch.zeros_like(k_of_row))

    # The final token's distribution: the residual at the first rejection, or p at the bonus position k_i.
    rows = torch.arange(batch, device=dev)
    p_at = p[rows, num_accepted]
    q_at = q[rows, num_accepted.clamp(max=max_k - 1)] if max_k else torch.zeros_like(p_at)
    residual = torch.where((num_accepted < k_of_row)[:, None], (p_at - q_at).clamp(min=0), p_at)
    dist = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)  # no mass left: fall back to p

    last = torch.cat([torch.multinomial(dist[i], 1, generator=gen) for i, gen in enumerate(generators)]).tolist()
    return [list(d[:n]) + [t] for d, n, t in zip(draft_tokens, num_accepted.tolist(), last)]


def probs_from_logits(logits: torch.Tensor, params: list[SamplingParams],
                      seen: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax probabilities (float32) of ``logits`` ``[B, T, V]`` after the logits processors of plain
    sampling (:func:`minifer.sample.sampler.process_logits`: temperature, top-k, top-p, min-p), row ``i``'s
    ``params[i]`` applied at all its ``T`` positions. Use it for both ``p`` (target) and ``q`` (draft):
    rejection sampling reproduces ``p``, so ``p`` must be the distribution plain sampling would draw from.

    A greedy row gets a one-hot at the argmax ``sample`` would pick, so :func:`rejection_sample` on it
    emits exactly what :func:`verify_greedy` would (a one-hot ``p`` accepts the argmax and rejects anything
    else, whose residual is the argmax again).

    ``seen`` (bool ``[B, T, V]``) marks, per position, the tokens the repetition penalty applies to: the
    context *and the draft tokens before that position*. It is required when a row has
    ``repetition_penalty != 1``, since one mask for all positions would penalise differently from plain
    decoding.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, positions, vocab], got shape {list(logits.shape)}")
    batch, positions, vocab = logits.shape
    if len(params) != batch:
        raise ValueError(f"got {len(params)} SamplingParams for a batch of {batch}")
    if seen is not None and seen.shape != logits.shape:
        raise ValueError(f"seen must be [batch, positions, vocab] = {list(logits.shape)}, got {list(seen.shape)}")
    if any(p.presence_penalty or p.frequency_penalty or p.min_tokens for p in params):
        raise ValueError("a row has a presence or frequency penalty or min_tokens: each drafted position would need "
                         "its own output history; such requests decode without speculation")
    if seen is None and any(p.repetition_penalty != 1 for p in params):
        raise ValueError("a row has repetition_penalty != 1: pass `seen` ([batch, positions, vocab]: the context "
                         "and the draft tokens before each position), or the penalty would be skipped")
    flat_params = [p for p in params for _ in range(positions)]
    flat_seen = None if seen is None else seen.reshape(batch * positions, vocab)
    processed = process_logits(logits.reshape(batch * positions, vocab), flat_params, flat_seen)
    probs = processed.softmax(dim=-1).reshape(batch, positions, vocab)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, processed.argmax(-1).reshape(batch, positions, 1), 1.0)
        probs = torch.where(greedy[:, None, None], one_hot, probs)
    return probs


def one_hot_draft_probs(draft_tokens: list[list[int]], vocab_size: int,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """``q`` ``[B, max_k, V]`` of a deterministic proposer (n-gram lookup): all mass on the proposed token.

    With it, :func:`rejection_sample` accepts draft ``x`` with probability ``p(x)`` and otherwise draws from
    ``p`` with ``x`` removed, which is still exactly ``p`` overall."""
    max_k = max((len(d) for d in draft_tokens), default=0)
    q = torch.zeros(len(draft_tokens), max_k, vocab_size, device=device)
    for i, d in enumerate(draft_tokens):
        if any(not 0 <= t < vocab_size for t in d):
            raise ValueError(f"draft_tokens[{i}] = {list(d)} has a token outside the vocabulary [0, {vocab_size})")
        if d:
            q[i, torch.arange(len(d)), torch.tensor(list(d), dtype=torch.long)] = 1.0
    return q


class Verifier(Protocol):
    """The seam between speculative decoding and the rule that keeps or rejects draft tokens (chapter 04);
    ``RejectionVerifier`` (this module's :func:`verify_greedy` and :func:`rejection_sample`) is the reference.

    ``greedy(draft_tokens, target_argmax)``: ragged drafts (``k_i`` tokens in row ``i``) and the target's greedy
    token after each prefix, ``[B, max_k + 1]``; returns per row the longest agreeing prefix of the draft and then the
    target's own token (1 to ``k_i + 1`` tokens: exactly what greedy decoding would emit). ``sample(draft_tokens,
    draft_probs, target_probs, generators)``: ``q`` ``[B, max_k, V]``, ``p`` ``[B, max_k + 1, V]``, one generator
    per row; returns per row 1 to ``k_i + 1`` tokens distributed exactly as sampling from ``p`` token by token would
    be (lossless). A verifier that breaks either promise changes the engine's output; the tests' chi-squared check
    catches a lossy one."""

    def greedy(self, draft_tokens: list[list[int]], target_argmax: torch.Tensor) -> list[list[int]]: ...

    def sample(self, draft_tokens: list[list[int]], draft_probs: torch.Tensor, target_probs: torch.Tensor,
               generators: list[torch.Generator | None]) -> list[list[int]]: ...


class RejectionVerifier:
    """The reference ``Verifier``: greedy agreement and Leviathan et al.'s modified rejection sampling."""

    greedy = staticmethod(verify_greedy)
    sample = staticmethod(rejection_sample)
