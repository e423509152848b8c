"""Measure before stacking (chapter 06): the four serving levers of chapters 03-05, each on its own and stacked,
on one workload in one memory budget.

    python -m minifer_course.stacking --out benchmarks/results/stacking.json --plot
    python -m minifer_course.stacking --smoke            # seconds, for CI

The levers, in the order the course applies them:

- ``continuous``: continuous batching instead of static batching (chapter 03);
- ``speculative``: the draft model proposes ``k`` tokens per step, the target verifies them (chapter 04);
- ``int8_weights``: int8 weights, per output channel, run as W8A8 (``INT8_WEIGHTS``: each token's activations rounded
  to int8 too, so that on the CPU the layers multiply in an integer GEMM instead of dequantizing every weight at every
  step; chapter 05 measures the weight-only format's quality, this lever is about speed and memory). Whether the
  integer GEMM is fast depends on the CPU (``int8_dot_instructions``);
- ``int8_kv``: the paged KV cache in int8 with a scale per (token, head) (chapter 05).

**One memory budget.** A GPU holds the weights and the KV cache in one memory, and vLLM gives the cache what the
weights leave (``gpu_memory_utilization``). The benchmark does the same on any device: every configuration gets
``memory`` bytes, its weights (the target's, plus the draft's when it speculates) are taken off, and the rest becomes
KV blocks (``kv_blocks``). So quantization is a *concurrency* lever too: int8 weights leave more memory to the cache
and an int8 cache holds twice the tokens of a bfloat16 one in the same bytes (3.8 times a float32 one's), while a
draft model costs some (its weights and its own cache). More blocks mean more requests decoding at once, which is
where batching's throughput comes from (chapter 03), and exactly where speculation's gain shrinks (chapter 04). That
is why the gains overlap.

**What runs.** Static batching with nothing else (the starting point), then the continuous engine with every subset
of the other three levers (a full 2x2x2 factorial, so each lever's gain can be read in every context), plus a second
plain continuous engine: the A/A control, whose "gain" over the first is the measurement's noise floor. Static
batching gets as many rows as its contiguous cache can hold at the workload's longest prompt plus longest output
(what a static server must reserve); the others get the same budget as paged blocks.

**How it is timed.** Every configuration serves the same seeded offline workload (all requests at t = 0, story
openings as prompts, output lengths drawn from ``output``, EOS ignored, greedy), as whole runs in a fresh random order
in every round. A gain is baseline time / configuration time *within* a round; ``lever_analysis`` reads each round's
gains, and the reported readings are medians over rounds: on a shared machine speed drifts, and two runs seconds
apart see nearly the same drift. The tokens are compared with the plain continuous engine's: speculation alone must
give the very same tokens (it is lossless), int8 changes some, and the result says how many.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from minifer.sampling_params import SamplingParams

LEVERS = ("continuous", "speculative", "int8_weights", "int8_kv")
INT8_WEIGHTS = "w8a8"  # the int8_weights lever's quantization (the module docstring says why W8A8)
SHORT = {"continuous": "CB", "speculative": "spec", "int8_weights": "W8", "int8_kv": "KV8"}
DRAFT = "tinystories-draft"
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # x86 instructions that multiply int8 codes natively


def int8_dot_instructions(cpuinfo: str | None = None) -> tuple[bool | None, str]:
    """Whether this CPU multiplies int8 codes natively, and the instruction set that says so (``/proc/cpuinfo``).

    Why it matters: W8A8's integer GEMM (``torch._int_mm``) runs on oneDNN's VNNI or AMX kernels when the CPU has
    them; without them PyTorch falls back to a generic loop many times slower than a float32 GEMM, and the
    int8_weights lever loses on step time what it wins in memory. (None: not known, e.g. not Linux.)"""
    from minifer.bench.machine import cpuinfo_field

    flags = cpuinfo_field("flags", cpuinfo)
    if flags is None:
        return None, "unknown (no /proc/cpuinfo)"
    found = [f for f in INT8_DOT_FLAGS if f in flags.split()]
    return (True, ", ".join(found)) if found else (False, "none (no AVX-512 VNNI, AVX-VNNI or AMX)")


# --- the configurations --------------------------------------------------------------------------------


def label(levers: frozenset[str] | set[str] | tuple[str, ...]) -> str:
    """``"static"`` for no lever, else the levers' short names in the course's order: ``"CB+spec+W8"``."""
    unknown = set(levers) - set(LEVERS)
    if unknown:
        raise ValueError(f"unknown lever(s) {sorted(unknown)}: use {', '.join(LEVERS)}")
    return "+".join(SHORT[x] for x in LEVERS if x in levers) or "static"


def configurations() -> list[frozenset[str]]:
    """Static batching alone, then continuous batching with every subset of the other levers (static batching
    cannot host them: speculation and the 8-bit cache live in the paged, continuous engine)."""
    others = LEVERS[1:]
    subsets = [frozenset(("continuous", *c)) for r in range(len(others) + 1) for c in itertools.combinations(others, r)]
    return [frozenset(), *subsets]


# --- reading the gains ---------------------------------------------------------------------------------


def lever_analysis(gain: dict[frozenset[str], float]) -> dict[str, Any]:
    """What the factorial says, from each configuration's throughput gain over static batching.

    - ``alone``: each lever's gain on its own: continuous over static, every other lever over plain continuous
      batching (its only host);
    - ``product``: what multiplying the ``alone`` gains predicts for all four stacked;
    - ``stacked``: what all four measured;
    - ``overlap``: ``product / stacked``, how far the naive estimate overshoots (1.0 if the gains were independent,
      below 1 if the levers help each other);
    - ``in_stack``: each lever's gain as the last one added, on top of all the others (its marginal gain where it
      will actually run);
    - ``contexts``: each lever's gain on top of every subset of the other two non-batching levers;
    - ``path``: the cumulative gain along the course's order, and each step's factor.
    """
    need = set(configurations())
    missing = [label(c) for c in need if c not in gain]
    if missing:
        raise ValueError(f"lever_analysis needs every configuration; missing {', '.join(sorted(missing))}")
    full = frozenset(LEVERS)
    cb = frozenset({"continuous"})
    alone = {"continuous": gain[cb] / gain[frozenset()]}
    alone |= {x: gain[cb | {x}] / gain[cb] for x in LEVERS[1:]}
    # the others need the continuous engine, so continuous batching cannot be removed from the stack alone
    in_stack = {"continuous": alone["continuous"], **{x: gain[full] / gain[full - {x}] for x in LEVERS[1:]}}
    contexts = {}
    for x in LEVERS[1:]:
        rest = [y for y in LEVERS[1:] if y != x]
        rows = []
        for r in range(len(rest) + 1):
            for c in itertools.combinations(rest, r):
                ctx = cb | set(c)
                rows.append({"with": label(ctx), "gain": gain[ctx | {x}] / gain[ctx]})
        contexts[x] = rows
    product = math.prod(alone.values())
    path, cur = [], frozenset()
    for x in LEVERS:
        nxt = cur | {x}
        path.append({"add": x, "config": label(nxt), "step_gain": gain[nxt] / gain[cur],
                     "cumulative": gain[nxt] / gain[frozenset()]})
        cur = nxt
    stacked = gain[full] / gain[frozenset()]
    return {"alone": alone, "product": product, "stacked": stacked, "overlap": product / stacked,
            "in_stack": in_stack, "contexts": contexts, "path": path}


# --- one memory budget ---------------------------------------------------------------------------------


def model_bytes(model: torch.nn.Module) -> int:
    """Every tensor the module holds (parameters and buffers: codes, scales, rotary tables): its memory."""
    seen, total = set(), 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t is not None and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


@dataclass
class Budget:
    """How one configuration spends the memory budget."""

    memory: int
    weight_bytes: int
    kv_bytes: int
    kv_blocks: int
    block_bytes: int
    static_rows: int | None = None

    def as_dict(self) -> dict[str, int | None]:
        return dict(self.__dict__)


def split_budget(memory: int, weight_bytes: int, block_bytes: int, block_size: int, *,
                 static_tokens_per_row: int | None = None, paged: bool = False) -> Budget:
    """``memory`` minus the weights, in KV blocks; for static batching, the rows of ``static_tokens_per_row``
    tokens that fit (a contiguous cache reserves a row's longest possible length up front).

    ``paged``: count the blocks as the engine does (``llm_engine.usable_blocks``): its cache allocates two more,
    a scratch and a null block, from the same memory, and ``kv_blocks`` is the ones a request can get."""
    from minifer.engine.llm_engine import usable_blocks

    kv = memory - weight_bytes
    whole = kv // block_bytes if kv > 0 else 0
    blocks = usable_blocks(max(kv, 0), block_bytes) if paged else whole
    if blocks < 1:
        raise ValueError(f"a memory budget of {memory:,} bytes leaves {kv:,} bytes for the KV cache after "
                         f"{weight_bytes:,} bytes of weights: not one block of {block_bytes:,} bytes. Raise memory.")
    rows = None
    if static_tokens_per_row is not None:
        rows = blocks * block_size // static_tokens_per_row
        if rows < 1:
            raise ValueError(f"a static batch row needs {static_tokens_per_row} tokens of cache but the budget "
                             f"holds {blocks * block_size}: raise memory")
    return Budget(memory, weight_bytes, (whole if paged else blocks) * block_bytes, blocks, block_bytes, rows)


# --- the runs ------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """Prompts (token ids) and each request's exact number of output tokens."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def longest(self) -> int:
        """The longest request: prompt plus output."""
        return max(len(p) + m for p, m in zip(self.prompts, self.max_tokens))

    @property
    def static_row_tokens(self) -> int:
        """What one row of a static batch must reserve: a batch is padded to its longest prompt and decodes to its
        longest output (``run_static_batch``), so a server sizing its batches up front reserves both maxima."""
        return max(map(len, self.prompts)) + max(self.max_tokens)

    def params(self) -> list[SamplingParams]:
        return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in self.max_tokens]


def tokenizer_for(model: str):
    """The tokenizer of a bundled name, local folder or hub id (the prompts are made before any engine)."""
    from minifer.model_loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model))


def make_workload(tokenizer, num_requests: int, output: str, seed: int = 0) -> Workload:
    """Held-out story openings (8 words) with output lengths drawn from ``output`` (``exp:MEAN:LO:HI`` ...)."""
    from minifer.bench.speculative import story_openings
    from minifer.bench.workloads import LengthSpec

    spec = LengthSpec.parse(output)
    rng = random.Random(seed)
    texts = story_openings(num_requests)
    prompts = [tokenizer.encode(t) for t in texts]
    if tokenizer.bos_token_id is not None:
        prompts = [p if p[:1] == [tokenizer.bos_token_id] else [tokenizer.bos_token_id, *p] for p in prompts]
    return Workload(prompts, [spec.sample(rng) for _ in range(num_requests)])


class Engines:
    """Every configuration's ``LLM``, built on two loaded weight sets (the model's dtype and W8A8) and one draft,
    each given its share of ``memory``.

    ``one_at_a_time`` (the default on a GPU): ``llms[name]`` builds a configuration's engine when it is asked for
    and frees the one built before, so only the weights and one engine's KV cache are ever resident. Ten
    engines of ``memory`` each do not fit beside each other in a 16 GB GPU; on the CPU, where memory is not
    the limit, every engine is built up front as before."""

    def __init__(self, model: str, draft: str, memory: int | None, workload: Workload, *, device: str | None = None,
                 k: int = 4, max_num_seqs: int = 64, kv_memory: int = 8 * 2**20, block_size: int = 16,
                 one_at_a_time: bool | None = None) -> None:
        from minifer import LLM
        from minifer.engine.llm_engine import CacheConfig, kv_block_bytes
        from minifer.entrypoints.llm import resolve_device

        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "adaptive": False}
        # the holders: loaded once each, with a one-block cache and no CUDA graphs (they never serve); every engine
        # below shares their weights
        common = dict(device=device, block_size=block_size, enable_prefix_caching=False, num_kv_blocks=1,
                      enforce_eager=True)
        self.holders = {None: LLM(model, speculative_config=spec, **common),
                        INT8_WEIGHTS: LLM(model, speculative_config=spec, quantization=INT8_WEIGHTS, **common)}
        full = self.holders[None]
        self.tokenizer = full.tokenizer
        draft_model = full.draft_model
        self.memory = memory if memory is not None else model_bytes(full.model) + kv_memory
        self.workload, self.block_size, self.k, self.max_num_seqs = workload, block_size, k, max_num_seqs
        if one_at_a_time is None:
            one_at_a_time = resolve_device(device).type == "cuda"
        self.llms: LazyEngines = LazyEngines(keep_all=not one_at_a_time)
        self.budgets: dict[str, Budget] = {}
        for levers in configurations():
            quant = INT8_WEIGHTS if "int8_weights" in levers else None
            holder = self.holders[quant]
            spec_on = "speculative" in levers
            kv = "int8" if "int8_kv" in levers else "auto"
            weights = model_bytes(holder.model) + (model_bytes(draft_model) if spec_on else 0)
            per_block = kv_block_bytes(holder.model, CacheConfig(block_size=block_size, kv_cache_dtype=kv),
                                       draft_model if spec_on else None)
            if levers:
                b = split_budget(self.memory, weights, per_block, block_size, paged=True)
                self.llms.add(label(levers), functools.partial(
                    LLM, model, device=device, block_size=block_size, enable_prefix_caching=False,
                    num_kv_blocks=b.kv_blocks, max_num_seqs=max_num_seqs, kv_cache_dtype=kv, quantization=quant,
                    share_weights_with=holder, speculative_config=spec if spec_on else None))
            else:
                b = split_budget(self.memory, weights, per_block, block_size,
                                 static_tokens_per_row=workload.static_row_tokens)
                self.llms.add("static", functools.partial(LLM, model, device=device, batching="static",
                                                          max_num_seqs=b.static_rows, share_weights_with=holder))
            self.budgets[label(levers)] = b
        a = self.budgets["CB"]
        self.llms.add("CB (A/A)", functools.partial(LLM, model, device=device, block_size=block_size,
                                                    enable_prefix_caching=False, num_kv_blocks=a.kv_blocks,
                                                    max_num_seqs=max_num_seqs, share_weights_with=full))
        self.budgets["CB (A/A)"] = a


class LazyEngines(Mapping):
    """``name -> LLM`` for ``Engines``: every engine built when added (``keep_all``), or each built when asked
    for, the previous one freed first (its KV cache released to the device) so that one is resident at a time."""

    def __init__(self, keep_all: bool) -> None:
        self.keep_all = keep_all
        self._make: dict[str, Callable[[], Any]] = {}
        self._built: dict[str, Any] = {}

    def add(self, name: str, make: Callable[[], Any]) -> None:
        self._make[name] = make
        if self.keep_all:
            self._built[name] = make()

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            make = self._make[name]  # KeyError for an unknown name, before anything is freed
            self._built.clear()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._built[name] = make()
        return self._built[name]

    def __iter__(self):
        return iter(self._make)

    def __len__(self) -> int:
        return len(self._make)


def run_once(llm, workload: Workload) -> dict[str, Any]:
    """Serve the whole workload (all requests at once). The continuous engine is stepped here so that its
    concurrency (requests decoding per step) and preemptions can be recorded; static batching runs its batches."""
    from minifer.bench.serving import static_steps

    params = workload.params()
    t0 = time.perf_counter()
    if llm.engine is None:
        outs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        # rows computing per step, finished ones included: a batch holds all its rows until its longest ends
        rows, lens = llm.max_num_seqs, workload.max_tokens
        steps = static_steps(lens, rows)
        row_steps = sum(len(lens[i:i + rows]) * max(lens[i:i + rows]) for i in range(0, len(lens), rows))
        return {"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                "mean_running": row_steps / steps, "steps": steps, "preemptions": 0}
    engine = llm.engine
    preempt0 = engine.scheduler.num_preemptions
    seqs = [llm.make_sequence(i, {"prompt_token_ids": p}, sp)
            for i, (p, sp) in enumerate(zip(workload.prompts, params))]
    for s in seqs:
        engine.scheduler.check_fits(s)
        engine.add_sequence(s)
    running, steps = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        running += len(engine.scheduler.running)
        steps += 1
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": [list(s.output_token_ids) for s in seqs],
            "mean_running": running / max(steps, 1), "steps": steps,
            "preemptions": engine.scheduler.num_preemptions - preempt0}


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict[str, float]:
    """``identical``: the fraction of requests whose tokens equal the reference's; ``prefix``: the mean fraction
    of each request's tokens before its first difference (greedy decoding drifts after one changed token)."""
    same, prefix = 0, 0.0
    for t, r in zip(tokens, reference, strict=True):
        same += t == r
        n = next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), min(len(t), len(r)))
        prefix += n / max(len(r), 1)
    return {"identical": same / len(reference), "prefix": prefix / len(reference)}


def measure(engines: Engines, rounds: int = 3, seed: int = 0, warmup: bool = True) -> dict[str, Any]:
    """Every configuration on the workload, in a fresh random order each round; per-round gains over static
    batching, and their medians."""
    w = engines.workload
    names = list(engines.llms)
    if warmup:
        small = Workload(w.prompts[:2], [min(8, m) for m in w.max_tokens[:2]])
        for name in names:
            run_once(engines.llms[name], small)
    rng = random.Random(seed)
    records: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for _ in range(rounds):
        for name in rng.sample(names, len(names)):
            records[name].append(run_once(engines.llms[name], w))
    tokens_out = sum(w.max_tokens)
    ref = records["CB"][0]["tokens"]
    rows = {}
    for name in names:
        secs = [r["seconds"] for r in records[name]]
        gains = [s / c for s, c in zip((r["seconds"] for r in records["static"]), secs)]
        rows[name] = {"gain": statistics.median(gains), "round_gains": gains,
                      "seconds": statistics.median(secs), "tokens_per_s": tokens_out / statistics.median(secs),
                      "mean_running": statistics.fmean(r["mean_running"] for r in records[name]),
                      "preemptions": records[name][0]["preemptions"],
                      "steps": records[name][0]["steps"],
                      "tokens_generated": sum(map(len, records[name][0]["tokens"])),  # every request finished
                      "same_tokens_every_round": all(r["tokens"] == records[name][0]["tokens"] for r in records[name]),
                      **agreement(records[name][0]["tokens"], ref),
                      "budget": engines.budgets[name].as_dict()}
    return {"rows": rows, "rounds": rounds, "output_tokens": tokens_out}


def run(model: str = "tinystories-target", draft: str = DRAFT, *, device: str | None = None, num_requests: int = 48,
        output: str = "exp:64:8:192", memory: int | None = None, kv_memory: int = 8 * 2**20, k: int = 4,
        max_num_seqs: int = 64, rounds: int = 3, seed: int = 0) -> dict[str, Any]:
    """Build every configuration, measure, analyse. ``memory`` (bytes) defaults to the unquantized target's
    weights plus ``kv_memory``."""
    workload = make_workload(tokenizer_for(model), num_requests, output, seed)
    engines = Engines(model, draft, memory, workload, device=device, k=k, max_num_seqs=max_num_seqs,
                      kv_memory=kv_memory)
    res = measure(engines, rounds=rounds, seed=seed)
    return {"kind": "stacking", "model": model, "draft": draft, "memory": engines.memory, "k": k,
            "max_num_seqs": max_num_seqs, "num_requests": num_requests, "output": output, "seed": seed,
            **res, "analysis": analyse_rounds(res["rows"])}


def analyse_rounds(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``lever_analysis`` of each round's gains (a ratio of two configurations then compares runs seconds apart),
    and the median of every reading over the rounds. Plus the A/A control's per-round ratio to ``CB``: a reading
    inside its range (``aa_band``) is not distinguishable from no change on this machine."""
    n = len(rows["static"]["round_gains"])
    per_round = [lever_analysis({c: rows[label(c)]["round_gains"][r] for c in configurations()}) for r in range(n)]
    out = _median_tree(per_round)
    if "CB (A/A)" in rows:
        aa = [a / b for a, b in zip(rows["CB (A/A)"]["round_gains"], rows["CB"]["round_gains"])]
        out["aa_round_ratios"], out["aa_band"] = aa, [min(aa), max(aa)]
    return out


def _median_tree(items: list[Any]) -> Any:
    """The element-wise median of equally shaped dicts / lists / numbers (strings: the first one's)."""
    first = items[0]
    if isinstance(first, dict):
        return {k: _median_tree([x[k] for x in items]) for k in first}
    if isinstance(first, list):
        return [_median_tree([x[i] for x in items]) for i in range(len(first))]
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return statistics.median(items)
    return first


def plot(result: dict[str, Any], fig=None):
    """Left: each lever's gain alone and in the full stack, and the product of the alone gains against the stack.
    Right: the configurations' throughput against the requests they kept decoding at once."""
    import matplotlib.pyplot as plt

    fig = fig or plt.figure(figsize=(11, 3.8))
    ax1, ax2 = fig.subplots(1, 2)
    a = result["analysis"]
    xs = list(LEVERS)
    pos = range(len(xs))
    ax1.bar([p - 0.2 for p in pos], [a["alone"][x] for x in xs], width=0.4, label="alone")
    # continuous batching cannot be added last (the others need it): its bar would repeat the alone gain
    ax1.bar([p + 0.2 for p in pos[1:]], [a["in_stack"][x] for x in xs[1:]], width=0.4,
            label="added last, on all others")
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_xticks(list(pos), [SHORT[x] for x in xs])
    ax1.set_ylabel("throughput gain (x)")
    ax1.set_title(f"product of alone {a['product']:.1f}x vs stacked {a['stacked']:.1f}x")
    ax1.legend(fontsize=8)
    rows = result["rows"]
    markers = "osD^v<>ph"
    for i, (name, r) in enumerate(rows.items()):
        if name.endswith("(A/A)"):  # the control sits on CB by construction
            continue
        ax2.scatter(r["mean_running"], r["tokens_per_s"], s=30, marker=markers[i % len(markers)], label=name)
    ax2.legend(fontsize=7, ncol=2, loc="lower right")  # a legend, not labels: the quantized ones crowd together
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("requests decoding at once (mean over steps; static: rows held)")
    ax2.set_ylabel("output tokens / s")
    ax2.set_title("what the memory budget lets run")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    import sys

    from minifer.bench.serving import metadata, save_result
    from minifer_course.roofline import default_threads

    p = argparse.ArgumentParser(prog="python -m minifer_course.stacking", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tinystories-target")
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--device", default=None)
    p.add_argument("--num-requests", "-n", type=int, default=48)
    p.add_argument("--output", default="exp:64:8:192", help="output lengths (default %(default)s)")
    p.add_argument("--memory-mib", type=float, default=None,
                   help="memory for weights + KV cache (default: the unquantized weights + --kv-mib)")
    p.add_argument("--kv-mib", type=float, default=8.0,
                   help="the cache's share when --memory-mib is not given (default %(default)s, for the bundled "
                        "pair; a real model needs GiBs, e.g. 2048)")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (fixed)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="8 short requests, one round")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads or default_threads())
    meta = metadata(sys.argv[1:] if argv is None else argv, module="minifer_course.stacking")
    if args.smoke:
        args.num_requests, args.output, args.rounds = 8, "exp:16:4:32", 1
    memory = None if args.memory_mib is None else int(args.memory_mib * 2**20)
    res = run(args.model, args.draft, device=args.device, num_requests=args.num_requests, output=args.output,
              memory=memory, kv_memory=int(args.kv_mib * 2**20), k=args.k, max_num_seqs=args.max_num_seqs,
              rounds=args.rounds, seed=args.seed)
    res["metadata"] = meta
    for name, r in res["rows"].items():
        print(f"{name:>16}: {r['gain']:5.2f}x  {r['tokens_per_s']:7.1f} tok/s  {r['mean_running']:5.1f} running  "
              f"{r['budget']['kv_blocks']:4d} blocks  identical {r['identical']:.2f}")
    a = res["analysis"]
    print("alone: " + ", ".join(f"{SHORT[x]} {g:.2f}x" for x, g in a["alone"].items()))
    print(f"product {a['product']:.2f}x, stacked {a['stacked']:.2f}x, overlap {a['overlap']:.2f} "
          f"(medians over rounds; A/A band {a['aa_band'][0]:.3f}-{a['aa_band'][1]:.3f})")
    if args.out:
        out = save_result(res, args.out)
        print(f"wrote {out}")
        if args.plot:
            plot(res).savefig(out.with_suffix(".png"), dpi=110)
            print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
