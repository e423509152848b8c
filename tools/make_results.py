#!/usr/bin/env python3
"""Regenerate every CPU result the chapters and the README cite, then re-execute the notebooks (`make results`).

    python3 tools/make_results.py                  # everything, in order (hours on 2 cores)
    python3 tools/make_results.py --only speculative kv_quant
    python3 tools/make_results.py --list           # the parts, their commands and expected durations
    python3 tools/make_results.py --only notebooks # re-execute chapters and solutions with stored outputs

Why one command: a number in a chapter is only checkable if anyone can produce it again. Each part is a
benchmark command from the repository, run at a clean commit (the tool refuses a dirty tree, because the
result would record a commit that is not what ran); each writes its JSON (and plot) under
``benchmarks/results/`` with the commit, the command and a fingerprint of the code it executed
(``minifer.bench.provenance``). The claims ledger (``benchmarks/claims.toml``) then ties every number the
prose quotes to a field of these files, and its test fails when they disagree.

GPU results (``*_h200*.json``, ``gpu_check``) come from ``scripts/gpu_check.sh`` on a GPU and are not run here.
The expected durations marked measured were timed by a `make results` run on a 2-core AMD EPYC (torch 2.13 CPU,
2026-12-01); the others are estimates until a run times them. A busier machine takes longer.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"


@dataclass(frozen=True)
class Part:
    name: str
    command: str
    minutes: int  # expected on the reference machine (see the module docstring)
    what: str
    measured: bool = False  # the minutes were timed by a `make results` run, not estimated


def _bench(args: str) -> str:
    return f"python -m minifer.bench {args}"


# the CPU peer benchmark (python -m minifer.bench cpu_peer) with the CPU path's bounds and targets (the course's)
CPU_TARGETS = "minifer_course.experiments.cpu_targets"


PARTS = [
    Part("bound", _bench(f"bound --out {RESULTS}/bound.json --plot"), 1,
         "computed: the scheduler-step bound of continuous over static batching (ch03)", measured=True),
    Part("kv_memory", f"python -m minifer_course.kv_memory --out {RESULTS}/kv_memory.json", 1,
         "KV memory wasted by contiguous vs paged caches, prefix sharing, parallel sampling (ch02)", measured=True),
    Part("kv_quant", f"python -m minifer_course.kv_quant --out {RESULTS}/kv_quant.json", 1,
         "sequences that fit with an 8-bit KV cache, and free-running greedy agreement (ch05)", measured=True),
    Part("throughput", _bench(f"throughput -n 512 --repeats 3 --modes static continuous hf --no-progress "
                              f"--out {RESULTS}/throughput_512.json --plot"), 9,
         "offline throughput: static vs continuous batching vs transformers (ch03, README)", measured=True),
    Part("serve_sweep", _bench(f"serve --rate 1 2 4 6 8 -n 96 --no-progress --out {RESULTS}/serve_sweep.json "
                               "--plot"), 40, "TTFT/TPOT/ITL under Poisson arrivals (ch03)"),
    Part("profile", _bench(f"profile -n 128 --modes static continuous hf --out {RESULTS}/profile_128.json --plot"),
         1, "where a step's time goes, per engine (ch03)", measured=True),
    Part("block_order", f"python -m minifer_course.block_order --out {RESULTS}/block_order.json", 1,
         "the cost of a shuffled free list (ch04 appendix)", measured=True),
    Part("speculative", f"python -m minifer.bench.speculative --out {RESULTS}/speculative.json --plot --repeats 4",
         20, "speculative decoding: alpha, tokens per forward, wall speedup by batch size (ch04, README)", measured=True),
    Part("speculative_confirm", f"python -m minifer.bench.speculative --out {RESULTS}/speculative_confirm.json "
                                "--plot --repeats 4", 20, "an independent replicate of the speculative run",
         measured=True),
    Part("speculative_bookkeeping", f"python -m minifer.bench.speculative --bookkeeping --repeats 4 "
                                    f"--out {RESULTS}/speculative_bookkeeping.json", 1,
         "the speculator's bookkeeping cost (ch04)", measured=True),
    Part("adaptive_control", f"python -m minifer_course.experiments.adaptive_control --out {RESULTS}/adaptive_control.json", 24,
         "adaptive k against plain decoding with a control built after it: placement or a cost of its own (ch04)"),
    Part("adaptive_pooled", f"python -m minifer_course.experiments.adaptive_pooled --out {RESULTS}/adaptive_pooled.json", 1,
         "the three adaptive-k runs' plain-throughout rounds pooled, and a family-wise per-cell reading (reads "
         "speculative*.json and adaptive_control.json; runs no engine)"),
    Part("adaptive_split", f"python -m minifer_course.experiments.adaptive_split --out {RESULTS}/adaptive_split.json", 15,
         "each engine's step split into its forward and the rest: where adaptive k's plain-step cost lies (ch04)"),
    Part("quality", f"python -m minifer.bench.quality --out {RESULTS}/quant_quality.json --plot", 5,
         "weight quantization: bytes, perplexity, agreement (ch05, README)", measured=True),
    Part("stacking", f"python -m minifer_course.stacking -n 96 --rounds 3 --out {RESULTS}/stacking.json --plot", 3,
         "the levers alone and stacked (ch06, README)", measured=True),
    Part("server_overhead", f"python -m minifer_course.experiments.server_overhead --rounds 5 --out {RESULTS}/server_overhead.json "
                            "--plot", 2, "the HTTP server against the direct engine (ch00)", measured=True),
    Part("server_sweep", f"python -m minifer.bench.server_sweep --concurrency 1 2 4 8 16 --out {RESULTS}/server_sweep.json "
                         "--plot", 10, "TTFT and inter-token latency through the server by concurrency (ch00, README)"),
    Part("eagle", f"python -m minifer.bench.eagle --out {RESULTS}/eagle.json --rounds 5", 10,
         "the EAGLE head against the draft model and n-gram: alpha, tokens per forward, speedup (ch04, README)",
         measured=True),
    Part("cpu_peer", f"python -m {CPU_TARGETS} -n 512 --repeats 3 --out {RESULTS}/cpu_peer.json", 40,
         "minifer against CTranslate2 on the same model and workload, the CPU levers, the two bounds and the targets "
         "(ch01, ch03; needs the `peer` extra)", measured=True),
    Part("cpu_peer_replicate", f"python -m {CPU_TARGETS} -n 512 --repeats 3 --out {RESULTS}/cpu_peer_replicate.json",
         40,
         "the same comparison again: how far single levers move between runs (ch01)", measured=True),
    Part("aot", f"python -m minifer_course.experiments.aot --out {RESULTS}/aot_report.json", 10,
         "every Triton kernel compiled ahead of time for sm_80 and sm_90: registers, spills, SASS (ch05 appendix)"),
    Part("aot_archs", f"python -m minifer_course.experiments.aot --ccs 75 80 89 90 --out {RESULTS}/aot_report_archs.json", 20,
         "the same for every GPU CI checks (T4, A100, L4, H100/H200; README, tests/kernels/test_aot_archs.py)"),
    Part("aot_all_configs", f"python -m minifer_course.experiments.aot --all-configs --out {RESULTS}/aot_report_all_configs.json", 15,
         "every distinct config of the quantized kernels' GPU autotuning lists, sm_80 and sm_90 (docs/engine.md)"),
    Part("notebooks", "python tools/make_results.py --execute-notebooks", 12,
         "re-execute every chapter and solution notebook, storing outputs"),
]


def dirty_files() -> list[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--", ".", f":!{RESULTS}", ":!runs"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return [line[3:] for line in out.splitlines()]


def execute_notebooks() -> None:
    """Chapters and their appendices executed in place (outputs stored for readers), then the solutions through
    ``tools/build_exercises.py --force``, which executes them in order and stores them in the form its sync check
    expects (nbconvert's own metadata would make every solution "differ from its source")."""
    books = [nb for nb in sorted((ROOT / "notebooks").rglob("*.ipynb")) if ".ipynb_checkpoints" not in nb.parts]
    for i, nb in enumerate(books, 1):
        t0 = time.time()
        print(f"  [{i}/{len(books)}] {nb.relative_to(ROOT)}", flush=True)
        subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
                        "--ExecutePreprocessor.timeout=1800", str(nb)], cwd=nb.parent, check=True)
        print(f"      {time.time() - t0:.0f} s", flush=True)
    print("  solutions: python3 tools/build_exercises.py --force", flush=True)
    subprocess.run([sys.executable, "tools/build_exercises.py", "--force"], cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=[p.name for p in PARTS],
                    help="run these parts only, in the order given")
    ap.add_argument("--list", action="store_true", help="print the parts and exit")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="run on a modified tree (the results then record dirty: true; never commit them)")
    ap.add_argument("--execute-notebooks", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.execute_notebooks:
        execute_notebooks()
        return 0
    if args.list:
        for p in PARTS:
            how = "measured" if p.measured else "estimate"
            print(f"{p.name:<24} ~{p.minutes:>3} min ({how})  {p.what}\n{'':<24} {p.command}")
        print(f"total ~{sum(p.minutes for p in PARTS)} min")
        return 0
    dirty = dirty_files()
    if dirty and not args.allow_dirty:
        print("refusing to run on a modified tree (commit first, so the results record what ran):\n  "
              + "\n  ".join(dirty), file=sys.stderr)
        return 2
    parts = [p for name in args.only for p in PARTS if p.name == name] if args.only else PARTS
    total = sum(p.minutes for p in parts)
    done = 0
    for i, p in enumerate(parts, 1):
        print(f"[{i}/{len(parts)}] {p.name}: {p.what}\n    {p.command}\n    expected ~{p.minutes} min; "
              f"{done}/{total} min of the run done", flush=True)
        t0 = time.time()
        cmd = p.command.replace("python ", f"{sys.executable} ", 1)
        subprocess.run(cmd, shell=True, cwd=ROOT, check=True)
        print(f"    {p.name} took {(time.time() - t0) / 60:.1f} min", flush=True)
        done += p.minutes
    print("done: run `python -m pytest tests -k claims` to check the prose against the new numbers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
