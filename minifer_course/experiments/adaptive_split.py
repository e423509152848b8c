"""Where does adaptive k's plain-step cost lie: in the forward, or in the Python around it? (chapter 04's appendix)

    python -m minifer_course.experiments.adaptive_split --out benchmarks/results/adaptive_split.json
    python -m minifer_course.experiments.adaptive_split --smoke      # seconds, for CI

Pooled over the cells where it decodes plainly, the adaptive engine runs about 0.7% slower than plain decoding
(``adaptive_pooled.json``). A plain step of the adaptive engine runs the same forward as a plain engine's, plus the
speculator's bookkeeping around it (``propose`` and ``observe`` on the held path, ``spec_step``'s wrapper). If the
cost is that bookkeeping, it shows in the time outside the forward; if it shows in the forward itself, the
bookkeeping is not the place to cut.

So each engine's step is split as it runs: the forward (``adaptive_k.ForwardTimer``, model and logits) and the
rest of the step (scheduling, sampling, the speculator, outputs). Three engines on the same greedy requests, steps
interleaved in random order (``speculative.run_interleaved``): ``plain``, ``plain_again`` (the A/A control) and
``adaptive``, all on one copy of the weights. Per round: each engine's forward ratio to plain's, and its time outside
the forward beyond plain's, as a fraction of plain's whole step time; pooled over the plain-throughout cells.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from minifer.bench.provenance import save_result
from minifer.bench.speculative import DRAFT, _engine, run_interleaved
from minifer.engine.adaptive_k import ForwardTimer
from minifer.sampling_params import SamplingParams
from minifer_course.experiments.adaptive_control import add_arguments, method_specs
from minifer_course.experiments.adaptive_pooled import interval

ENGINES = ("plain", "plain_again", "adaptive")


def timed(engines: dict[str, Any]) -> dict[str, float]:
    """Time each engine's target forwards (``ForwardTimer``, the one adaptive k reads): the returned counter adds
    up each engine's forward seconds."""
    forward = dict.fromkeys(engines, 0.0)
    for name, llm in engines.items():
        timer = ForwardTimer(llm.engine.runner)  # the adaptive engine's own timer wrapped once more: same seconds

        def count(*args, name=name, timer=timer):
            out = timer(*args)
            forward[name] += timer.last_s
            return out

        llm.engine.runner.forward = count
    return forward


def cell(engines: dict[str, Any], forward: dict[str, float], batches: list[list], params: SamplingParams,
         rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of ``batches``: per engine and round, the step seconds and the forward seconds."""
    total = {m: [] for m in engines}
    fwd = {m: [] for m in engines}
    identical = True
    for r in range(rounds):
        before = dict(forward)
        spent = dict.fromkeys(engines, 0.0)
        for batch in batches:
            seconds, tokens = run_interleaved(engines, batch, params, seed=r)
            identical &= all(tokens[m] == tokens["plain"] for m in engines)
            for m in engines:
                spent[m] += seconds[m]
        for m in engines:
            total[m].append(spent[m])
            fwd[m].append(forward[m] - before[m])
    return {"rounds": rounds, "identical_tokens": identical, "step_s": total, "forward_s": fwd}


def ratios(row: dict[str, Any], m: str) -> dict[str, list[float]]:
    """Per round: ``m``'s whole-step and forward speed over plain's, and its time outside the forward beyond
    plain's, as a fraction of plain's step time (positive: ``m`` spends more there)."""
    t, f = row["step_s"], row["forward_s"]
    return {"step": [p / x for p, x in zip(t["plain"], t[m])],
            "forward": [p / x for p, x in zip(f["plain"], f[m])],
            "rest_extra": [((xt - xf) - (pt - pf)) / pt
                           for pt, pf, xt, xf in zip(t["plain"], f["plain"], t[m], f[m])]}


def sweep(model: str, spec: dict, prompts: list, batch_sizes: list[int], max_tokens: int, rounds: dict[int, int],
          device: str | None = None, min_requests: int = 8) -> list[dict[str, Any]]:
    """Every batch size in turn, walked upward as the speculative run does (the controller brings its history)."""
    plain = _engine(model, None, max(batch_sizes), device)
    engines = {"plain": plain, "plain_again": _engine(model, None, max(batch_sizes), device, plain),
               "adaptive": _engine(model, {**spec, "adaptive": True}, max(batch_sizes), device, plain)}
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    forward = timed(engines)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    stats = engines["adaptive"].engine.speculator.stats
    rows = []
    for b in batch_sizes:
        n_batches = max(1, -(-min_requests // b))
        batches = [[prompts[(j * b + i) % len(prompts)] for i in range(b)] for j in range(n_batches)]
        before = Counter(stats.k_counts)
        row = cell(engines, forward, batches, params, rounds[b])
        ks = Counter(stats.k_counts) - before
        row.update(batch=b, adaptive_k_hist={str(k): ks[k] for k in sorted(ks)},
                   adaptive_mean_k=sum(k * n for k, n in ks.items()) / max(1, sum(ks.values())))
        for m in ENGINES[1:]:
            row[m] = {name: statistics.median(v) for name, v in ratios(row, m).items()}
        rows.append(row)
    return rows


def pooled(sweeps: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The plain-throughout cells of every sweep, their rounds pooled: each engine's step, forward and rest."""
    plain = [row for rows in sweeps.values() for row in rows if row["adaptive_mean_k"] == 0]
    if not plain:
        return {"cells": 0}
    out: dict[str, Any] = {"cells": len(plain)}
    for m in ENGINES[1:]:
        per = [ratios(row, m) for row in plain]
        out[m] = {name: interval([x for r in per for x in r[name]]) for name in ("step", "forward", "rest_extra")}
    return out


def run(model: str = "tinystories-target", draft: str = DRAFT, device: str | None = None, smoke: bool = False,
        rounds: int = 16) -> dict[str, Any]:
    from minifer import LLM
    from minifer.bench.serving import metadata

    batch_sizes, max_tokens = ([1, 2], 8) if smoke else ([1, 4, 8, 16, 32, 64], 64)
    per_size = {b: 1 if smoke else (2 if b < 8 else rounds) for b in batch_sizes}
    base = LLM(model, device=device, max_num_seqs=max(batch_sizes), enable_prefix_caching=False)
    sweeps = {name: sweep(model, spec, prompts, batch_sizes, max_tokens, per_size, device)
              for name, (spec, prompts) in method_specs(base, draft, max(batch_sizes), smoke).items()}
    return {"kind": "adaptive_split", "metadata": metadata(module="minifer_course.experiments.adaptive_split"),
            "config": {"model": model, "draft": draft, "device": str(base.device), "engines": list(ENGINES),
                       "torch_threads": torch.get_num_threads(), "smoke": smoke, "max_tokens": max_tokens,
                       "rounds": per_size},
            "sweeps": sweeps, "pooled": pooled(sweeps)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap, "runs/adaptive_split.json")
    ap.add_argument("--rounds", type=int, default=16, help="rounds per batch size from 8 sequences (2 below)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = run(args.model, args.draft, args.device, args.smoke, args.rounds)
    save_result(result, args.out)
    for name, rows in result["sweeps"].items():
        for r in rows:
            print(f"{name:15s} batch {r['batch']:>3}  mean k {r['adaptive_mean_k']:.2f}  " + "  ".join(
                f"{m}: step {r[m]['step']:.3f} forward {r[m]['forward']:.3f} rest {100 * r[m]['rest_extra']:+.2f}%"
                for m in ENGINES[1:]) + f"  identical {r['identical_tokens']}")
    print("pooled:", {m: {k: (round(v["median"], 4), [round(x, 4) for x in v["ci"]]) for k, v in d.items()}
                      for m, d in result["pooled"].items() if m != "cells"})


if __name__ == "__main__":
    main()
