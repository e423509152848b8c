"""A/B of adaptive-k variants against plain decoding, with the speculative benchmark's own machinery.

    OMP_NUM_THREADS=1 taskset -c 1 python scripts/adaptive_ab.py --method draft_model --batches 1 4 8 16 32

Every engine runs the same greedy requests, one engine step at a time in a random order (``run_interleaved``);
per round, speedup = plain time / engine time, reported as the median over rounds and its 95% interval
(``median_ci``), beside the A/A control (a second plain engine). Rounds as in ``speedup_vs_batch``: ``--repeats``
below 8 sequences, four times as many from 8 on. The engines go through the batch sizes in order, so the adaptive
controllers carry their state from smaller batches to larger ones as in the committed benchmark.

Variants: ``adaptive`` (the controller as it is); ``never`` (an adaptive engine whose margin no prediction can
clear: the cost of the speculative step path and the controller's bookkeeping while it decodes plainly, with no
speculation at all); ``old`` (``emulate_old``: the controller before this change, in the same run); ``quiet``
(``never`` with the controller's ``observe`` switched off: the step path alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter

import torch

from minifer.bench.speculative import (DRAFT, _engine, grounded_prompts, median_ci, run_interleaved,
                                       story_openings)
from minifer.sampling_params import SamplingParams


def emulate_old(ctl) -> None:
    """The controller as it was before held steps were timed one in ``LIGHT_EVERY``: every held step measured in
    full (the plain steps' fast path in ``AdaptiveSpeculator.step`` is not undone)."""
    observe = ctl.observe

    def observe_all(r):
        r.held = False
        observe(r)
    ctl.observe = observe_all


def build(method: str, k: int, variants: list[str], max_b: int):
    spec = ({"method": "draft_model", "model": DRAFT} if method == "draft_model"
            else {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    plain = _engine("tinystories-target", None, max_b, None)
    engines = {"plain": plain, "plain_again": _engine("tinystories-target", None, max_b, None, plain)}
    first = None
    for v in variants:
        llm = _engine("tinystories-target", {**spec, "num_speculative_tokens": k, "adaptive": True}, max_b, None,
                      first or plain)
        first = first or llm
        if v in ("never", "quiet"):
            llm.engine.speculator.adaptive.cfg.margin = 1e9
        if v == "quiet":  # and nothing observed: the speculative step path alone
            llm.engine.speculator.adaptive.observe = lambda *a, **kw: None
        if v == "old":
            emulate_old(llm.engine.speculator.adaptive)
        engines[v] = llm
    return engines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=["draft_model", "ngram"], required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--variants", nargs="+", default=["adaptive", "never"])
    ap.add_argument("--k", type=int, default=None, help="k max (default: 5 for the draft model, 3 for n-gram)")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    k = args.k or (5 if args.method == "draft_model" else 3)
    engines = build(args.method, k, args.variants, max(args.batches))
    prompts = (story_openings(max(16, max(args.batches))) if args.method == "draft_model"
               else grounded_prompts(engines["plain"], 16))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    rows = []
    for b in args.batches:
        n_batches = max(1, -(-8 // b))
        batches = [[prompts[(j * b + i) % len(prompts)] for i in range(b)] for j in range(n_batches)]
        times = {m: [] for m in engines}
        before = {v: Counter(engines[v].engine.speculator.stats.k_counts) for v in args.variants}
        identical = True
        for r in range(args.repeats * (4 if b >= 8 else 1)):
            spent = dict.fromkeys(engines, 0.0)
            for batch in batches:
                seconds, tokens = run_interleaved(engines, batch, params, seed=r)
                identical &= all(t == tokens["plain"] for t in tokens.values())
                for m in engines:
                    spent[m] += seconds[m]
            for m in engines:
                times[m].append(spent[m])
        row = {"batch": b, "identical": identical, "plain_s": statistics.median(times["plain"])}
        for m in engines:
            if m == "plain":
                continue
            ratios = [p / t for p, t in zip(times["plain"], times[m])]
            lo, hi, _ = median_ci(ratios)
            row[m] = [round(statistics.median(ratios), 4), round(lo, 4), round(hi, 4)]
        for v in args.variants:
            c = engines[v].engine.speculator.stats.k_counts - before[v]
            row[v + "_mean_k"] = round(sum(kk * n for kk, n in c.items()) / max(c.total(), 1), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"method": args.method, "k": k, "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
