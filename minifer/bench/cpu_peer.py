"""minifer against a production CPU engine, CTranslate2, on the same model and workload (issue 28).

A number for minifer's speed means little alone: this benchmark puts it beside CTranslate2 (a C++ engine built
for CPU inference) serving the same bundled target, converted by ``ct2-transformers-converter``, on the
headline workload (prompts 8-32 tokens, outputs exp(64) clipped to [4, 256], EOS ignored, every request at
t = 0). What counts is *useful* throughput: each request's own tokens over the wall time of the whole workload.

The engines, each in its best configuration that the same machine allows:

- minifer: its continuous-batching ``LLMEngine`` with ``slots`` sequences, ``threads`` torch threads, and the
  CPU levers this issue added (``LEVERS`` below), each selectable so its gain can be measured alone;
- CTranslate2: ``generate_batch`` with ``include_prompt_in_result=False`` (the prompt in one forward), greedy,
  ``end_token=[]`` (EOS ignored) and a per-token callback that ends each request at its own length (CT2 then
  drops the finished row from the batch). ``ct2_static`` hands it plain in-order batches; ``ct2_sorted`` hands it
  the whole workload with ``max_batch_size`` so it sorts requests by prompt length and splits them itself; two
  cores run ``inter_threads=2`` single-thread workers, CT2's own way of using them.

Rounds are interleaved (the configurations alternate their order from round to round) and every comparison is
the median of per-round ratios: the machine is shared and its speed drifts, so only ratios measured in one run
mean anything. CTranslate2 is an optional peer (``pip install "minifer[peer]"``); without it the minifer
side still runs and the result says why the peer is missing.

The project's own targets for its CPU path, and the two bounds it holds the engine to, are the course's
measurement (``python -m minifer_course.experiments.cpu_targets``): it runs this benchmark and reads them off it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minifer.bench.workloads import Workload, make_workload
from minifer.engine.components import Components

CT2_MISSING = ("CTranslate2 is not installed: the peer side of the benchmark is skipped. Install it with "
               "`pip install \"minifer[peer]\"` (or `pip install ctranslate2`; a virtual environment made with "
               "--system-site-packages keeps the shared torch) and run the command with that interpreter.")


def ct2_import():
    """``ctranslate2``, or None with ``CT2_MISSING`` printed: the peer is optional."""
    try:
        import ctranslate2
    except ImportError:
        return None
    return ctranslate2


def convert_ct2(model_path: str | Path, out_dir: str | Path, quantization: str = "float32") -> Path:
    """Convert a Hugging Face checkpoint folder with CTranslate2's own converter (what
    ``ct2-transformers-converter --quantization Q`` runs), once: an existing conversion is reused."""
    from ctranslate2.converters import TransformersConverter

    out = Path(out_dir) / f"{Path(model_path).name}-{quantization}"
    if not (out / "model.bin").exists():
        TransformersConverter(str(model_path)).convert(str(out), quantization=quantization, force=True)
    return out


# --- CTranslate2 runs ------------------------------------------------------------------------------------------


@dataclass
class CT2Engine:
    """A loaded CTranslate2 generator and the token strings of its vocabulary (it takes tokens, not ids)."""

    generator: Any
    vocab: list[str]
    workers: int
    config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path, workers: int = 1, compute_type: str = "default") -> "CT2Engine":
        import ctranslate2

        gen = ctranslate2.Generator(str(path), device="cpu", inter_threads=workers, intra_threads=1,
                                    compute_type=compute_type)
        vocab = json.loads((path / "vocabulary.json").read_text())
        config = {"path": str(path), "inter_threads": workers, "intra_threads": 1, "compute_type": compute_type,
                  "ctranslate2": ctranslate2.__version__}
        return cls(gen, vocab, workers, config)

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def generate(self, prompts: list[list[int]], lengths: list[int], max_batch_size: int = 0) -> list[list[int]]:
        """Greedy continuations of exactly ``lengths[i]`` tokens (EOS ignored). With ``workers > 1`` the call is
        asynchronous, so CT2 spreads its sub-batches over its workers."""
        results = self.generator.generate_batch(
            [self.tokens(p) for p in prompts], max_batch_size=max_batch_size, max_length=max(lengths),
            include_prompt_in_result=False, end_token=[], sampling_topk=1, callback=_stopper(lengths),
            asynchronous=self.workers > 1)
        if self.workers > 1:
            results = [r.result() for r in results]
        out = [r.sequences_ids[0] for r in results]
        for i, (o, n) in enumerate(zip(out, lengths)):
            if len(o) != n:
                raise RuntimeError(f"CTranslate2 returned {len(o)} tokens for request {i}, asked for {n}")
        return out


def ct2_static(engine: CT2Engine, workload: Workload, batch: int) -> float:
    """Plain static batching: consecutive, in-order batches of ``batch`` requests (asynchronous with two workers:
    each worker takes the next batch). Returns the wall seconds."""
    reqs = workload.requests
    t0 = time.perf_counter()
    if engine.workers > 1:  # one generate_batch call per batch would serialise them: submit them all, wait
        pending = [engine.generator.generate_batch(
            [engine.tokens(r.prompt_token_ids) for r in reqs[i : i + batch]],
            max_length=max(r.max_tokens for r in reqs[i : i + batch]), include_prompt_in_result=False,
            end_token=[], sampling_topk=1, asynchronous=True,
            callback=_stopper([r.max_tokens for r in reqs[i : i + batch]])) for i in range(0, len(reqs), batch)]
        for group in pending:
            for r in group:
                r.result()
    else:
        for i in range(0, len(reqs), batch):
            chunk = reqs[i : i + batch]
            engine.generate([r.prompt_token_ids for r in chunk], [r.max_tokens for r in chunk])
    return time.perf_counter() - t0


def _stopper(lengths: list[int]) -> Callable:
    """CT2's per-token callback that ends request ``i`` after ``lengths[i]`` tokens. It counts calls rather than
    reading ``step.step``, which also counts the prompt tokens CT2 feeds one by one to a batch's longer prompts."""
    counts = [0] * len(lengths)

    def stop(step) -> bool:
        counts[step.batch_id] += 1
        return counts[step.batch_id] >= lengths[step.batch_id]

    return stop


def ct2_sorted(engine: CT2Engine, workload: Workload, max_batch_size: int) -> float:
    """The whole workload in one call with ``max_batch_size``: CT2 sorts it by prompt length and batches it."""
    reqs = workload.requests
    t0 = time.perf_counter()
    engine.generate([r.prompt_token_ids for r in reqs], [r.max_tokens for r in reqs], max_batch_size)
    return time.perf_counter() - t0


# --- minifer runs ----------------------------------------------------------------------------------------------


def minifer_offline(llm, workload: Workload, slots: int, engine_kw: dict[str, Any] | None = None) -> float:
    """Every request at t = 0 into a fresh continuous-batching engine over ``llm``'s weights; wall seconds to the
    last token. ``engine_kw``: the engine's seams (``Components`` fields: ``attention_backend``), the levers under
    test."""
    from minifer.bench.serving import greedy_params

    engine = _engine(llm, slots, engine_kw)
    t0 = time.perf_counter()
    seqs = [engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, greedy_params(r.max_tokens))
            for r in workload.requests]
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - t0
    for s, r in zip(seqs, workload.requests):
        if len(s.output_token_ids) != r.max_tokens:
            raise RuntimeError(f"{r.request_id}: {len(s.output_token_ids)} tokens, asked for {r.max_tokens}")
    return elapsed


def minifer_greedy(llm, prompts: list[list[int]], n: int, engine_kw: dict[str, Any] | None = None) -> list[list[int]]:
    """Greedy continuations of ``n`` tokens (EOS ignored) through an engine built like ``minifer_offline``'s."""
    from minifer.bench.serving import greedy_params

    engine = _engine(llm, len(prompts), engine_kw)
    seqs = [engine.add_request(f"p{i}", {"prompt_token_ids": p}, greedy_params(n)) for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    return [list(s.output_token_ids) for s in seqs]


def _engine(llm, slots: int, engine_kw: dict[str, Any] | None):
    """A fresh ``LLMEngine`` over ``llm``'s weights: ``slots`` sequences, the default cache, ``engine_kw``'s seams."""
    from minifer.core.sched.scheduler import SchedulerConfig
    from minifer.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine

    config = EngineConfig(CacheConfig(), SchedulerConfig(slots, 2048, True), max_model_len=llm.max_model_len)
    return LLMEngine(llm.model, llm.tokenizer, llm.make_sequence, config, components=Components(**(engine_kw or {})))


def minifer_generate(llm, workload: Workload) -> float:
    """The workload through ``llm.generate`` (the front of ``data_parallel_size`` replicas); wall seconds."""
    from minifer.bench.serving import greedy_params

    reqs = workload.requests
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
                        [greedy_params(r.max_tokens) for r in reqs], use_tqdm=False)
    elapsed = time.perf_counter() - t0
    for o, r in zip(outs, reqs):
        if len(o.outputs[0].token_ids) != r.max_tokens:
            raise RuntimeError(f"{r.request_id}: {len(o.outputs[0].token_ids)} tokens, asked for {r.max_tokens}")
    return elapsed


# --- configurations, rounds, ratios ----------------------------------------------------------------------------


@dataclass
class Config:
    """One thing to time: ``run(workload)`` returns wall seconds for the workload's useful output tokens on
    ``threads``. A configuration with its own fixed request (batch 1) ignores the workload and names its ``tokens``."""

    name: str
    engine: str  # "minifer" | "ctranslate2"
    run: Callable[[Workload], float]
    tokens: int | None = None  # None: the workload's output tokens
    threads: int = 1
    describe: dict[str, Any] = field(default_factory=dict)

    def timed(self, workload: Workload) -> float:
        torch.set_num_threads(self.threads)
        return self.run(workload)

    def tokens_of(self, workload: Workload) -> int:
        return self.tokens if self.tokens is not None else _tokens(workload)


def interleaved(configs: list[Config], rounds: int, workload: Workload,
                log: Callable[[str], None] = print) -> dict[str, list[float]]:
    """Wall seconds of every configuration over ``workload`` in every round; round ``k`` runs them in reverse order
    when ``k`` is odd (A B C, C B A, ...), so a drift in the machine's speed does not favour whoever runs first."""
    times: dict[str, list[float]] = {c.name: [] for c in configs}
    for k in range(rounds):
        for c in (configs if k % 2 == 0 else configs[::-1]):
            s = c.timed(workload)
            times[c.name].append(s)
            log(f"round {k + 1}/{rounds} {c.name}: {c.tokens_of(workload) / s:,.0f} tok/s ({s:.2f} s)")
    return times


def summarize(configs: list[Config], times: dict[str, list[float]], comparisons: list[tuple[str, str, str]],
              workload: Workload) -> dict[str, Any]:
    """Median tok/s of each configuration and, for each ``(label, a, b)``, the median over rounds of a's speed
    over b's (> 1: a is faster) with its range."""
    by_name = {c.name: c for c in configs}
    per = {}
    for name, ts in times.items():
        c = by_name[name]
        tokens = c.tokens_of(workload)
        speeds = [tokens / t for t in ts]
        per[name] = {"engine": c.engine, "threads": c.threads, **c.describe, "tokens": tokens,
                     "seconds": ts, "tok_per_s": statistics.median(speeds), "tok_per_s_min": min(speeds),
                     "tok_per_s_max": max(speeds), "ms_per_token": 1e3 * statistics.median(ts) / tokens}
    ratios = {}
    for label, a, b in comparisons:
        if a in times and b in times:
            rs = [tb / ta for ta, tb in zip(times[a], times[b])]
            ratios[label] = {"a": a, "b": b, "median_of_round_ratios": statistics.median(rs), "min": min(rs),
                             "max": max(rs), "rounds": rs}
    return {"configs": per, "ratios": ratios}


def default_workload(llm, num_requests: int, seed: int = 0) -> Workload:
    """The headline workload of chapter 03 and issue 28."""
    bos = llm.tokenizer.bos_token_id if llm.tokenizer is not None else None
    return make_workload(num_requests, "uniform:8:32", "exp:64:4:256", seed=seed,
                         vocab_size=llm.model_config.vocab_size, max_model_len=llm.max_model_len, bos_token_id=bos)


def _tokens(workload: Workload) -> int:
    return workload.total_output_tokens


WARMUP_REQUESTS = 16  # the warm-up run of every configuration: enough to reach each code path once


def two_worker_batch(num_requests: int, workers: int = 2, slots: int = 64) -> int:
    """CT2's ``max_batch_size`` on ``workers`` single-thread workers: ``slots`` (minifer's replicas hold as many
    each), but never so large that a worker gets no batch. CT2 cuts the sorted workload into batches of this size
    and hands whole batches to free workers, so 64 requests in batches of 64 would leave one of two cores idle."""
    return max(1, min(slots, -(-num_requests // workers)))


def identity_check(m: "Minifer", ct2: CT2Engine, n_prompts: int = 16, n_tokens: int = 32, seed: int = 1) -> dict[str, Any]:
    """Do the two engines compute the same model? Greedy continuations of held-out random prompts, compared token
    by token (float32 both: they should agree, up to a near-tie that float rounding breaks differently)."""
    w = default_workload(m.llm, n_prompts, seed=seed)
    prompts = [r.prompt_token_ids for r in w.requests]
    ours = minifer_greedy(m.llm, prompts, n_tokens, m.engine_kw)
    theirs = ct2.generate(prompts, [n_tokens] * n_prompts)
    same = [a == b for a, b in zip(ours, theirs)]
    agree = sum(x == y for a, b in zip(ours, theirs) for x, y in zip(a, b))
    return {"prompts": n_prompts, "tokens": n_tokens, "identical_prompts": sum(same),
            "token_agreement": agree / (n_prompts * n_tokens)}


@dataclass
class Minifer:
    """An ``LLM`` (its model, with whatever the model-level levers did to it) and the ``LLMEngine`` keyword
    arguments (engine-level levers) that every run over it uses."""

    llm: Any
    engine_kw: dict[str, Any]

    def run(self, workload: Workload, slots: int) -> float:
        return minifer_offline(self.llm, workload, slots, self.engine_kw)


def peer_configs(fast: Minifer, ct2: dict[str, CT2Engine] | None, num_requests: int, replicas=None,
                 two_threads: bool = False) -> tuple[list[Config], list[tuple[str, str, str]]]:
    """The headline comparisons of issue 28: 16 and 64 slots on one core, 64 slots on two, each beside CT2's
    matching configuration, minifer with every lever on. ``num_requests``: the timed workload's size, which sets
    the batch CT2's two workers are handed (``two_worker_batch``)."""
    two_batch = two_worker_batch(num_requests)

    def mf(slots: int, threads: int) -> Config:
        return Config(f"minifer-fast-{slots}slots-{threads}t", "minifer", lambda w: fast.run(w, slots), None,
                      threads, {"slots": slots, "levers": "all"})

    configs = [mf(16, 1), mf(64, 1)]
    if two_threads:  # one engine, two torch threads per op (slow on a shared machine: see default_threads)
        configs.append(mf(64, 2))
    if replicas is not None:
        configs.append(Config("minifer-fast-64slots-dp2", "minifer", lambda w: minifer_generate(replicas, w), None,
                              2, {"slots": 64, "levers": "all", "data_parallel_size": 2}))
    comps: list[tuple[str, str, str]] = []
    if ct2:
        one, two = ct2["float32-1"], ct2["float32-2"]
        configs += [
            Config("ct2-static16-1t", "ctranslate2", lambda w: ct2_static(one, w, 16), None, 1,
                   {"batching": "in-order static batches of 16", **one.config}),
            Config("ct2-sorted64-1t", "ctranslate2", lambda w: ct2_sorted(one, w, 64), None, 1,
                   {"batching": "max_batch_size=64 (CT2 sorts by length)", **one.config}),
            Config("ct2-sorted64-2workers", "ctranslate2", lambda w: ct2_sorted(two, w, two_batch), None, 2,
                   {"batching": f"max_batch_size={two_batch} over two single-thread workers", **two.config}),
        ]
        comps += [("16 slots vs CT2 static batches of 16, 1 thread", "minifer-fast-16slots-1t", "ct2-static16-1t"),
                  ("64 slots vs CT2 max_batch_size=64, 1 thread", "minifer-fast-64slots-1t", "ct2-sorted64-1t"),
                  ("both cores: minifer 64 slots, 2 threads vs CT2 two 1-thread workers",
                   "minifer-fast-64slots-2t", "ct2-sorted64-2workers"),
                  ("both cores: minifer data_parallel_size=2 (64 slots each) vs CT2 two 1-thread workers",
                   "minifer-fast-64slots-dp2", "ct2-sorted64-2workers")]
    if replicas is not None:
        comps.append(("lever alone: data_parallel_size=2 vs one engine, 64 slots", "minifer-fast-64slots-dp2",
                      "minifer-fast-64slots-1t"))
    return configs, comps


def batch1_configs(fast: Minifer, eager: Minifer, ct2: dict[str, CT2Engine] | None, n_tokens: int = 128,
                   alone: dict[str, Minifer] | None = None) -> tuple[list[Config], list[tuple[str, str, str]]]:
    """One request, a 16-token prompt, ``n_tokens`` greedy tokens: the latency a single user sees. ``alone``: levers
    measured alone here, where a step is one matrix-vector product per weight plus the overhead around them; the
    one named ``BATCH1_LATENCY`` (the levers that pay at batch 1) is what CT2's batch 1 is compared with."""
    llm = eager.llm
    w = make_workload(1, "fixed:16", f"fixed:{n_tokens}", seed=3, vocab_size=llm.model_config.vocab_size,
                      max_model_len=llm.max_model_len, bos_token_id=llm.tokenizer.bos_token_id)
    configs = [Config("minifer-batch1-fast", "minifer", lambda _: fast.run(w, 1), n_tokens, 1, {"slots": 1}),
               Config("minifer-batch1-eager", "minifer", lambda _: eager.run(w, 1), n_tokens, 1, {"slots": 1})]
    comps = [("batch 1: fast path vs eager", "minifer-batch1-fast", "minifer-batch1-eager")]
    for name, m in (alone or {}).items():
        configs.append(Config(f"minifer-batch1-{name}", "minifer", lambda _, m=m: m.run(w, 1), n_tokens, 1,
                              {"slots": 1, "levers": name}))
        comps.append((f"lever alone: {name}, batch 1 vs eager", f"minifer-batch1-{name}", "minifer-batch1-eager"))
    if ct2:
        one = ct2["float32-1"]
        best = f"minifer-batch1-{BATCH1_LATENCY}" if BATCH1_LATENCY in (alone or {}) else "minifer-batch1-fast"
        configs.append(Config("ct2-batch1", "ctranslate2", lambda _: ct2_sorted(one, w, 1), n_tokens, 1, one.config))
        comps += [("batch 1, ms per token: minifer / CT2 speed", best, "ct2-batch1"),
                  ("batch 1, ms per token: minifer fast path / CT2 speed", "minifer-batch1-fast", "ct2-batch1")]
    return configs, comps


# batch 1's own configuration: the decoder compiled (the per-op overhead fused) over column-major weights (the
# matrix-vector products streamed); pack_weights does not combine with compiling, and pays only from 2 rows
BATCH1_LATENCY = "compile+column_major_weights"
BATCH1_LEVERS = {"compile": {"level": 3}, "column_major_weights": {"column_major_weights": True},
                 BATCH1_LATENCY: {"level": 3, "column_major_weights": True}}


def batch1_minifers(model: str) -> dict[str, Minifer]:
    from minifer import LLM

    return {name: warm_compiled(Minifer(LLM(model, device="cpu", dtype="float32", compilation_config=cc), {}))
            for name, cc in BATCH1_LEVERS.items()}


SECTIONS = ("peer", "batch1", "levers")


def add_arguments(p: argparse.ArgumentParser, sections: Sequence[str] = SECTIONS) -> None:
    """The command's flags (``python -m minifer.bench cpu_peer``; the course's ``cpu_targets`` adds a section)."""
    p.add_argument("--model", default="tinystories-target")
    p.add_argument("--num-requests", "-n", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--sections", nargs="+", default=list(sections), choices=list(sections))
    p.add_argument("--ct2-dir", default="runs/ct2", help="where converted CTranslate2 models are kept")
    p.add_argument("--no-identity", action="store_true", help="skip the greedy identity check against CT2")
    p.add_argument("--no-warmup", action="store_true", help="no warm-up run of each configuration")
    p.add_argument("--two-threads", action="store_true",
                   help="also one engine on two torch threads (slow when another process holds a core)")
    p.add_argument("--out", default=None)


def run_args(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """``run`` with the flags of ``add_arguments`` (sections it does not know are left to the caller)."""
    return run(args.model, args.num_requests, args.repeats, [s for s in args.sections if s in SECTIONS],
               args.ct2_dir, identity=not args.no_identity, two_threads=args.two_threads,
               warmup=not args.no_warmup, log=log)


def run(model: str = "tinystories-target", num_requests: int = 512, rounds: int = 3,
        sections: Sequence[str] = SECTIONS, ct2_dir: str | Path = "runs/ct2", identity: bool = True,
        two_threads: bool = False, warmup: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Everything the command measures; see the module docstring. Returns the result dict (without metadata)."""
    from minifer import LLM

    torch.set_num_threads(1)
    llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=64)
    workload = default_workload(llm, num_requests)
    fast_llm_kw, fast_engine_kw = fast_options()
    fast = warm_compiled(Minifer(LLM(model, device="cpu", dtype="float32", **fast_llm_kw), fast_engine_kw))
    eager = Minifer(llm, {})
    ct2 = None
    result: dict[str, Any] = {"kind": "cpu_peer", "workload": workload.summary(),
                              "minifer": {"model": str(llm.model_path), "dtype": "float32",
                                          "fast_llm_kw": fast_llm_kw,
                                          "fast_engine_kw": {k: str(v) for k, v in fast_engine_kw.items()}}}
    if ct2_import() is None:
        log(CT2_MISSING)
        result["ctranslate2"] = {"skipped": CT2_MISSING}
    else:
        ct2 = {f"{q}-{w}": CT2Engine.load(convert_ct2(llm.model_path, ct2_dir, q), w)
               for q in ("float32", "int8") for w in (1, 2)}
        result["ctranslate2"] = {k: e.config for k, e in ct2.items()}
        if identity:
            torch.set_num_threads(1)
            result["identity"] = identity_check(fast, ct2["float32-1"])
            log(f"greedy identity minifer vs CT2: {result['identity']}")
    configs, comps = [], []
    replicas = None
    if "peer" in sections:
        replicas = LLM(model, device="cpu", dtype="float32", max_num_seqs=64, data_parallel_size=2, **fast_llm_kw,
                       components=Components(**fast_engine_kw))
        c, r = peer_configs(fast, ct2, num_requests, replicas, two_threads)
        configs += c
        comps += r
    if "batch1" in sections:
        c, r = batch1_configs(fast, eager, ct2, alone=batch1_minifers(model))
        configs += c
        comps += r
    if "levers" in sections:
        c, r = lever_configs(eager, fast, ct2, num_requests)
        configs += c
        comps += r
    if warmup:  # first calls allocate, load kernels and fill caches: a short workload does it
        warm = default_workload(llm, min(num_requests, WARMUP_REQUESTS), seed=2)
        for c in configs:
            c.timed(warm)
    result["warmup"] = {"requests": min(num_requests, WARMUP_REQUESTS)} if warmup else False
    times = interleaved(configs, rounds, workload, log)
    if replicas is not None:
        replicas.replicas.close()
    result.update(summarize(configs, times, comps, workload))
    for label, r in result["ratios"].items():
        log(f"{label}: {r['median_of_round_ratios']:.2f}x (rounds {min(r['rounds']):.2f}-{max(r['rounds']):.2f})")
    return result


def left_out(result: dict[str, Any]) -> list[str]:
    """The levers a result measured alone (at 64 slots) and left out of its fast configuration: those ``REJECTED``
    here, and any the package no longer has (a lever that measured no gain is removed, its record stays)."""
    alone = [label.removeprefix("lever alone: ").removesuffix(", 64 slots vs eager") for label in result["ratios"]
             if label.startswith("lever alone: ") and label.endswith(", 64 slots vs eager")]
    return sorted(name for name in alone if name in REJECTED or name not in LEVERS)


def fast_options() -> tuple[dict[str, Any], dict[str, Any]]:
    """minifer with every CPU lever of issue 28 on: the ``LLM`` keyword arguments and the ``LLMEngine`` ones
    (``compilation_config`` merged over the levers that set a key of it)."""
    llm_kw: dict[str, Any] = {}
    engine_kw: dict[str, Any] = {}
    for name, (lever_llm_kw, lever_engine_kw) in LEVERS.items():
        if name in REJECTED:
            continue
        for key, value in lever_llm_kw.items():
            llm_kw[key] = {**llm_kw.get(key, {}), **value} if key == "compilation_config" else value
        engine_kw.update(lever_engine_kw())
    return llm_kw, engine_kw


def warm_compiled(m: "Minifer") -> "Minifer":
    """Compile a ``torch.compile``d model's graphs (several tokens, then one) before anything is timed: the first
    call of each takes tens of seconds, a cost paid once per process that no round should carry."""
    if getattr(m.llm.model, "compiled", None) is not None:
        minifer_greedy(m.llm, [[1, 2, 3]], 3, m.engine_kw)
    return m


def lever_configs(eager: Minifer, fast: Minifer, ct2: dict[str, CT2Engine] | None,
                  num_requests: int) -> tuple[list[Config], list[tuple[str, str, str]]]:
    """Each lever alone against the eager engine, and int8 weights: W8A8 (``quantization="w8a8"``, the integer
    GEMM; the ``int8-*`` rows) against float32 and against weight-only int8 (``"int8"``: dequantize first, the
    ``int8-reference-*`` rows), at 16 and 64 slots, and W8A8 against CT2's int8 (which also rounds the
    activations) on two cores."""
    from minifer import LLM

    path, two_batch = eager.llm.model_path, two_worker_batch(num_requests)
    int8 = Minifer(LLM(path, device="cpu", dtype="float32", quantization="w8a8"), {})
    int8_ref = Minifer(LLM(path, device="cpu", dtype="float32", quantization="int8"), {})

    def mf(name: str, m: Minifer, slots: int, threads: int = 1, **describe) -> Config:
        return Config(name, "minifer", lambda w: m.run(w, slots), None, threads, {"slots": slots, **describe})

    configs, comps = [], []
    for slots in (16, 64):
        configs += [mf(f"fp32-eager-{slots}", eager, slots, weights="float32"),
                    mf(f"int8-{slots}", int8, slots, weights="int8, w8a8_linear"),
                    mf(f"int8-reference-{slots}", int8_ref, slots, weights="int8, dequantize first")]
        comps += [(f"int8 (integer matmul) vs float32, {slots} slots", f"int8-{slots}", f"fp32-eager-{slots}"),
                  (f"int8 (integer matmul) vs int8 dequantize-first, {slots} slots", f"int8-{slots}",
                   f"int8-reference-{slots}")]
    for name, (llm_kw, engine_kw) in LEVERS.items():
        alone = warm_compiled(Minifer(LLM(path, device="cpu", dtype="float32", **llm_kw), engine_kw()))
        for slots in (16, 64):
            configs.append(mf(f"lever-{name}-{slots}", alone, slots, levers=name))
            comps.append((f"lever alone: {name}, {slots} slots vs eager", f"lever-{name}-{slots}",
                          f"fp32-eager-{slots}"))
    configs.append(mf("all-levers-64", fast, 64, levers="all"))
    comps.append(("all levers, 64 slots vs eager", "all-levers-64", "fp32-eager-64"))
    if ct2:
        two = ct2["int8-2"]
        int8_dp = LLM(path, device="cpu", dtype="float32", quantization="w8a8", max_num_seqs=64,
                      data_parallel_size=2, **fast_options()[0],
                      components=Components(**fast.engine_kw))
        configs += [Config("int8-fast-64slots-dp2", "minifer", lambda w: minifer_generate(int8_dp, w), None, 2,
                           {"slots": 64, "weights": "w8a8", "levers": "all", "data_parallel_size": 2}),
                    Config("ct2-int8-sorted64-2workers", "ctranslate2", lambda w: ct2_sorted(two, w, two_batch), None,
                           2, {"batching": f"max_batch_size={two_batch} over two workers", **two.config})]
        comps.append(("minifer int8 vs CT2 int8, 2 cores", "int8-fast-64slots-dp2", "ct2-int8-sorted64-2workers"))
    return configs, comps


def _no_engine_kw() -> dict[str, Any]:
    return {}


# name -> (LLM keyword arguments, a function making the LLMEngine keyword arguments) that turn the lever on alone
LEVERS: dict[str, tuple[dict[str, Any], Callable[[], dict[str, Any]]]] = {
    "pack_weights": ({"compilation_config": {"pack_weights": True}}, _no_engine_kw),
    "compile": ({"compilation_config": {"level": 3}}, _no_engine_kw),
    "column_major_weights": ({"compilation_config": {"column_major_weights": True}}, _no_engine_kw),
}
# measured alone and not reliably faster at 16 and 64 slots, so left out of the throughput configuration (still
# measured, so the result says so): compile (the decoder through torch.compile) pays at batch 1, where it is part of
# BATCH1_LATENCY, but not with many rows per step, and it does not combine with pack_weights. Three attention levers
# that measured no gain were removed from the package (benchmarks/results/README.md, "CPU peer")
REJECTED = {"compile"}
