"""Sampling parameters: how one request is sampled, with vLLM's names and defaults, checked on construction.

Every field is validated here, before the request reaches the engine: a step samples a whole batch, and one bad
row would fail every request in it. ``Logprob`` is what a request gets back for each token it asked logprobs of.
"""

from __future__ import annotations

import bisect
import functools
import math
import warnings
from dataclasses import dataclass

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


@dataclass(frozen=True)
class StopStrings:
    """A request's stop strings as a set and their distinct lengths, built once per request. Looking for one in
    the characters a token added costs at most (new characters x distinct lengths) set lookups, however many
    strings there are: a request with ten thousand stop strings costs the engine's other requests no more per
    token than one with a few of the same lengths."""

    strings: frozenset[str]
    lengths: tuple[int, ...]  # ascending

    @classmethod
    def of(cls, stop: list[str]) -> StopStrings:
        return cls(frozenset(stop), tuple(sorted({len(s) for s in stop})))

    @property
    def longest(self) -> int:
        return self.lengths[-1] if self.lengths else 0

    def find(self, text: str, after: int) -> tuple[int, str] | None:
        """The stop string in ``text`` that starts first (the shortest, at a tie) among those that end past
        ``after`` characters (endings before were looked for when those characters came), or None."""
        for begin in range(max(0, after - self.longest + 1), len(text)):
            for n in self.lengths[bisect.bisect_right(self.lengths, after - begin) :]:  # those ending past `after`
                if begin + n > len(text):
                    break
                if text[begin : begin + n] in self.strings:
                    return begin, text[begin : begin + n]
        return None


@dataclass
class SamplingParams:
    """How to sample one request. Defaults are vLLM's (note ``max_tokens=16``).

    Every field is checked here, types included: a step samples a whole batch, and one bad row would fail every
    request in it. As in vLLM, a temperature in ``(0, 0.01)`` is raised to 0.01 (with a warning) and a single
    ``stop`` string becomes a list."""

    n: int = 1  # completions of the prompt: n sequences that share its KV blocks (``request.py``)
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

    @functools.cached_property
    def stop_strings(self) -> StopStrings:
        return StopStrings.of(self.stop)

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids)

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
