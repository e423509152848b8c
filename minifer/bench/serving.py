"""Serving benchmarks: offline throughput and online (Poisson) latency, static vs continuous batching, and
minifer vs transformers' ``generate`` (chapter 03).

Three engines serve the same seeded workload (``minifer.bench.workloads``):

- ``continuous``: minifer's ``LLMEngine`` driven *online*: a request is added when its arrival time has
  passed, and ``step()`` runs one iteration-level scheduled forward pass. A fresh engine (empty paged KV
  pool and prefix cache) serves every run, so a repeated run cannot hit the previous run's cached prompts.
- ``static``: a static-batching server. When it is idle it takes up to ``max_num_seqs`` of the requests
  that have arrived (oldest first) and runs ``run_static_batch`` on them to completion; requests arriving
  meanwhile wait for the whole batch. This is the honest baseline: the same model code and sampler as
  ``continuous``, only the batching differs.
- ``hf``: the same static server around transformers' ``AutoModelForCausalLM.generate`` on the same
  checkpoint folder: left-padded batches, greedy, ``min_new_tokens = max_new_tokens`` = the batch's longest
  request. ``generate`` cannot stop one row early when EOS is ignored, so, like ``static``, a batch runs to
  its longest request. A streamer records when each step's tokens come out.

Every request's timestamps (``time.perf_counter``) give, as in vLLM's ``benchmark_serving.py``:

- TTFT: first token - arrival (queueing + prefill);
- TPOT: (last token - first token) / (output tokens - 1), one value per request with >= 2 tokens;
- ITL: every gap between consecutive tokens of a request, pooled over requests;
- E2E latency: last token - arrival;
- throughput: requests (and output tokens) completed / (last completion - start of the run).

A request's *own* output tokens count, never the padding rows a static batch keeps computing. A row of a
static batch is complete (streamed to its client) at its own last token, even if the batch runs on.

Speed is only ever compared *within* one run, with the engines interleaved (A B B A ...) and medians taken,
because the CPUs these benchmarks run on are shared and their speed drifts.

The scheduler-step bound (``step_bound``) is what batching alone can gain, whatever a step costs: a static
batch of S requests takes as many forward passes as its longest output (the pass over the prompt samples
the first token in both engines, so a request of n tokens holds its slot for n passes), while continuous
batching refills a slot the step after it frees. The measured throughput ratio is that step ratio times the
ratio of the two engines' time per step.
"""

from __future__ import annotations

import heapq
import json
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from minifer.bench.provenance import git_commit, metadata, save_result  # noqa: F401 (re-exported)
from minifer.bench.workloads import BenchRequest, LengthSpec, Workload, make_workload
from minifer.sampling_params import SamplingParams

MODES = ("static", "continuous", "hf")
MODE_LABELS = {"static": "minifer static", "continuous": "minifer continuous", "hf": "transformers generate"}


# --- the scheduler-step bound -----------------------------------------------------------------------


def static_steps(output_lens: Sequence[int], slots: int) -> int:
    """Forward passes of static batching: consecutive batches of ``slots`` requests (in order), each
    running as many passes as its longest output (the prefill pass samples the first token)."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    return sum(max(output_lens[i : i + slots]) for i in range(0, len(output_lens), slots))


def continuous_steps(output_lens: Sequence[int], slots: int) -> int:
    """Forward passes of ideal continuous batching: every step each busy slot produces one token and a slot
    freed at the end of a step takes the next queued request (in order) at the following step.

    Equivalent to list scheduling: each request goes to the slot that frees first, so the answer is the
    latest finish time (``O(n log slots)``)."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    free_at = [0] * min(slots, max(len(output_lens), 1))
    end = 0
    for n in output_lens:
        t = heapq.heappop(free_at) + n
        end = max(end, t)
        heapq.heappush(free_at, t)
    return end


def step_bound(output_lens: Sequence[int], slots: int) -> dict[str, float]:
    """``static_steps / continuous_steps``: the throughput gain continuous batching can get from scheduling
    alone (equal cost per step). It grows with the spread of output lengths (a static batch waits for its
    longest member) and with the number of requests (the tail of the last batches weighs less)."""
    s, c = static_steps(output_lens, slots), continuous_steps(output_lens, slots)
    return {"slots": slots, "static_steps": s, "continuous_steps": c, "ratio": s / c if c else float("nan"),
            "useful_token_steps": sum(output_lens)}


def bound_curve(num_requests: Iterable[int], output_spec: str | LengthSpec, slots: int = 16, *,
                seeds: Iterable[int] = range(5)) -> list[dict[str, float]]:
    """The bound for growing numbers of requests drawn from ``output_spec`` (mean and spread over seeds),
    for a chapter's plot."""
    spec = output_spec if isinstance(output_spec, LengthSpec) else LengthSpec.parse(output_spec)
    rows = []
    for n in num_requests:
        ratios = [step_bound(make_workload(n, "fixed:1", spec, seed=s).output_lens, slots)["ratio"] for s in seeds]
        rows.append({"num_requests": n, "ratio_mean": statistics.fmean(ratios), "ratio_min": min(ratios),
                     "ratio_max": max(ratios)})
    return rows


# --- latency statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return float("nan")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: Sequence[float]) -> dict[str, float]:
    """Mean, p50, p90, p99 and max (NaN for an empty list), in the values' unit."""
    if not values:
        nan = float("nan")
        return {"mean": nan, "p50": nan, "p90": nan, "p99": nan, "max": nan, "count": 0}
    return {"mean": statistics.fmean(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values), "count": len(values)}


@dataclass
class RequestTiming:
    """One finished request's timestamps, in seconds from the start of the run."""

    request_id: str
    prompt_len: int
    num_output_tokens: int
    arrival: float
    first_scheduled: float
    first_token: float
    finished: float
    token_times: list[float] = field(default_factory=list, repr=False)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival

    @property
    def queue(self) -> float:
        return self.first_scheduled - self.arrival

    @property
    def tpot(self) -> float | None:
        n = self.num_output_tokens
        return (self.finished - self.first_token) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def compact(self) -> dict[str, Any]:
        d = asdict(self)
        del d["token_times"]
        return d


def serving_metrics(timings: Sequence[RequestTiming], duration: float | None = None) -> dict[str, Any]:
    """Throughput and latency statistics of a run (latencies in milliseconds). ``duration``: seconds from
    the start of the run to the last completion (default: the latest ``finished``)."""
    if duration is None:
        duration = max((t.finished for t in timings), default=0.0)
    n_out = sum(t.num_output_tokens for t in timings)
    n_in = sum(t.prompt_len for t in timings)
    ms = lambda xs: [1e3 * x for x in xs]  # noqa: E731
    tpots = [t.tpot for t in timings if t.tpot is not None]
    return {
        "num_requests": len(timings),
        "duration_s": duration,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(timings) / duration if duration > 0 else float("nan"),
        "output_throughput": n_out / duration if duration > 0 else float("nan"),
        "total_token_throughput": (n_in + n_out) / duration if duration > 0 else float("nan"),
        "ttft_ms": describe(ms([t.ttft for t in timings])),
        "tpot_ms": describe(ms(tpots)),
        "itl_ms": describe(ms([g for t in timings for g in t.itls])),
        "e2e_ms": describe(ms([t.e2e for t in timings])),
        "queue_ms": describe(ms([t.queue for t in timings])),
    }


# --- the three servers ---------------------------------------------------------------------------


@dataclass
class RunResult:
    mode: str
    timings: list[RequestTiming]
    duration: float  # seconds from the start to the last completion
    steps: int  # forward passes
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds_per_step(self) -> float:
        return self.duration / self.steps if self.steps else float("nan")

    def metrics(self) -> dict[str, Any]:
        m = serving_metrics(self.timings, self.duration)
        return {"mode": self.mode, **m, "steps": self.steps, "ms_per_step": 1e3 * self.seconds_per_step,
                **self.extra}


def greedy_params(max_tokens: int) -> SamplingParams:
    """What every benchmark request asks for: exactly ``max_tokens`` greedy tokens."""
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def _timing_from_sequence(seq, r: BenchRequest, t0: float) -> RequestTiming:
    m = seq.metrics
    if not seq.is_finished or len(seq.output_token_ids) != r.max_tokens:
        raise RuntimeError(f"request {r.request_id} ended with {len(seq.output_token_ids)} of {r.max_tokens} tokens "
                           f"({seq.finish_reason})")
    return RequestTiming(r.request_id, r.prompt_len, len(seq.output_token_ids), r.arrival,
                         m.first_scheduled_time - t0, m.first_token_time - t0, m.finished_time - t0,
                         [x - t0 for x in m.token_times])


def _sleep_until(t: float) -> None:
    while (d := t - time.perf_counter()) > 0:
        time.sleep(min(d, 0.05))


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True, disable=not enabled, leave=False)


def run_continuous(llm, workload: Workload, *, max_num_seqs: int = 16, max_num_batched_tokens: int = 2048,
                   enable_chunked_prefill: bool = True, enable_prefix_caching: bool = True,
                   progress: bool = True) -> RunResult:
    """Serve the workload online with a fresh ``LLMEngine`` over ``llm``'s model (see the module docstring)."""
    from minifer.core.sched.scheduler import SchedulerConfig
    from minifer.engine.llm_engine import CacheConfig, LLMEngine

    engine = LLMEngine.from_llm(llm, CacheConfig(enable_prefix_caching=enable_prefix_caching),
                                SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill))
    reqs = sorted(workload.requests, key=lambda r: r.arrival)
    seqs = []
    steps = i = 0
    bar = _bar(len(reqs), "continuous", progress)
    t0 = time.perf_counter()
    while i < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < len(reqs) and reqs[i].arrival <= now:
            r = reqs[i]
            seq = engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids},
                                     greedy_params(r.max_tokens))
            seq.metrics.arrival_time = t0 + r.arrival
            seqs.append((seq, r))
            i += 1
        if not engine.has_unfinished_requests():
            _sleep_until(t0 + reqs[i].arrival)
            continue
        done = sum(out.finished for out in engine.step())
        steps += 1
        if done:
            bar.update(done)
    bar.close()
    timings = [_timing_from_sequence(s, r, t0) for s, r in seqs]
    stats = engine.stats()
    return RunResult("continuous", timings, max(t.finished for t in timings), steps,
                     {"num_preemptions": stats["num_preemptions"],
                      "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"]})


def _run_static_server(workload: Workload, max_batch: int, run_batch: Callable[[list[BenchRequest], float], tuple[
        list[RequestTiming], int]], mode: str, progress: bool) -> RunResult:
    """A static-batching server: when idle, take up to ``max_batch`` arrived requests (oldest first) and run
    them to completion with ``run_batch(requests, t0) -> (timings, forward passes)``."""
    reqs = sorted(workload.requests, key=lambda r: r.arrival)
    timings: list[RequestTiming] = []
    steps = i = 0
    bar = _bar(len(reqs), mode, progress)
    t0 = time.perf_counter()
    queue: list[BenchRequest] = []
    while i < len(reqs) or queue:
        now = time.perf_counter() - t0
        while i < len(reqs) and reqs[i].arrival <= now:
            queue.append(reqs[i])
            i += 1
        if not queue:
            _sleep_until(t0 + reqs[i].arrival)
            continue
        batch, queue = queue[:max_batch], queue[max_batch:]
        got, n = run_batch(batch, t0)
        timings += got
        steps += n
        bar.update(len(batch))
    bar.close()
    return RunResult(mode, timings, max(t.finished for t in timings), steps)


def run_static(llm, workload: Workload, *, max_num_seqs: int = 16, progress: bool = True) -> RunResult:
    """Serve the workload with a static-batching server over ``run_static_batch`` (minifer's baseline)."""
    from minifer.engine.static import run_static_batch

    def run_batch(batch: list[BenchRequest], t0: float) -> tuple[list[RequestTiming], int]:
        seqs = []
        for r in batch:
            seq = llm.make_sequence(0, {"prompt_token_ids": r.prompt_token_ids}, greedy_params(r.max_tokens),
                                    request_id=r.request_id)
            seq.metrics.arrival_time = t0 + r.arrival
            seqs.append(seq)
        decode_steps = run_static_batch(llm.model, seqs, llm.tokenizer)
        return [_timing_from_sequence(s, r, t0) for s, r in zip(seqs, batch)], decode_steps + 1

    return _run_static_server(workload, max_num_seqs, run_batch, "static", progress)


class _StepRecorder:
    """A transformers streamer that records when each generated step comes out (the first ``put`` is the
    prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf_model(llm):
    """transformers' model on the same checkpoint folder, dtype and device as ``llm``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llm.model_path), dtype=llm.dtype).to(llm.device).eval()
    return model


def run_hf(hf_model, workload: Workload, *, batch_size: int = 16, pad_token_id: int = 0,
           progress: bool = True) -> RunResult:
    """Serve the workload with a static-batching server around ``hf_model.generate`` (left padding, greedy,
    each batch generating exactly its longest request's tokens)."""
    device = next(hf_model.parameters()).device

    @torch.inference_mode()
    def run_batch(batch: list[BenchRequest], t0: float) -> tuple[list[RequestTiming], int]:
        p = max(r.prompt_len for r in batch)
        m = max(r.max_tokens for r in batch)
        ids = torch.full((len(batch), p), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), p), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, p - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[row, p - r.prompt_len:] = 1
        rec = _StepRecorder()
        start = time.perf_counter()
        out = hf_model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=m,
                                min_new_tokens=m, do_sample=False, pad_token_id=pad_token_id, streamer=rec)
        if out.shape[1] - p != m or len(rec.times) != m:
            raise RuntimeError(f"transformers generated {out.shape[1] - p} tokens ({len(rec.times)} streamed), "
                               f"expected {m}")
        timings = [RequestTiming(r.request_id, r.prompt_len, r.max_tokens, r.arrival, start - t0,
                                 rec.times[0] - t0, rec.times[r.max_tokens - 1] - t0,
                                 [x - t0 for x in rec.times[: r.max_tokens]]) for r in batch]
        return timings, m

    return _run_static_server(workload, batch_size, run_batch, "hf", progress)


# --- experiments -----------------------------------------------------------------------------------


def _runner(mode: str, llm, hf_model, max_num_seqs: int, hf_batch_size: int, progress: bool, engine_kw: dict):
    if mode == "continuous":
        return lambda w: run_continuous(llm, w, max_num_seqs=max_num_seqs, progress=progress, **engine_kw)
    if mode == "static":
        return lambda w: run_static(llm, w, max_num_seqs=max_num_seqs, progress=progress)
    if mode == "hf":
        return lambda w: run_hf(hf_model, w, batch_size=hf_batch_size, progress=progress)
    raise ValueError(f"unknown mode {mode!r}: use {', '.join(MODES)}")


def _warmup(runners: dict[str, Callable], workload: Workload, n: int) -> None:
    """A few short requests through every engine (allocator, thread pools, lazy imports) before timing."""
    small = Workload("warmup", [BenchRequest(r.request_id, r.prompt_token_ids, min(r.max_tokens, 8))
                                for r in workload.requests[:n]])
    for run in runners.values():
        run(small)


def _ratio_summary(runs: list[dict[str, Any]], a: str, b: str, key: str = "output_throughput") -> dict[str, float]:
    """Throughput ratio a / b: the median of the per-round ratios (each round ran both, close in time) and the
    ratio of the medians."""
    rounds = sorted({r["round"] for r in runs})
    by = {(r["mode"], r["round"]): r for r in runs}
    paired = [by[(a, k)][key] / by[(b, k)][key] for k in rounds if (a, k) in by and (b, k) in by]
    med = lambda m: statistics.median(r[key] for r in runs if r["mode"] == m)  # noqa: E731
    return {"median_of_round_ratios": statistics.median(paired), "ratio_of_medians": med(a) / med(b),
            "round_ratios": paired}


def summarize_runs(runs: list[dict[str, Any]], bound: dict[str, float] | None) -> dict[str, Any]:
    modes = [m for m in MODES if any(r["mode"] == m for r in runs)]
    per_mode = {}
    for m in modes:
        rs = [r for r in runs if r["mode"] == m]
        per_mode[m] = {k: statistics.median(r[k] for r in rs) for k in
                       ("output_throughput", "request_throughput", "duration_s", "steps", "ms_per_step")}
        per_mode[m]["output_throughput_min"] = min(r["output_throughput"] for r in rs)
        per_mode[m]["output_throughput_max"] = max(r["output_throughput"] for r in rs)
    ratios = {}
    if "continuous" in modes and "static" in modes:
        rc = _ratio_summary(runs, "continuous", "static")
        steps = _ratio_summary(runs, "static", "continuous", "steps")
        step_time = _ratio_summary(runs, "continuous", "static", "ms_per_step")
        rc["measured_step_ratio"] = steps["median_of_round_ratios"]
        rc["step_time_ratio"] = step_time["median_of_round_ratios"]  # continuous ms/step over static ms/step
        if bound is not None:
            rc["bound"] = bound["ratio"]
            rc["fraction_of_bound"] = rc["median_of_round_ratios"] / bound["ratio"]
        ratios["continuous/static"] = rc
    for a in ("continuous", "static"):
        if a in modes and "hf" in modes:
            ratios[f"{a}/hf"] = _ratio_summary(runs, a, "hf")
    return {"per_mode": per_mode, "ratios": ratios}


def _order(modes: Sequence[str], k: int) -> list[str]:
    """A B C in even rounds, C B A in odd ones: each engine runs early and late equally often."""
    return list(modes) if k % 2 == 0 else list(reversed(modes))


def throughput_benchmark(llm, workload: Workload, *, modes: Sequence[str] = ("static", "continuous"),
                         repeats: int = 3, max_num_seqs: int = 16, hf_batch_size: int = 16, hf_model=None,
                         warmup: bool = True, progress: bool = True, engine_kw: dict | None = None,
                         log: Callable[[str], None] = print) -> dict[str, Any]:
    """Offline throughput (every request at t = 0), the engines interleaved ``repeats`` times."""
    if "hf" in modes and hf_model is None:
        hf_model = load_hf_model(llm)
    runners = {m: _runner(m, llm, hf_model, max_num_seqs, hf_batch_size, progress, engine_kw or {}) for m in modes}
    if warmup:
        _warmup(runners, workload, min(len(workload.requests), 2 * max_num_seqs))
    runs = []
    for k in range(repeats):
        for m in _order(modes, k):
            res = runners[m](workload)
            row = {"round": k, **res.metrics()}
            runs.append(row)
            log(f"round {k} {m:>10}: {row['output_throughput']:8.1f} output tok/s, {row['request_throughput']:6.2f} "
                f"req/s, {row['steps']} steps, {row['ms_per_step']:.2f} ms/step, {row['duration_s']:.1f} s")
    bound = step_bound(workload.output_lens, max_num_seqs)
    return {"kind": "throughput", "workload": workload.summary(), "step_bound": bound, "runs": runs,
            "summary": summarize_runs(runs, bound)}


def serve_benchmark(llm, make: Callable[[float], Workload], rates: Sequence[float], *,
                    modes: Sequence[str] = ("static", "continuous"), repeats: int = 1, max_num_seqs: int = 16,
                    hf_batch_size: int = 16, hf_model=None, warmup: bool = True, progress: bool = True,
                    engine_kw: dict | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Poisson arrivals at each rate (``make(rate)`` gives the seeded workload), engines interleaved."""
    if "hf" in modes and hf_model is None:
        hf_model = load_hf_model(llm)
    runners = {m: _runner(m, llm, hf_model, max_num_seqs, hf_batch_size, progress, engine_kw or {}) for m in modes}
    if warmup:
        _warmup(runners, make(math.inf), min(2 * max_num_seqs, 32))
    out = []
    for rate in rates:
        w = make(rate)
        runs = []
        for k in range(repeats):
            for m in _order(modes, k):
                row = {"round": k, **runners[m](w).metrics()}
                runs.append(row)
                log(f"rate {rate:g} req/s round {k} {m:>10}: TTFT p50 {row['ttft_ms']['p50']:8.1f} ms p99 "
                    f"{row['ttft_ms']['p99']:8.1f} ms | TPOT p50 {row['tpot_ms']['p50']:6.1f} ms | E2E p50 "
                    f"{row['e2e_ms']['p50']:8.1f} ms | {row['output_throughput']:7.1f} tok/s")
        out.append({"rate": rate, "workload": w.summary(), "runs": runs,
                    "step_bound": step_bound(w.output_lens, max_num_seqs)})
    return {"kind": "serve", "rates": out}


def default_results_path(name: str) -> Path:
    """``runs/NAME`` at the repository root in a checkout (git-ignored), else under the current directory."""
    root = Path(__file__).resolve().parents[2]
    base = root if (root / "pyproject.toml").is_file() else Path.cwd()
    return base / "runs" / name


# --- where a step's time goes ------------------------------------------------------------------------


def _profile_targets() -> dict[str, tuple[str, int, str]]:
    """pstats keys (file, first line, name) of the functions whose time we attribute."""
    import inspect

    from minifer import request as sequence
    from minifer.attention import layer as attention
    from minifer.attention.backends import paged as paged_attention
    from minifer.core import kv_cache_manager as kv_cache_manager
    from minifer.core.sched import scheduler
    from minifer.engine import llm_engine, static
    from minifer.models import llama
    from minifer.sample import sampler as sampling
    from minifer.worker import model_runner as runner

    def key(fn) -> tuple[str, int, str]:
        fn = inspect.unwrap(fn)
        return (inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1], fn.__name__)

    return {
        "engine.step": key(llm_engine.LLMEngine.step),
        "run_static_batch": key(static.run_static_batch),
        "scheduler.schedule": key(scheduler.Scheduler.schedule),
        "runner.execute": key(runner.ModelRunner.execute_model),
        "paged metadata build": key(paged_attention.PagedAttentionMetadata.build),
        "model forward": key(llama.LlamaModel.forward),
        "attention (paged attend)": key(paged_attention.PagedKVCache.attend),
        "attention (contiguous attend)": key(attention.ContiguousKVCache.attend),
        "paged_attention_reference": key(paged_attention.paged_attention_reference),
        "contiguous begin_step": key(attention.ContiguousKVCache.begin_step),
        "block_manager.register_computed": key(kv_cache_manager.KVCacheManager.register_computed),
        "sampler (sample)": key(sampling.sample),
        "Sequence.append_token": key(sequence.Request.append_token),
        "Sequence.to_output (detokenize)": key(sequence.Request.to_output),
    }


_BUILTINS = {"matmuls (torch linear)": "<built-in method torch._C._nn.linear>",
             "SDPA kernel": "<built-in method torch._C._nn.scaled_dot_product_attention>",
             "torch.where": "<built-in method torch.where>"}


def profile_breakdown(stats: dict, steps: int, wall: float) -> dict[str, dict[str, float]]:
    """Cumulative seconds (and ms per step, share of the wall time) of the engine's components, from a
    ``pstats.Stats(...).stats`` dict. Times include cProfile's overhead, which inflates Python-heavy parts."""
    targets = _profile_targets()
    out: dict[str, dict[str, float]] = {}

    def put(name: str, seconds: float, calls: int) -> None:
        out[name] = {"seconds": seconds, "ms_per_step": 1e3 * seconds / steps if steps else float("nan"),
                     "share": seconds / wall if wall else float("nan"), "calls": calls}

    for name, (file, line, fn) in targets.items():
        for (f, ln, n), (cc, nc, tt, ct, _) in stats.items():
            if n == fn and ln == line and f == file and nc:
                put(name, ct, nc)
    for name, builtin in _BUILTINS.items():
        for (f, ln, n), (cc, nc, tt, ct, _) in stats.items():
            if n == builtin:
                put(name, tt, nc)
    if "paged_attention_reference" in out and "SDPA kernel" in out:
        gather = out["paged_attention_reference"]["seconds"] - out["SDPA kernel"]["seconds"]
        put("paged gather/mask/scatter (reference minus SDPA)", gather, out["paged_attention_reference"]["calls"])
    return out


def profile_modes(llm, workload: Workload, *, modes: Sequence[str] = ("static", "continuous"),
                  max_num_seqs: int = 16, engine_kw: dict | None = None, top: int = 25,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """One cProfile'd run of each engine on ``workload``: the component breakdown (ms per step) and the
    top functions by own time."""
    import cProfile
    import io
    import pstats

    hf_model = load_hf_model(llm) if "hf" in modes else None
    runners = {m: _runner(m, llm, hf_model, max_num_seqs, max_num_seqs, False, engine_kw or {}) for m in modes}
    _warmup(runners, workload, min(len(workload.requests), 2 * max_num_seqs))
    result: dict[str, Any] = {"kind": "profile", "modes": {}}
    for m in modes:
        prof = cProfile.Profile()
        prof.enable()
        res = runners[m](workload)
        prof.disable()
        st = pstats.Stats(prof)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        breakdown = profile_breakdown(st.stats, res.steps, res.duration)
        result["modes"][m] = {"duration_s": res.duration, "steps": res.steps,
                              "ms_per_step": 1e3 * res.seconds_per_step,
                              "output_throughput": sum(t.num_output_tokens for t in res.timings) / res.duration,
                              "breakdown": breakdown, "top_tottime": buf.getvalue()}
        log(f"== {m}: {res.steps} steps, {1e3 * res.seconds_per_step:.2f} ms/step under cProfile")
        for name, b in sorted(breakdown.items(), key=lambda kv: -kv[1]["seconds"]):
            log(f"   {name:<52} {b['ms_per_step']:8.3f} ms/step {b['share']:6.1%}  ({b['calls']} calls)")
    return result


# --- plots -----------------------------------------------------------------------------------------


def plot_throughput(result: dict[str, Any], ax=None):
    """Bars of median output tokens/s per engine (whiskers: min and max over rounds), with the measured
    continuous/static ratio and its scheduler-step bound in the title."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    per_mode = result["summary"]["per_mode"]
    modes = list(per_mode)
    med = [per_mode[m]["output_throughput"] for m in modes]
    lo = [med[i] - per_mode[m]["output_throughput_min"] for i, m in enumerate(modes)]
    hi = [per_mode[m]["output_throughput_max"] - med[i] for i, m in enumerate(modes)]
    colors = {"static": "tab:orange", "continuous": "tab:blue", "hf": "tab:gray"}
    ax.bar([MODE_LABELS.get(m, m) for m in modes], med, yerr=[lo, hi], capsize=4,
           color=[colors.get(m, "tab:green") for m in modes])
    for i, v in enumerate(med):
        ax.text(i, v + hi[i], f"{v:.0f}", ha="center", va="bottom")
    ax.set_ylabel("output tokens / s (median over rounds)")
    w = result["workload"]
    title = f"{w['realised']['num_requests']} requests, in {w.get('input')}, out {w.get('output')}"
    r = result["summary"]["ratios"].get("continuous/static")
    if r is not None:
        title += (f"\ncontinuous / static = {r['median_of_round_ratios']:.2f}x"
                  f" (step bound {r.get('bound', float('nan')):.2f}x)")
    ax.set_title(title, fontsize=9)
    return ax


def plot_serve(result: dict[str, Any], fig=None):
    """TTFT, TPOT and E2E latency (p50 solid, p99 dashed) and output throughput against the request rate,
    one line per engine (medians over rounds)."""
    import matplotlib.pyplot as plt

    if fig is None:
        fig = plt.figure(figsize=(10, 7))
    axes = fig.subplots(2, 2)
    colors = {"static": "tab:orange", "continuous": "tab:blue", "hf": "tab:gray"}
    rates = [r["rate"] for r in result["rates"]]
    modes = [m for m in MODES if any(run["mode"] == m for r in result["rates"] for run in r["runs"])]

    def med(r, m, key, stat=None):
        vals = [run[key][stat] if stat else run[key] for run in r["runs"] if run["mode"] == m]
        return statistics.median(vals) if vals else float("nan")

    panels = [(axes[0, 0], "ttft_ms", "TTFT (ms)", "log"), (axes[0, 1], "tpot_ms", "TPOT (ms)", "linear"),
              (axes[1, 0], "e2e_ms", "end-to-end latency (ms)", "log")]
    for ax, key, label, scale in panels:
        for m in modes:
            ax.plot(rates, [med(r, m, key, "p50") for r in result["rates"]], "o-", color=colors[m],
                    label=f"{MODE_LABELS[m]} p50")
            ax.plot(rates, [med(r, m, key, "p99") for r in result["rates"]], "s--", color=colors[m], alpha=0.6,
                    label=f"{MODE_LABELS[m]} p99")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_yscale(scale)
        ax.grid(alpha=0.3)
    ax = axes[1, 1]
    for m in modes:
        ax.plot(rates, [med(r, m, "output_throughput") for r in result["rates"]], "o-", color=colors[m],
                label=MODE_LABELS[m])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens / s")
    ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    axes[1, 1].legend(fontsize=7)
    w = result["rates"][0]["workload"]
    fig.suptitle(f"Poisson arrivals, {w['realised']['num_requests']} requests per rate, in {w.get('input')}, "
                 f"out {w.get('output')}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_bound(result: dict[str, Any], ax=None):
    """The scheduler-step bound against the number of requests, one line per output-length distribution."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for spec, rows in result["curves"].items():
        n = [r["num_requests"] for r in rows]
        ax.plot(n, [r["ratio_mean"] for r in rows], "o-", label=spec)
        ax.fill_between(n, [r["ratio_min"] for r in rows], [r["ratio_max"] for r in rows], alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("number of requests")
    ax.set_ylabel("static steps / continuous steps")
    ax.set_title(f"scheduler-step bound, {result['slots']} slots", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, title="output lengths")
    return ax


def plot_profile(result: dict[str, Any], ax=None):
    """Milliseconds per step of each profiled component, one bar per engine."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 5))
    modes = list(result["modes"])
    size = {}
    for m in modes:
        for n, b in result["modes"][m]["breakdown"].items():
            size[n] = max(size.get(n, 0.0), b["ms_per_step"])
    names = sorted(size, key=size.get)  # largest at the top
    height = 0.8 / max(len(modes), 1)
    for j, m in enumerate(modes):
        b = result["modes"][m]["breakdown"]
        ax.barh([i + j * height for i in range(len(names))], [b.get(n, {}).get("ms_per_step", 0) for n in names],
                height=height, label=f"{MODE_LABELS.get(m, m)} ({result['modes'][m]['ms_per_step']:.1f} ms/step)")
    ax.set_yticks([i + height * (len(modes) - 1) / 2 for i in range(len(names))], names, fontsize=7)
    ax.set_xlabel("ms per step (cumulative, under cProfile)")
    ax.legend(fontsize=8)
    return ax


def plot_file(path: str | Path, out: str | Path | None = None) -> Path:
    """Draw the figure of one result JSON (by its ``kind``) next to it, or at ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    result = json.loads(path.read_text())
    kind = result.get("kind")
    if kind == "throughput":
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        plot_throughput(result, ax)
        fig.tight_layout()
    elif kind == "serve":
        fig = plt.figure(figsize=(10, 7))
        plot_serve(result, fig)
    elif kind == "bound":
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        plot_bound(result, ax)
        fig.tight_layout()
    elif kind == "profile":
        fig, ax = plt.subplots(figsize=(9, 5))
        plot_profile(result, ax)
        fig.tight_layout()
    else:
        raise ValueError(f"{path}: unknown result kind {kind!r}")
    out = Path(out) if out is not None else path.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


__all__ = ["static_steps", "continuous_steps", "step_bound", "bound_curve", "percentile", "describe",
           "RequestTiming", "serving_metrics", "RunResult", "run_continuous", "run_static", "run_hf",
           "load_hf_model", "throughput_benchmark", "serve_benchmark", "metadata", "save_result", "MODES",
           "plot_file", "profile_modes",
           "plot_throughput", "plot_serve", "plot_bound", "plot_profile"]
