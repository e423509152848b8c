"""The sampler: the logits processors that implement ``SamplingParams`` and the draw.

Each step turns the model's next-token logits into one token per sequence:

    logits -> logit_bias -> min_tokens -> repetition, frequency and presence penalties -> / temperature
           -> top-k -> top-p -> min-p -> softmax -> draw

Each processor is a plain function on ``[batch, vocab]`` logits with one parameter per row, so a batch mixes
greedy (``temperature == 0``: the argmax after the penalties) and sampled requests. A request with its own ``seed``
draws from its own ``torch.Generator`` and reproduces exactly, whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from minifer.sampling_params import Logprob, SamplingParams

# --- processors: each takes logits [B, V] and one parameter per row, returns new logits -------------


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL's penalty on tokens already in the prompt or output (``seen``: bool ``[B, V]``): positive logits are
    divided by it, negative ones multiplied, so ``penalty > 1`` makes them less likely whatever their sign."""
    p = penalty[:, None].to(logits.dtype)
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """OpenAI's ``logit_bias``: each row's biases added to their tokens' logits (-100 all but bans a token)."""
    logits = logits.clone()
    for r, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            logits[r, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def greedy_argmax(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Greedy's token for each row of one request's ``logits``: the argmax after its ``logit_bias``, in float32 as
    :func:`sample` takes it (bf16 rounding could tie tokens that float32 tells apart). Speculative decoding uses it."""
    if params.logit_bias:
        return apply_logit_bias(logits.float(), [params] * logits.shape[0]).argmax(-1)
    return logits.argmax(-1)


def apply_frequency_presence(logits: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                             presence: torch.Tensor) -> torch.Tensor:
    """OpenAI's penalties on the output so far (``counts``: ``[B, V]`` occurrences of each token in the output,
    not the prompt, as in vLLM): ``logit - frequency * count - presence * (count > 0)``."""
    counts = counts.to(logits.dtype)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties with the k-th kept); ``k <= 0`` keeps all."""
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus sampling: keep the smallest set of most likely tokens whose probabilities sum to >= p."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p[:, None])  # the low-probability tail whose mass stays below 1 - p
    drop[:, -1] = False  # always keep the most likely token
    mask = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def process_logits(logits: torch.Tensor, params: list[SamplingParams], seen: torch.Tensor | None,
                   counts: torch.Tensor | None = None, banned: torch.Tensor | None = None,
                   top_p: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """All processors in order, in float32. Greedy rows get temperature 1 (their argmax is unaffected).
    ``top_p``: the nucleus filter, ``apply_top_p`` unless another is given (a learner's ``top_p_mask``).
    ``seen`` (bool ``[B, V]``): tokens of the prompt and output, for the repetition penalty; ``counts``
    (``[B, V]``): each token's occurrences in the output, for the frequency and presence penalties; ``banned``
    (bool ``[B, V]``): tokens that may not be drawn now (EOS and stop tokens before ``min_tokens``)."""
    dev = logits.device
    logits = logits.float()
    if any(p.logit_bias for p in params):
        logits = apply_logit_bias(logits, params)
    if banned is not None:
        logits = logits.masked_fill(banned, float("-inf"))
    pen = torch.tensor([p.repetition_penalty for p in params], device=dev)
    if seen is not None and bool((pen != 1).any()):
        logits = apply_repetition_penalty(logits, seen, pen)
    if counts is not None and any(p.frequency_penalty or p.presence_penalty for p in params):
        frequency = torch.tensor([p.frequency_penalty for p in params], device=dev)
        logits = apply_frequency_presence(logits, counts, frequency,
                                          torch.tensor([p.presence_penalty for p in params], device=dev))
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
    logits = logits / temps[:, None]
    if any(p.top_k > 0 for p in params):  # k beyond the vocabulary keeps all: never a huge int in a tensor
        vocab = logits.shape[-1]
        logits = apply_top_k(logits, torch.tensor([min(p.top_k, vocab) for p in params], device=dev))
    if any(p.top_p < 1 for p in params):
        logits = (top_p or apply_top_p)(logits, torch.tensor([p.top_p for p in params], device=dev))
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=dev))
    return logits


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    sampled_logprob: list[float] = field(default_factory=list)


class Sampler(Protocol):
    """The seam between the engine and the code that draws each sequence's next token (chapter 00); the reference
    is ``ModelRunner.sample`` (penalties and ``min_tokens`` over each sequence's tokens so far, then :func:`sample`).

    ``sampler(seqs, logits)``: ``logits`` ``[len(seqs), vocab]``, one row per sequence, in order; returns a
    ``SampleResult`` with one token id per sequence, drawn with ``seq.generator`` as ``seq.params`` asks (greedy:
    the argmax, after the logit bias), and, when ``seq.params.logprobs`` asks, the model's log-probabilities of
    the chosen and the top candidates (``sampled_logprob``, ``logprobs``; vLLM reports those of the model's
    distribution, before penalties, temperature and truncation)."""

    def __call__(self, seqs: list, logits: torch.Tensor) -> SampleResult: ...


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           seen: torch.Tensor | None = None, counts: torch.Tensor | None = None,
           banned: torch.Tensor | None = None,
           top_p: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> SampleResult:
    """Draw one token per row (``seen``, ``counts``, ``banned``, ``top_p``: see :func:`process_logits`). ``logprobs`` are
    those of the *model's* distribution (before penalties, temperature and truncation), as vLLM reports them by
    default."""
    processed = process_logits(logits, params, seen, counts, banned, top_p)
    tokens = processed.argmax(dim=-1).tolist()  # greedy rows keep these; one device sync for the batch
    if not all(p.greedy for p in params):
        probs = processed.softmax(dim=-1)
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = int(torch.multinomial(probs[i], 1, generator=generators[i]))
    return token_logprobs(logits, tokens, params)


def sample_sequences(seqs: list, logits: torch.Tensor, fast_greedy: bool = True) -> SampleResult:
    """One token per sequence (each brings its ``params``, ``generator`` and tokens so far), as :func:`sample` draws
    it. An all-plain-greedy batch takes the argmax and its log-probability directly: the same result without the
    processors' per-row tensors, a visible share of a small model's step. ``fast_greedy=False``: always ``sample``."""
    if fast_greedy and all(_plain_greedy(s.params) for s in seqs):
        raw = logits.float()
        tokens = raw.argmax(dim=-1)
        chosen = raw.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
        return SampleResult(tokens.tolist(), [None] * len(raw), chosen.tolist())
    history = history_tensors(seqs, logits.shape[-1], logits.device)
    return sample(logits, [s.params for s in seqs], [s.generator for s in seqs], *history)


def _plain_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing that could move the argmax or ask for more than the chosen token's log-probability."""
    return (p.greedy and not p.logit_bias and not p.reads_history and p.logprobs is None and p.top_k <= 0
            and p.top_p >= 1 and p.min_p <= 0)


def ranked_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[dict[int, Logprob]]:
    """For row ``i`` of ``logits``: ``tokens[i]``'s log-probability and rank, and the ``top`` most likely candidates
    (vLLM's prompt_logprobs entries)."""
    entries: list[dict[int, Logprob]] = []
    for at in range(0, len(tokens), 256):  # in slices: a long prompt's [T, V] float copies would be gigabytes
        logp = logits[at : at + 256].float().log_softmax(dim=-1)
        index = torch.tensor(tokens[at : at + 256], device=logits.device)[:, None]
        chosen = logp.gather(-1, index)[:, 0]
        ranks = (logp > chosen[:, None]).sum(-1) + 1
        part = [{t: Logprob(lp, r)} for t, lp, r in zip(tokens[at : at + 256], chosen.tolist(), ranks.tolist())]
        if top:
            values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
            for entry, vs, ts in zip(part, values.tolist(), ids.tolist()):
                for r, (lp, t) in enumerate(zip(vs, ts), start=1):
                    entry.setdefault(t, Logprob(lp, r))
        entries += part
    return entries


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> SampleResult:
    """The result for ``tokens[i]`` drawn from row ``i`` of ``logits``: its log-probability under the raw
    model distribution and, when ``params[i].logprobs`` asks for it, the top candidates with ranks.
    (Speculative decoding reuses it: each emitted token's row is the target's logits at its position.)"""
    raw_logp = logits.float().log_softmax(dim=-1)
    result = SampleResult(list(tokens))
    result.sampled_logprob = raw_logp.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    for i, p in enumerate(params):
        if p.logprobs is None:
            result.logprobs.append(None)
            continue
        row = raw_logp[i]
        entry: dict[int, Logprob] = {}
        if p.logprobs > 0:
            top = row.topk(min(p.logprobs, row.numel()))
            for r, (lp, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
                entry[t] = Logprob(lp, r)
        t = tokens[i]
        if t not in entry:
            entry[t] = Logprob(float(row[t]), int((row > row[t]).sum()) + 1)
        result.logprobs.append(entry)
    return result


def history_tensors(seqs: list, vocab: int, device: torch.device
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The history-dependent processors' inputs for ``Request`` rows, each built only when a row needs it:
    ``seen`` (all tokens so far: repetition penalty), ``counts`` (output tokens: frequency and presence penalties),
    ``banned`` (EOS and stop tokens of rows still short of ``min_tokens``). Most steps get three Nones."""
    seen = counts = banned = None
    if not any(s.params.reads_history for s in seqs):
        return seen, counts, banned
    b = len(seqs)
    if any(s.params.repetition_penalty != 1 for s in seqs):
        seen = torch.zeros(b, vocab, dtype=torch.bool, device=device)
        for r, s in enumerate(seqs):
            if s.params.repetition_penalty != 1:
                seen[r, torch.tensor(s.all_token_ids, dtype=torch.long, device=device)] = True
    if any(s.params.frequency_penalty or s.params.presence_penalty for s in seqs):
        counts = torch.zeros(b, vocab, device=device)
        for r, s in enumerate(seqs):
            out = s.output_token_ids
            if out and (s.params.frequency_penalty or s.params.presence_penalty):
                counts[r].index_add_(0, torch.tensor(out, dtype=torch.long, device=device),
                                     torch.ones(len(out), device=device))
    for r, s in enumerate(seqs):
        if len(s.output_token_ids) < s.min_tokens:
            ids = sorted(t for t in s.stop_ids if t < vocab)
            if ids:
                banned = torch.zeros(b, vocab, dtype=torch.bool, device=device) if banned is None else banned
                banned[r, torch.tensor(ids, dtype=torch.long, device=device)] = True
    return seen, counts, banned
