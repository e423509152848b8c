"""One request's state while it is generated: tokens so far, how it samples, and when it must stop.

Both batching modes (static here, continuous in the engine chapters) drive the same ``Request``: they
differ in *which* sequences share a forward pass, never in how a sequence appends a token or decides that
it is finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from minifer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minifer.sampling_params import Logprob, SamplingParams


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens clipped to what max_model_len leaves after the prompt
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None = None
    index: int = 0  # which completion of its request this is (``SamplingParams.n > 1``: see ``ParentRequest``)
    parent_id: str | None = None  # that request's id, for a completion of one
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # filled as the prompt is computed
    cumulative_logprob: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (paged engine)
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None  # set when finished (cut at a stop string if one matched: before it, or after it)
    stopped_on_token: bool = False  # finished on a stop token or EOS, whose text the final text leaves out
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    _reported_tokens: int = 0  # how many output tokens earlier streaming reports covered
    _reported_text: str = ""
    _text_so_far: str = ""  # incremental detokenization: the text of output_token_ids[:_read_offset]
    _prefix_offset: int = 0
    _read_offset: int = 0
    _decoded_prompt_logprobs: int = 0  # prompt_logprobs entries whose tokens to_output has decoded

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.index == 0:  # a group's first completion reports them
            self.prompt_logprobs = [None]  # nothing predicts the first token

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt positions still have to be computed for their log-probabilities: such a prompt takes no
        prefix-cache hits (a cached token's logits are never computed) until all are recorded."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without copying the whole sequence first."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token: int, logprob: float, entry: dict[int, Logprob] | None, tokenizer) -> None:
        """Record a sampled token and check, in order: stop token / EOS, stop string, length."""
        now = time.perf_counter()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.token_times.append(now)
        self.output_token_ids.append(token)
        self.cumulative_logprob += logprob
        if self.logprobs is not None and entry is not None:
            if tokenizer is not None:
                for t, lp in entry.items():
                    lp.decoded_token = tokenizer.decode([t])
            self.logprobs.append(entry)
        p = self.params
        # With stop strings, the text grows a token at a time (incrementally, a short window per token), and a
        # stop string is looked for only where it could end in this token's new characters: earlier endings
        # were looked for at earlier tokens. Checking only from min_tokens on is then vLLM's rule ("a stop
        # string counts only if it ends in text from the min_tokens-th token on") with no re-decoding.
        text = text_before = None
        if p.stop and tokenizer is not None:
            text_before = len(self._text_so_far)
            text = self._detokenize(tokenizer)
        if len(self.output_token_ids) < self.min_tokens:  # nothing stops it before min_tokens (vLLM's rule)
            return
        if token in p.stop_token_set:
            self._finish("stop", token)
            self.stopped_on_token = True
        elif not p.ignore_eos and token in self.eos_token_ids:
            self._finish("stop", None)
            self.stopped_on_token = True
        elif text is not None and self._match_stop_string(text, text_before):
            pass
        elif len(self.output_token_ids) >= self.max_tokens:
            self._finish("length", None)

    @property
    def min_tokens(self) -> int:
        """``params.min_tokens``, within the room the context leaves (``max_tokens`` is capped by max_model_len)."""
        return min(self.params.min_tokens, self.max_tokens)

    @property
    def stop_ids(self) -> set[int]:
        """The tokens that would end this sequence: its stop tokens, and EOS unless ``ignore_eos``."""
        return set(self.params.stop_token_ids) | (set() if self.params.ignore_eos else set(self.eos_token_ids))

    def _match_stop_string(self, text: str, text_before: int) -> bool:
        """Finish at the earliest stop string that ends past ``text_before`` characters of ``text``. As in vLLM,
        the text ends before the stop string, or just after it with ``include_stop_str_in_output``."""
        hit = self.params.stop_strings.find(text, text_before)
        if hit is None:
            return False
        pos, s = hit
        self._finish("stop", s)
        self.text = text[: pos + len(s)] if self.params.include_stop_str_in_output else text[:pos]
        return True

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.metrics.finished_time = time.perf_counter()

    def abort(self) -> None:
        self._finish("abort", None)

    def _detokenize(self, tokenizer) -> str:
        """The output's text so far, decoding only a short window of tokens per call.

        Decoding the whole output every step costs O(length) per step. Instead (as vLLM does) decode the
        tokens since ``_prefix_offset`` with and without the new ones and append the difference; the few
        tokens of overlap give the tokenizer the context it needs for spaces and merges. Text that ends in
        an incomplete multi-byte character (U+FFFD) waits for the next token."""
        ids = self.output_token_ids
        skip = self.params.skip_special_tokens
        prefix = tokenizer.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=skip)
        full = tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=skip)
        if not full.startswith(prefix):  # the window changed what came before: decode everything once
            whole = tokenizer.decode(ids, skip_special_tokens=skip)
            if not whole.endswith("\ufffd"):
                self._text_so_far, self._prefix_offset, self._read_offset = whole, len(ids) - 1, len(ids)
        elif len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._text_so_far += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return self._text_so_far

    def _final_text(self, tokenizer) -> str:
        """The finished text: one full decode, exact by construction. A stop token or EOS that ended the
        sequence stays in ``token_ids`` but not in the text (vLLM's rule), unless ``include_stop_str_in_output``.
        A stream never sent that token's text: the token that finishes a sequence is never reported unfinished."""
        ids = self.output_token_ids
        if self.stopped_on_token and not self.params.include_stop_str_in_output:
            ids = ids[:-1]
        return tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def to_output(self, tokenizer) -> RequestOutput:
        """The request so far; ``new_token_ids`` / ``delta_text`` hold what changed since the last call."""
        text = self.text
        if text is None:
            if tokenizer is None:
                text = ""
            elif self.is_finished:
                text = self.text = self._final_text(tokenizer)
            else:
                text = self._detokenize(tokenizer)
        stable = text
        if self.params.stop and not self.is_finished and not self.params.include_stop_str_in_output:
            # Hold back what could be the start of a stop string: if it completes, the text is cut before it,
            # and a stream must never have sent what the final text does not contain (vLLM does the same).
            # With include_stop_str_in_output the cut is after the stop string, which ends in characters not
            # reported yet (only endings past the text already checked count): nothing to hold back.
            hold = self.params.stop_strings.longest - 1
            stable = text[: max(len(text) - hold, len(self._reported_text))]
        delta = stable[len(self._reported_text):] if stable.startswith(self._reported_text) else stable
        new_ids = self.output_token_ids[self._reported_tokens:]
        self._reported_tokens, self._reported_text = len(self.output_token_ids), stable
        completion = CompletionOutput(
            index=self.index, text=text, token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.params.logprobs is not None else None,
            logprobs=self.logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            new_token_ids=new_ids, delta_text=delta)
        if self.prompt_logprobs is not None and tokenizer is not None:
            for entry in self.prompt_logprobs[self._decoded_prompt_logprobs :]:  # the entries added since last time
                for t, lp in (entry or {}).items():
                    lp.decoded_token = tokenizer.decode([t])
            self._decoded_prompt_logprobs = len(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [completion],
                             self.is_finished, self.metrics, self.prompt_logprobs)


@dataclass
class ParentRequest:
    """One request with ``SamplingParams.n > 1``: n completions sampled from one prompt (parallel sampling).

    Each completion is an ordinary ``Request``, so the scheduler, the sampler and speculation never hear of
    groups. As in vLLM, completion ``i`` is the sequence ``f"{i}_{request_id}"`` and, when the request has a
    seed, draws from ``seed + i`` (n copies of one seed would sample n identical texts).

    The completions share the prompt. With prefix caching on and a prompt that fills a block before its last
    token, only the first completion is scheduled at once; the others stay ``pending`` until its prompt is
    computed, then take the prompt's blocks from the prefix cache (PagedAttention's memory sharing, Kwon et al.
    2023, §4.4), all but the block of the last prompt token, whose logits each needs. The price is one step of
    latency for the siblings' first token. Otherwise all n are scheduled at once and share nothing.
    """

    request_id: str
    seqs: list[Request]
    pending: list[Request] = field(default_factory=list)  # siblings not yet given to the scheduler

    @classmethod
    def fan_out(cls, seq: Request) -> "ParentRequest":
        """The n completions of a validated request (``seq.params.n > 1``), each a ``Request`` with ``n=1``."""
        n, seed = seq.params.n, seq.params.seed
        children = []
        for i in range(n):
            child_seed = None if seed is None else _wrap_int64(seed + i)
            params = replace(seq.params, n=1, seed=child_seed)
            generator = seq.generator
            if seed is not None:
                device = seq.generator.device if seq.generator is not None else "cpu"
                generator = torch.Generator(device=device).manual_seed(child_seed)
            children.append(Request(f"{i}_{seq.request_id}", seq.prompt, list(seq.prompt_token_ids), params,
                                     seq.max_tokens, seq.eos_token_ids, generator=generator, index=i,
                                     parent_id=seq.request_id, metrics=RequestMetrics(seq.metrics.arrival_time)))
        return cls(seq.request_id, children)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def metrics(self) -> RequestMetrics:
        """The request's life: from its arrival to its first token (of any completion) and to its last."""
        def first(times):
            times = [t for t in times if t is not None]
            return min(times) if times else None

        m = [s.metrics for s in self.seqs]
        return RequestMetrics(m[0].arrival_time, first(x.first_scheduled_time for x in m),
                              first(x.first_token_time for x in m),
                              max(x.finished_time for x in m) if self.is_finished else None,  # type: ignore[type-var]
                              sorted(t for x in m for t in x.token_times))

    def merge(self, outputs: list[RequestOutput]) -> RequestOutput:
        """One report of the request from its completions' reports (``outputs``: some of them, e.g. the ones
        that advanced this step), completions in index order."""
        first = self.seqs[0]
        completions = sorted((o.outputs[0] for o in outputs), key=lambda c: c.index)
        return RequestOutput(self.request_id, first.prompt, list(first.prompt_token_ids), completions,
                             self.is_finished, self.metrics(), first.prompt_logprobs)

    def to_output(self, tokenizer) -> RequestOutput:
        return self.merge([s.to_output(tokenizer) for s in self.seqs])


def _wrap_int64(seed: int) -> int:
    """``seed`` wrapped into int64, the range ``SamplingParams.seed`` accepts (``seed + i`` may overflow it).
    ``manual_seed`` reads a seed as unsigned 64-bit, so the wrapped seed gives the very same generator."""
    return (seed + 2**63) % 2**64 - 2**63


def sequences_of(request: Request | ParentRequest) -> list[Request]:
    """The sequences a request runs as: itself, or a group's completions."""
    return request.seqs if isinstance(request, ParentRequest) else [request]
