"""What ``LLM.generate`` returns, with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass, field

from minifer.sampling_params import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" (EOS, stop string or stop token) or "length"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it; None for EOS
    new_token_ids: list[int] = field(default_factory=list)  # tokens added since the previous report (streaming)
    delta_text: str = ""  # text added since the previous report (streaming)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter`` seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    # SamplingParams(prompt_logprobs=k): per prompt token, its log-probability given the tokens before it and the
    # top k candidates (None for the first token, which nothing predicts)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
