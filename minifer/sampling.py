"""Sampling parameters (vLLM's names and defaults) and the logits processors that implement them.

Each step turns the model's next-token logits into one token per sequence:

    logits -> logit_bias -> min_tokens -> repetition, frequency and presence penalties -> / temperature
           -> top-k -> top-p -> min-p -> softmax -> draw

Each processor is a plain function on ``[batch, vocab]`` logits with one parameter per row, so a batch mixes
greedy (``temperature == 0``: the argmax after the penalties) and sampled requests. A request with its own ``seed``
draws from its own ``torch.Generator`` and reproduces exactly, whatever shares its batch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

_EPS_TEMPERATURE = 1e-5
# vLLM raises a positive temperature below 0.01 to 0.01 (with a warning): dividing logits by less risks inf/NaN.
MIN_TEMPERATURE = 0.01
# vLLM only asks for > 0. minifer bounds it so that a penalised logit stays finite in float32: a penalty that
# rounds to 0 (1e-50) divides by zero, and a NaN in one row fails the step of the whole batch.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
_FLOAT32_MAX = torch.finfo(torch.float32).max  # temperatures beyond it are inf in float32: -inf / inf is NaN
_INT32_MAX = 2**31 - 1  # top_k's bound (any k >= the vocabulary keeps every token)
_INT64_RANGE = (-(2**63), 2**63 - 1)  # what a seed must fit in (torch.Generator.manual_seed, as vLLM bounds it)


def _is_int(x: object) -> bool:
    """An integer that is not a bool: JSON's true would otherwise pass as 1 (``isinstance(True, int)``)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _in(x: object, low: float, high: float) -> bool:
    """A number (not a bool, not NaN) in ``[low, high]``."""
    return _is_number(x) and low <= x <= high


def _list_of(items: object, ok) -> bool:
    """None, or a list (or tuple) whose every item passes ``ok``."""
    return items is None or isinstance(items, (list, tuple)) and all(ok(x) for x in items)


@dataclass
class SamplingParams:
    """How to sample one request. Defaults are vLLM's (note ``max_tokens=16``).

    Every field is checked here, types included: a step samples a whole batch, and one bad row would fail every
    request in it. As in vLLM, a temperature in ``(0, 0.01)`` is raised to 0.01 (with a warning) and a single
    ``stop`` string becomes a list."""

    n: int = 1  # completions of the prompt: n sequences that share its KV blocks (``engine/sequence.py``)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # in [0.01, 100]: see REPETITION_PENALTY_RANGE
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per occurrence in the output
    max_tokens: int | None = 16
    min_tokens: int = 0  # EOS and stop_token_ids are masked, and stop strings ignored, until this many tokens
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-probability, with this many top candidates
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to those tokens' logits, in [-100, 100]
    include_stop_str_in_output: bool = False  # vLLM's: keep the matched stop string (or stop token's text)

    def __post_init__(self) -> None:
        self._check_flags()
        self._check_integers()
        self._check_numbers()
        self._check_logit_bias()
        self._check_stops()

    def _bad(self, name: str, rule: str) -> ValueError:
        return ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

    def _check_flags(self) -> None:
        """True or False only: ``bool("false")`` is True, so a string would silently mean the opposite."""
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, "must be true or false")

    def _check_integers(self) -> None:
        """Integers (never bools) within bounds that the tensors they become can hold."""
        if not _is_int(self.n) or self.n < 1:
            raise self._bad("n", "must be an integer >= 1 (the number of completions to sample for the prompt)")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= _INT32_MAX:
            raise self._bad("top_k", f"must be -1 or 0 (disabled) or a positive integer up to {_INT32_MAX}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise self._bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise self._bad("max_tokens", "must be an integer >= 1 (or None for up to max_model_len)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise self._bad("min_tokens", f"must be at most max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise self._bad(name, "must be None or an integer >= 0")
        if self.seed is not None and (not _is_int(self.seed) or not _INT64_RANGE[0] <= self.seed <= _INT64_RANGE[1]):
            raise self._bad("seed", "must be None or an integer in [-2**63, 2**63 - 1] (int64)")

    def _check_numbers(self) -> None:
        """Numbers (never strings or bools) in ranges where every processor stays finite in float32."""
        if not _is_number(self.temperature):
            raise self._bad("temperature", "must be a number")
        if not _in(self.temperature, 0, math.inf):
            raise self._bad("temperature", "must be >= 0 (0 means greedy)")
        if self.temperature > _FLOAT32_MAX:
            raise self._bad("temperature", f"must be finite in float32 (at most {_FLOAT32_MAX:.4g})")
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, where logits / temperature "
                          f"risk inf or NaN: raised to {MIN_TEMPERATURE}, as vLLM does (0 means greedy)",
                          stacklevel=4)
            self.temperature = MIN_TEMPERATURE
        if not _in(self.top_p, 0, 1) or self.top_p == 0:
            raise self._bad("top_p", "must be a number in (0, 1]")
        if not _in(self.min_p, 0, 1):
            raise self._bad("min_p", "must be a number in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        if not _in(self.repetition_penalty, low, high):
            raise self._bad("repetition_penalty", f"must be a number in [{low}, {high:g}] (1 means no penalty)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _in(getattr(self, name), -2, 2):
                raise self._bad(name, "must be a number in [-2, 2] (0 means no penalty)")

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict) or any(
                not _is_int(t) or t < 0 or not _in(b, -100, 100) for t, b in self.logit_bias.items()):
            raise self._bad("logit_bias", "must map token ids (integers >= 0) to biases in [-100, 100]")
        self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None

    def _check_stops(self) -> None:
        """``stop``: a string or a list of them, kept as a list; ``stop_token_ids``: a list of token ids."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not _list_of(self.stop, lambda s: isinstance(s, str) and bool(s)):
            raise self._bad("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop = list(self.stop or [])
        if not _list_of(self.stop_token_ids, lambda t: _is_int(t) and t >= 0):
            raise self._bad("stop_token_ids", "must be a list of non-negative integers (token ids)")
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS_TEMPERATURE

    @property
    def reads_history(self) -> bool:
        """Whether the next token's distribution depends on the tokens so far (penalties, ``min_tokens``): such a
        request decodes without speculation, whose drafted positions share one history."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.min_tokens > 0)


@dataclass
class BeamSearchParams:
    """How to beam-search one prompt (vLLM's ``BeamSearchParams``; run by ``LLM.beam_search``).

    Each prompt returns its ``beam_width`` best finished sequences, ranked by ``cum_logprob / num_output_tokens **
    length_penalty`` (1.0: the mean log-probability per token; 0: the sum, favouring short outputs; above 1 favours
    long ones). The search is deterministic, so ``temperature`` (kept for vLLM's signature) must be 0.
    ``beam_width=1`` follows greedy decoding until greedy would stop on EOS; it then keeps that finished hypothesis,
    goes on with the next-best token, and returns whichever scores better."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"BeamSearchParams.{name} {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            raise bad("beam_width", "must be an integer >= 1 (the number of beams kept)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if self.temperature != 0:
            raise bad("temperature", "must be 0: beam search is deterministic and ranks by the model's own "
                                     "log-probabilities (transformers ignores temperature when it does not sample)")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise bad("length_penalty", "must be a finite number")


@dataclass
class Logprob:
    """One candidate token's log-probability under the model, and its rank (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


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
    """The history-dependent processors' inputs for ``Sequence`` rows, each built only when a row needs it:
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
