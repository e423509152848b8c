"""Issue 28's targets read off one ``cpu_peer`` result: each measure, its target, met or missed and by how much, and
why, in figures taken from the same result.

A target table typed by hand drifts from the measurements it summarises; this one is computed from them, so the
committed JSON carries its own verdicts. "Both engines' best configuration" is taken literally: of the minifer
configurations that fit a budget (one core, or two) the fastest by median throughput, against CT2's fastest in
the same budget, and the ratio is the median over rounds of that pair (rounds are interleaved, see ``cpu_peer``).
The reasons (``why``) are sentences with the result's own numbers filled in; they explain a miss with the other
measurements of the run (a lever measured alone, a bound, a breakdown), never with a figure from elsewhere.

    python -m minifer_course.experiments.cpu_targets -n 512 --repeats 3 --out benchmarks/results/cpu_peer.json

runs the CPU peer benchmark (``python -m minifer.bench cpu_peer``, the same flags), then the two bounds of
``cpu_bounds`` (the ``bounds`` section, after the timed rounds: the real-shape model takes 2.4 GB while it runs),
and writes the result with its ``targets``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from minifer.bench import cpu_peer
from minifer.bench.machine import default_results_path
from minifer.bench.provenance import metadata, save_result
from minifer_course.experiments.cpu_bounds import real_shape_decode, step_overhead

ONE_CORE = {"minifer": ["minifer-fast-16slots-1t", "minifer-fast-64slots-1t"],
            "ctranslate2": ["ct2-static16-1t", "ct2-sorted64-1t"]}
TWO_CORES = {"minifer": ["minifer-fast-64slots-dp2", "minifer-fast-64slots-2t"],
             "ctranslate2": ["ct2-sorted64-2workers"]}


def best_pair(result: dict[str, Any], budget: dict[str, list[str]]) -> dict[str, Any] | None:
    """The fastest minifer configuration against CT2's fastest within one budget of cores: names, and the median
    over rounds of minifer's speed over CT2's (both ran the same workload, so seconds compare directly)."""
    configs = result.get("configs", {})
    fastest = {}
    for engine, names in budget.items():
        present = [n for n in names if n in configs]
        if not present:
            return None
        fastest[engine] = max(present, key=lambda n: configs[n]["tok_per_s"])
    a, b = configs[fastest["minifer"]], configs[fastest["ctranslate2"]]
    rounds = [tb / ta for ta, tb in zip(a["seconds"], b["seconds"])]
    return {"minifer": fastest["minifer"], "ctranslate2": fastest["ctranslate2"],
            "median_of_round_ratios": statistics.median(rounds), "rounds": rounds}


def _ratio(result: dict[str, Any], label: str) -> float | None:
    r = result.get("ratios", {}).get(label)
    return None if r is None else r["median_of_round_ratios"]


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "not measured" if x is None else format(x, spec)


def _why_throughput(result: dict[str, Any], cores: str, rejected: Iterable[str]) -> str:
    left_out = [(name, _ratio(result, f"lever alone: {name}, 64 slots vs eager")) for name in sorted(rejected)]
    so = result.get("step_overhead", {}).get("continuous", {})
    text = (f"every lever that paid is on (together {_fmt(_ratio(result, 'all levers, 64 slots vs eager'))}x the "
            f"eager engine at 64 slots); the levers left out, measured alone at 64 slots: "
            f"{', '.join(f'{k} {_fmt(v)}x' for k, v in left_out)}. What is left is per-step work outside the "
            f"matrix products: even on a 2-layer model the continuous step costs {_fmt(so.get('overhead_ms'))} ms "
            f"more than a static one (step_overhead), and eager PyTorch dispatches each norm, rotation and "
            f"activation as its own op where CT2's C++ layers fuse them")
    if cores == "two":
        dp = _ratio(result, "lever alone: data_parallel_size=2 vs one engine, 64 slots")
        text += (f"; two replicas run {_fmt(dp)}x one engine, so the two-core ratio is the one-core ratio times how "
                 f"much better minifer's replicas scale than CT2's two workers")
    return text


def _why_batch1(result: dict[str, Any]) -> str:
    c = result.get("configs", {})
    ms = {k: c[k]["ms_per_token"] for k in ("minifer-batch1-eager", "ct2-batch1") if k in c}
    best = max((k for k in c if k.startswith("minifer-batch1-")), key=lambda k: c[k]["tok_per_s"], default=None)
    return (f"at batch 1 a step of the bundled model is overhead, not arithmetic: eager minifer takes "
            f"{_fmt(ms.get('minifer-batch1-eager'))} ms per token, its best configuration ({best}) "
            f"{_fmt(c[best]['ms_per_token'] if best else None)} ms, CT2 {_fmt(ms.get('ct2-batch1'))} ms; the "
            f"compiled decoder fuses the element-wise ops, but every token still pays the Python engine step and "
            f"the attention metadata around the model")


def _why_bandwidth(result: dict[str, Any]) -> str:
    rs = result.get("real_shape_decode", {})
    parts = []
    for name, lay in rs.get("layouts", {}).items():
        gbs = rs["bytes_per_step"] / (lay["step_ms"] * 1e-3) / 1e9
        parts.append(f"{name} streams {gbs:.1f} GB/s against a copy's {lay['copy_bandwidth_gb_s']:.1f}")
    return ("one thread's float32 matrix-vector products (MKL via torch.nn.functional.linear) read the weights "
            "slower than a plain copy moves bytes: " + "; ".join(parts) +
            "; a single core cannot saturate the memory system, and the only weight layout change measured "
            "(column-major) gains a few points")


def _why_int8(result: dict[str, Any]) -> str:
    ref = [_ratio(result, f"int8 (integer matmul) vs int8 dequantize-first, {s} slots") for s in (16, 64)]
    return (f"the integer matmul pays where it runs ({_fmt(ref[0])}x and {_fmt(ref[1])}x over dequantizing first at "
            f"16 and 64 slots), but only the linear layers change: each call quantizes its activations, and "
            f"attention, norms and the per-step work around them stay float32 and as slow as before")


def _why_overhead(result: dict[str, Any]) -> str:
    so = result.get("step_overhead", {})
    saved = so.get("levers_ms_saved", {})
    return (f"the levers built for it saved {', '.join(f'{k} {v:.2f} ms' for k, v in saved.items())} per step; "
            f"what remains is the continuous engine's own Python per step (admission, block tables, per-sequence "
            f"bookkeeping and output objects), which a static loop over a fixed batch never runs")


def targets(result: dict[str, Any], rejected: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Each of issue 28's targets, measured, met or missed (``missed_by`` in the target's own unit) and why.
    ``rejected``: the levers the benchmark measured alone and left out of its fast configuration."""
    one, two = best_pair(result, ONE_CORE), best_pair(result, TWO_CORES)
    rs = result.get("real_shape_decode", {}).get("layouts", {})
    so = result.get("step_overhead", {}).get("continuous", {})
    ident = result.get("identity", {})
    int8 = [_ratio(result, f"int8 (integer matmul) vs float32, {s} slots") for s in (16, 64)]
    rows: list[tuple[str, float | None, str, float, Callable[[], str], dict[str, Any]]] = [
        ("minifer / CT2 useful tok/s, best configurations, 1 core", one["median_of_round_ratios"] if one else None, ">=", 1.0,
         lambda: _why_throughput(result, "one", rejected), {"pair": one}),
        ("minifer / CT2 useful tok/s, best configurations, 2 cores", two["median_of_round_ratios"] if two else None, ">=", 1.0,
         lambda: _why_throughput(result, "two", rejected), {"pair": two}),
        ("batch-1 ms per token, minifer / CT2 speed", _ratio(result, "batch 1, ms per token: minifer / CT2 speed"),
         ">=", 0.8, lambda: _why_batch1(result), {}),
        ("real-shape batch-1 decode, fraction of the copy-bandwidth bound",
         max((lay["of_bound"] for lay in rs.values()), default=None), ">=", 0.70, lambda: _why_bandwidth(result), {}),
        ("int8 weights vs float32, same engine, worst of 16 and 64 slots", min(int8) if None not in int8 else None,
         ">=", 1.5, lambda: _why_int8(result), {"per_slots": dict(zip((16, 64), int8))}),
        ("continuous step overhead over a static step, ms (2-layer 128-wide model, 16 slots)", so.get("overhead_ms"),
         "<=", 0.2, lambda: _why_overhead(result), {"fraction_of_bound": so.get("fraction_of_bound")}),
        ("greedy prompts identical to CT2 (float32)", ident["identical_prompts"] / ident["prompts"] if ident else
         None, ">=", 1.0, lambda: "a near-tie that the two engines' float32 rounding breaks differently", {}),
    ]
    out = []
    for measure, value, op, target, why, extra in rows:
        met = None if value is None else (value >= target if op == ">=" else value <= target)
        missed_by = None if value is None or met else (target - value if op == ">=" else value - target)
        out.append({"measure": measure, "target": f"{op} {target:g}", "measured": value, "met": met,
                    "missed_by": missed_by, "why": why() if met is False else None, **extra})
    return out


def measure(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The CPU peer benchmark the flags ask for, the bounds if its sections include them, and the targets."""
    result = cpu_peer.run_args(args, log=log)
    if "bounds" in args.sections:
        result["real_shape_decode"] = real_shape_decode(args.repeats, log=log)
        result["step_overhead"] = step_overhead(256, 16, args.repeats, log=log)  # the 256 requests, 16 slots
    result["targets"] = targets(result, cpu_peer.left_out(result))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minifer_course.experiments.cpu_targets",
                                 description="The CPU peer benchmark, the CPU path's bounds and its targets.")
    cpu_peer.add_arguments(ap, (*cpu_peer.SECTIONS, "bounds"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    meta = metadata(argv, "minifer_course.experiments.cpu_targets")
    path = save_result({"metadata": meta, **measure(args)}, args.out or default_results_path("cpu_peer.json"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
