"""How much of a speculative step's speedup a closed batch keeps: the tail factor.

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/tail_factor.py --batches 4 8 16 --k 5

A plain engine and a fixed-k draft-model engine run the same greedy closed batches (64 tokens each, nothing
waiting), their steps interleaved (``run_interleaved``). Per round: the *batch* speedup (plain seconds / speculative
seconds for the whole batches) and the *step* speedup the adaptive controller measures (tokens per second of the
speculative steps taken while all ``b`` sequences were still decoding, over plain steps' at ``b``). Their ratio is
the share of the steps' gain the batch keeps: the batch ends with its slowest sequence, in a ragged tail of steps
at smaller batch sizes that a step's own speedup does not see.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minifer.bench.speculative import DRAFT, _engine, median_ci, run_interleaved, story_openings
from minifer.sampling_params import SamplingParams


def recorder(llm, log):
    engine, step = llm.engine, llm.engine.step
    spec = engine.speculator

    def timed():
        b = len(engine.scheduler.running)
        emitted = spec.stats.num_emitted if spec else 0
        out = step()
        log.append((b, (spec.stats.num_emitted - emitted) if spec else b))
        return out
    engine.step = timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    plain = _engine("tinystories-target", None, max(args.batches), None)
    fixed = _engine("tinystories-target", {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": args.k,
                                           "adaptive": False}, max(args.batches), None, plain)
    engines = {"plain": plain, "fixed": fixed}
    prompts = story_openings(max(16, max(args.batches)))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for b in args.batches:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        batch_sp, step_sp = [], []
        for r in range(args.rounds):
            logs = {m: [] for m in engines}
            for m, llm in engines.items():
                recorder(llm, logs[m])
            stamps = {m: [] for m in engines}
            # time each step: wrap once more around the recorder
            for m, llm in engines.items():
                inner = llm.engine.step

                def t(inner=inner, m=m, stamps=stamps):
                    t0 = time.perf_counter()
                    out = inner()
                    stamps[m].append(time.perf_counter() - t0)
                    return out
                llm.engine.step = t
            spent, _ = run_interleaved(engines, batch, params, seed=r)
            for llm in engines.values():
                del llm.engine.step
            batch_sp.append(spent["plain"] / spent["fixed"])
            plain_full = [s for (bb, _), s in zip(logs["plain"], stamps["plain"]) if bb == b]
            spec_full = [(n, s) for (bb, n), s in zip(logs["fixed"], stamps["fixed"]) if bb == b]
            plain_rate = b / statistics.median(plain_full)
            step_sp.append(sum(n for n, _ in spec_full) / sum(s for _, s in spec_full) / plain_rate)
        ratio = [a / s for a, s in zip(batch_sp, step_sp)]
        print(f"b={b:>3}  batch speedup {statistics.median(batch_sp):.3f}  step speedup (full batch) "
              f"{statistics.median(step_sp):.3f}  tail factor {statistics.median(ratio):.3f} "
              f"{[round(x, 3) for x in median_ci(ratio)[:2]]}", flush=True)


if __name__ == "__main__":
    main()
