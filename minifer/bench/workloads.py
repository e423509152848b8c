"""Seeded synthetic workloads for the serving benchmarks: how long each prompt and each output is, and
when each request arrives.

Prompts are random token ids (after BOS, id 0 for the bundled TinyStories models) and every request is
sent with ``ignore_eos=True`` and ``max_tokens`` = its drawn output length, so a request produces *exactly*
the tokens the workload says, whatever the model would have written. That makes runs of different engines
do the same work, and makes the scheduler-step bound (``serving.step_bound``) exact.

Length distributions are written as short specs (the CLI takes them as strings):

- ``fixed:N``                  every request has N tokens;
- ``uniform:LO:HI``            uniform integers in [LO, HI];
- ``exp:MEAN:LO:HI``           ``floor`` of an exponential draw of the given mean, clipped to [LO, HI];
- ``lognormal:MEAN:SIGMA:LO:HI`` a log-normal of the given *mean* and log-space sigma, clipped to [LO, HI];
- ``sharegpt``                 the ShareGPT-like pair below (input and output at once).

ShareGPT-like (``SHAREGPT``): the vLLM paper (Kwon et al., SOSP 2023, §6.1 and Fig. 11) reports mean
lengths of 161 input and 338 output tokens for ShareGPT conversations ("8.4x longer input prompts and 5.8x
longer outputs than Alpaca", whose means are 19.3 and 58.5), with long right tails. We draw both from
log-normals with those means and sigma 1.0 — median = mean / e^(sigma^2/2), i.e. 98 and 205 tokens; about
5% of inputs exceed 500 tokens — which reproduces "most requests are short, a few are very long". Lengths
are then clipped to the model's context: input to [4, max_model_len // 2], output to [4, max_model_len -
input]. With the bundled models' 1024-token context the clipping lowers the realised means a little (the
workload records the means it actually drew). A real trace would have correlated input/output lengths;
ours are independent, which is what the step bound and the chapter need.

Arrivals: ``poisson_arrivals(n, rate, seed)`` — exponential gaps of mean ``1 / rate`` seconds (a Poisson
process, as in vLLM's ``benchmark_serving.py``); ``rate = inf`` puts every request at t = 0 (an offline
throughput run).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

# ShareGPT-like means (vLLM paper, Fig. 11) and the log-space sigma we give both lengths.
SHAREGPT_INPUT_MEAN = 161.0
SHAREGPT_OUTPUT_MEAN = 338.0
SHAREGPT_SIGMA = 1.0

KINDS = ("fixed", "uniform", "exp", "lognormal")


@dataclass(frozen=True)
class LengthSpec:
    """A distribution of token counts. ``params`` by kind: fixed (n,), uniform (lo, hi), exp (mean, lo, hi),
    lognormal (mean, sigma, lo, hi)."""

    kind: str
    params: tuple[float, ...]

    def __post_init__(self) -> None:
        arity = {"fixed": 1, "uniform": 2, "exp": 3, "lognormal": 4}
        if self.kind not in arity:
            raise ValueError(f"unknown length distribution {self.kind!r}: use one of {', '.join(KINDS)}")
        if len(self.params) != arity[self.kind]:
            raise ValueError(f"{self.kind} takes {arity[self.kind]} parameters, got {list(self.params)}")
        lo, hi = self.bounds
        if lo < 1 or hi < lo:
            raise ValueError(f"{self}: lengths must satisfy 1 <= low <= high, got [{lo}, {hi}]")

    @classmethod
    def parse(cls, spec: str) -> "LengthSpec":
        """``"fixed:32"``, ``"uniform:8:32"``, ``"exp:64:4:256"``, ``"lognormal:161:1.0:4:512"``."""
        kind, *rest = spec.strip().split(":")
        aliases = {"exponential": "exp", "const": "fixed", "log-normal": "lognormal"}
        kind = aliases.get(kind, kind)
        try:
            params = tuple(float(x) for x in rest)
        except ValueError:
            raise ValueError(f"bad length spec {spec!r}: parameters must be numbers") from None
        return cls(kind, params)

    @property
    def bounds(self) -> tuple[int, int]:
        p = self.params
        if self.kind == "fixed":
            return int(p[0]), int(p[0])
        return int(p[-2]), int(p[-1])

    def __str__(self) -> str:
        return ":".join([self.kind, *(f"{x:g}" for x in self.params)])

    def sample(self, rng: random.Random, high: int | None = None) -> int:
        """One length, clipped to the spec's bounds and, if given, to ``high`` (e.g. the room left in the context)."""
        p = self.params
        lo, hi = self.bounds
        if high is not None:
            hi = min(hi, high)
        if self.kind == "fixed":
            x = int(p[0])
        elif self.kind == "uniform":
            x = rng.randint(int(p[0]), int(p[1]))
        elif self.kind == "exp":
            x = int(rng.expovariate(1.0 / p[0]))
        else:
            mean, sigma = p[0], p[1]
            mu = math.log(mean) - sigma * sigma / 2  # so that E[x] = mean before clipping
            x = int(rng.lognormvariate(mu, sigma))
        return max(min(x, hi), min(lo, hi))


def sharegpt_specs(max_model_len: int) -> tuple[LengthSpec, LengthSpec]:
    """The ShareGPT-like input and output distributions for a model of ``max_model_len`` tokens."""
    inp = LengthSpec("lognormal", (SHAREGPT_INPUT_MEAN, SHAREGPT_SIGMA, 4, max(4, max_model_len // 2)))
    out = LengthSpec("lognormal", (SHAREGPT_OUTPUT_MEAN, SHAREGPT_SIGMA, 4, max(4, max_model_len - 4)))
    return inp, out


@dataclass
class BenchRequest:
    """One request of a workload: its prompt, exactly how many tokens it generates, and when it arrives
    (seconds after the start of the run)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: float = 0.0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Workload:
    """A seeded list of requests and the parameters that produced it (stored in every result JSON)."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def input_lens(self) -> list[int]:
        return [r.prompt_len for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.max_tokens for r in self.requests]

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    def summary(self) -> dict[str, Any]:
        ins, outs = self.input_lens, self.output_lens
        n = max(len(ins), 1)
        return {"name": self.name, **self.params, "realised": {
            "num_requests": len(self.requests), "mean_input": sum(ins) / n, "mean_output": sum(outs) / n,
            "max_input": max(ins, default=0), "max_output": max(outs, default=0),
            "total_input_tokens": sum(ins), "total_output_tokens": sum(outs),
            "duration_of_arrivals": max((r.arrival for r in self.requests), default=0.0)}}

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "requests": [asdict(r) for r in self.requests]}


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from 0) of ``n`` requests of a Poisson process of ``rate`` requests/s.
    ``rate = inf`` (or <= 0 is refused): everything arrives at 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 (inf for all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def make_workload(num_requests: int, input_spec: str | LengthSpec = "uniform:8:32",
                  output_spec: str | LengthSpec = "exp:64:4:256", *, seed: int = 0, vocab_size: int = 2048,
                  max_model_len: int = 1024, bos_token_id: int | None = 0, rate: float = math.inf,
                  name: str | None = None) -> Workload:
    """``num_requests`` requests with lengths drawn from the specs (``"sharegpt"`` for either spec selects
    the ShareGPT-like pair) and Poisson arrivals at ``rate`` (inf: all at 0). Same arguments, same workload.

    The prompt length counts the BOS token. Prompt tokens are drawn from ``[1, vocab_size)`` so that no
    prompt token after BOS is the BOS/EOS id 0. Output lengths are clipped so prompt + output fits in
    ``max_model_len``."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if "sharegpt" in (str(input_spec), str(output_spec)):
        in_spec, out_spec = sharegpt_specs(max_model_len)
        name = name or "sharegpt"
    else:
        in_spec = input_spec if isinstance(input_spec, LengthSpec) else LengthSpec.parse(input_spec)
        out_spec = output_spec if isinstance(output_spec, LengthSpec) else LengthSpec.parse(output_spec)
    if in_spec.bounds[0] >= max_model_len:
        raise ValueError(f"input lengths start at {in_spec.bounds[0]}, no room left in max_model_len={max_model_len}")
    rng = random.Random(f"workload-{seed}")
    low_token = 1 if vocab_size > 1 else 0
    requests = []
    for i in range(num_requests):
        n_in = in_spec.sample(rng, high=max_model_len - 1)
        n_out = out_spec.sample(rng, high=max_model_len - n_in)
        body = n_in - 1 if bos_token_id is not None else n_in
        ids = ([bos_token_id] if bos_token_id is not None else []) + [rng.randrange(low_token, vocab_size)
                                                                        for _ in range(body)]
        requests.append(BenchRequest(f"req-{i}", ids, n_out))
    for r, t in zip(requests, poisson_arrivals(num_requests, rate, seed)):
        r.arrival = t
    params = {"num_requests": num_requests, "seed": seed, "input": str(in_spec), "output": str(out_spec),
              "rate": rate if math.isfinite(rate) else "inf", "vocab_size": vocab_size,
              "max_model_len": max_model_len, "bos_token_id": bos_token_id, "ignore_eos": True}
    return Workload(name or f"in={in_spec},out={out_spec}", requests, params)
