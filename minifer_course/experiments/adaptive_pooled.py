"""Is adaptive k slower where it decodes plainly? The committed runs' rounds, pooled (chapter 04's appendix).

    python -m minifer_course.experiments.adaptive_pooled --out benchmarks/results/adaptive_pooled.json

No engine runs here: this reads results already committed (``speculative.json``, its replicate and
``adaptive_control.json``) and asks them a sharper question than each cell can answer alone.

One cell's 16-24 rounds give an interval of the median about 1-2% wide, so a cost of half a percent hides inside
most cells' intervals and pokes out of one or two in a run, a different one each time. Where adaptive k decoded
plainly on every step of a cell (mean k 0), every round of every such cell asks the same question (what does the
adaptive engine cost when it does not speculate?), so their ratios can be pooled: a hundred rounds or more narrow
the interval to a few tenths of a percent. The A/A control pooled the same way is the yardstick (1.0 by
construction), and a control built after the adaptive engine separates its cost from build order: each round's
ratio ``plain_after / adaptive`` compares two engines timed in the same interleaved steps.

Pooling assumes the cells share one ratio; they are different batch sizes, so the pooled median is the median over
those batch sizes' rounds, not a per-cell claim. The per-cell reading is kept too, with each interval widened so
that the whole family of cells holds a 5% error rate (Bonferroni): the reading that does not cry wolf in one cell
of fourteen by chance alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
from pathlib import Path
from typing import Any, Iterator

from minifer.bench.provenance import ROOT, metadata, save_result
from minifer.bench.speculative import median_ci

RUNS = ("speculative.json", "speculative_confirm.json", "adaptive_control.json")
CONTROLS = ("plain_again", "plain_after")  # the A/A control, and (adaptive_control.json only) the one built after


def cells(result: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(method, row)`` for every cell of a speculative or adaptive-control result."""
    sweeps = result.get("speedup") or result.get("sweeps")
    if not sweeps:
        raise ValueError("not a speculative or adaptive_control result: no 'speedup' or 'sweeps' field")
    for method, sweep in sweeps.items():
        for row in sweep["rows"]:
            yield method, row


def interval(values: list[float], level: float = 0.95) -> dict[str, Any]:
    """Median of ``values`` with its distribution-free interval (``speculative.median_ci``)."""
    low, high, coverage = median_ci(values, level)
    return {"n": len(values), "median": statistics.median(values), "ci": [low, high], "coverage": coverage,
            "slower": high < 1.0}


def pooled(result: dict[str, Any]) -> dict[str, Any]:
    """The rounds of every plain-throughout cell, pooled: each engine's speed over ``plain`` and, round by round,
    adaptive's speed over each control's."""
    plain = [row for _, row in cells(result) if row["adaptive_mean_k"] == 0]
    if not plain:
        return {"cells": 0}
    controls = [c for c in CONTROLS if f"round_speedups_{c}" in plain[0]]
    over_plain = {m: [x for row in plain for x in row[f"round_speedups_{m}"]] for m in ("adaptive", *controls)}
    # speedup_adaptive / speedup_control per round = control's time / adaptive's time, the same interleaved steps
    paired = {c: [a / b for row in plain for a, b in zip(row["round_speedups_adaptive"], row[f"round_speedups_{c}"])]
              for c in controls}
    return {"cells": len(plain), "batches": sorted({row["batch"] for row in plain}),
            "over_plain": {m: interval(v) for m, v in over_plain.items()},
            "adaptive_over": {c: interval(v) for c, v in paired.items()}}


def familywise(result: dict[str, Any], alpha: float = 0.05) -> dict[str, Any]:
    """Per cell, each engine's interval at level ``1 - alpha / cells``: the cells where it lies wholly below 1.0.
    A cell with too few rounds for that level (4 rounds reach 87.5% at best) cannot be read at it: it is listed
    apart, with its widest interval's coverage and whether even that lies below 1.0."""
    rows = list(cells(result))
    level = 1 - alpha / len(rows)
    engines = [m for m in ("adaptive", *CONTROLS) if f"round_speedups_{m}" in rows[0][1]]
    out: dict[str, Any] = {"level": level, "cells": len(rows)}
    for m in engines:
        read = [(method, row["batch"], interval(row[f"round_speedups_{m}"], level)) for method, row in rows]
        out[m] = {"slower": [[method, b] for method, b, r in read if r["slower"] and r["coverage"] >= level],
                  "short_of_level": [[method, b, r["coverage"], r["slower"]] for method, b, r in read
                                     if r["coverage"] < level]}
    return out


def analyse(paths: list[Path]) -> dict[str, Any]:
    """Both readings for every run, and the input files' hashes (a result derived from them goes stale with them)."""
    runs, inputs = {}, {}
    for path in paths:
        data = path.read_bytes()
        path = path.resolve()
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
        inputs[name] = hashlib.sha256(data).hexdigest()[:16]
        result = json.loads(data)
        runs[path.name] = {"commit": result.get("metadata", {}).get("git"), "pooled": pooled(result),
                           "familywise": familywise(result)}
    return {"kind": "adaptive_pooled", "runs": runs, "inputs": inputs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results",
                    help="folder of the committed results to read")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), help="result files in that folder")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    args = ap.parse_args(argv)
    result = {"metadata": metadata(argv, "minifer_course.experiments.adaptive_pooled"),
              **analyse([args.results / name for name in args.runs])}
    for name, run in result["runs"].items():
        p = run["pooled"]
        if not p["cells"]:
            print(f"{name}: no plain-throughout cells")
            continue
        line = ", ".join(f"{m} {r['median']:.4f} [{r['ci'][0]:.4f}, {r['ci'][1]:.4f}]"
                         for m, r in {**p["over_plain"], **{f"adaptive/{c}": r for c, r in
                                                            p["adaptive_over"].items()}}.items())
        print(f"{name}: {p['cells']} plain-throughout cells, {line}; family-wise slower: "
              f"{run['familywise']['adaptive']['slower']}")
    if args.out:  # the inputs join the fingerprint: tools/claims.py reads this result as stale when they change
        save_result(result, args.out, sources=result["inputs"])


if __name__ == "__main__":
    main()
