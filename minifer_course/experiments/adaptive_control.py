"""Is adaptive k ever slower than plain decoding? The question of ``speculative.py``'s adaptive cells, asked with
more rounds and one more control (chapter 04's appendix).

    python -m minifer_course.experiments.adaptive_control --out benchmarks/results/adaptive_control.json
    python -m minifer_course.experiments.adaptive_control --smoke      # seconds, for CI

Where adaptive k decodes plainly (8 sequences and more on this CPU), its speed should be plain decoding's: the
controller's own calls cost a fraction of a percent of a step (``speculative_bookkeeping.json``). Yet the
committed speculative runs put several such cells about 1% below 1.0, some with intervals wholly below it. Two readings:
the adaptive engine pays something the bookkeeping timer does not see, or engines are not interchangeable (two
engines differ in where their KV cache lies in memory, and the order they were built in might matter).

So each round here runs four engines on the same greedy requests, their steps interleaved in a random order
(``speculative.run_interleaved``), built in this order: ``plain``, ``plain_again`` (the A/A control of
``speculative.py``), ``adaptive`` and ``plain_after``, a plain engine built after the adaptive one. If placement or
build order moved speed, ``plain_after`` would show it beside ``adaptive``; if the adaptive engine paid something
of its own, ``adaptive`` would fall below both controls. The batch sizes are walked 1 to 64 in order, as in the
speculative run, so the controller arrives at each size with the history it has there (trials and probes at the
small sizes); from 8 sequences on, the rounds are one and a half times the speculative run's (24 with the default ``--repeats 4``),
to narrow the intervals where the question is.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from minifer.bench.provenance import save_result
from minifer.bench.speculative import (
    DRAFT,
    _engine,
    adaptive_verdict,
    grounded_prompts,
    median_ci,
    run_interleaved,
    story_openings,
)
from minifer.sampling_params import SamplingParams

ENGINES = ("plain", "plain_again", "adaptive", "plain_after")  # the order they are built in
FROM_8 = 6  # rounds from 8 sequences on, per round below 8: where the question is (speculative.py: 4)
K = {"draft_model": 5, "ngram_grounded": 3}  # each method's best fixed k in the committed speculative runs


def cell(engines: dict[str, Any], batches: list[list], params: SamplingParams, rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of ``batches`` on every engine; each engine's speed over ``plain`` per round, its median
    and the median's confidence interval, and whether the four engines emitted the same tokens."""
    times: dict[str, list[float]] = {m: [] for m in engines}
    identical = True
    for r in range(rounds):
        spent = dict.fromkeys(engines, 0.0)
        for batch in batches:
            seconds, tokens = run_interleaved(engines, batch, params, seed=r)
            identical &= all(tokens[m] == tokens["plain"] for m in engines)
            for m in engines:
                spent[m] += seconds[m]
        for m in engines:
            times[m].append(spent[m])
    row: dict[str, Any] = {"rounds": rounds, "identical_tokens": identical,
                           "seconds": {m: statistics.median(v) for m, v in times.items()}}
    for m in ENGINES[1:]:
        ratios = [p / t for p, t in zip(times["plain"], times[m])]
        row[f"speedup_{m}"], row[f"ci_{m}"], row[f"round_speedups_{m}"] = \
            statistics.median(ratios), median_ci(ratios), ratios
    return row


def sweep(model: str, spec: dict, prompts: list, batch_sizes: list[int], max_tokens: int, rounds: int,
          device: str | None = None, min_requests: int = 8) -> dict[str, Any]:
    """Every batch size in turn on the four engines (built in ``ENGINES`` order, all on one copy of the weights)."""
    max_b = max(batch_sizes)
    plain = _engine(model, None, max_b, device)
    engines = {"plain": plain, "plain_again": _engine(model, None, max_b, device, plain),
               "adaptive": _engine(model, {**spec, "adaptive": True}, max_b, device, plain),
               "plain_after": _engine(model, None, max_b, device, plain)}
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stats = engines["adaptive"].engine.speculator.stats
    rows = []
    for b in batch_sizes:
        n_batches = max(1, -(-min_requests // b))
        batches = [[prompts[(j * b + i) % len(prompts)] for i in range(b)] for j in range(n_batches)]
        before, probes = Counter(stats.k_counts), stats.num_probes
        row = cell(engines, batches, params, rounds * (FROM_8 if b >= 8 else 1))
        ks = Counter(stats.k_counts) - before
        row.update(batch=b, batches=n_batches, adaptive_k_hist={str(k): ks[k] for k in sorted(ks)},
                   adaptive_mean_k=sum(k * n for k, n in ks.items()) / max(1, sum(ks.values())),
                   adaptive_probes=stats.num_probes - probes)
        rows.append(row)
    return {"k": spec["num_speculative_tokens"], "rows": rows}


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """``speculative.adaptive_verdict`` on these cells (adaptive against ``plain``, the A/A control beside it), and
    the cells where the control built after the adaptive engine misses 1.0 too."""
    after = [(name, r["batch"]) for name, sw in result["sweeps"].items() for r in sw["rows"]
             if not r["ci_plain_after"][0] <= 1.0 <= r["ci_plain_after"][1]]
    return {**adaptive_verdict(result["sweeps"]), "after_intervals_missing_1": after}


def method_specs(base: Any, draft: str, max_b: int, smoke: bool) -> dict[str, tuple[dict, list]]:
    """The two methods every adaptive-k comparison runs, each at its best fixed ``K``, with its prompts: the draft
    model on held-out story openings, n-gram lookup on prompts that ground its continuation (``base``'s tokens)."""
    stories = story_openings(max_b)
    grounded = grounded_prompts(base, 4 if smoke else 16, continuation=16 if smoke else 48)
    return {"draft_model": ({"method": "draft_model", "model": draft, "num_speculative_tokens": K["draft_model"]},
                            stories),
            "ngram_grounded": ({"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                                "num_speculative_tokens": K["ngram_grounded"]}, grounded)}


def add_arguments(ap: argparse.ArgumentParser, out: str) -> None:
    """The options the adaptive-k comparisons share (each adds its own rounds)."""
    ap.add_argument("--model", default="tinystories-target")
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--device", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the pipeline in seconds")
    ap.add_argument("--out", type=Path, default=Path(out))


def run(model: str = "tinystories-target", draft: str = DRAFT, device: str | None = None, smoke: bool = False,
        repeats: int = 4) -> dict[str, Any]:
    from minifer import LLM
    from minifer.bench.serving import metadata

    batch_sizes, max_tokens = ([1, 2], 8) if smoke else ([1, 2, 4, 8, 16, 32, 64], 64)
    base = LLM(model, device=device, max_num_seqs=max(batch_sizes), enable_prefix_caching=False)
    specs = method_specs(base, draft, max(batch_sizes), smoke)
    rounds = 1 if smoke else repeats
    result: dict[str, Any] = {
        "kind": "adaptive_control", "metadata": metadata(module="minifer_course.experiments.adaptive_control"),
        "config": {"model": model, "draft": draft, "device": str(base.device), "engines": list(ENGINES),
                   "torch_threads": torch.get_num_threads(), "smoke": smoke, "max_tokens": max_tokens,
                   "rounds_below_8": rounds, "rounds_from_8": FROM_8 * rounds},
        "sweeps": {name: sweep(model, spec, prompts, batch_sizes, max_tokens, rounds, device)
                   for name, (spec, prompts) in specs.items()}}
    result["verdict"] = verdict(result)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap, "runs/adaptive_control.json")
    ap.add_argument("--repeats", type=int, default=4, help="rounds per batch size below 8 sequences (6x from 8 on)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args.model, args.draft, args.device, args.smoke, args.repeats)
    save_result(result, args.out)
    for name, sw in result["sweeps"].items():
        for r in sw["rows"]:
            print(f"{name:15s} batch {r['batch']:>3}  mean k {r['adaptive_mean_k']:.2f}  " + "  ".join(
                f"{m} {r[f'speedup_{m}']:.3f} [{r[f'ci_{m}'][0]:.3f}, {r[f'ci_{m}'][1]:.3f}]" for m in ENGINES[1:])
                + f"  identical {r['identical_tokens']}")
    print("verdict:", result["verdict"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
