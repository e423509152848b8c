"""How much a notebook's live numbers move between runs: the same notebook executed several times, each code
cell's printed numbers compared position by position.

    python tools/notebook_spread.py notebooks/03_continuous_batching.ipynb RUN1/03_continuous_batching.ipynb ...

For each cell whose outputs print the same count of numbers in every run (a cell whose text changes shape is
reported as such), each number that differs between runs is listed with its smallest and largest value, its
spread ((max - min) / |median|) and the words before it. The instructor's guide's table of expected spreads
comes from this (docs/instructor-guide.md says which runs).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def cell_texts(path: Path) -> list[tuple[int, str]]:
    """``(cell index, text)`` of every code cell's printed output (streams and text/plain results)."""
    nb = json.loads(path.read_text())
    out = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        parts = []
        for o in cell.get("outputs", []):
            if "text" in o:
                parts.append("".join(o["text"]))
            elif "text/plain" in o.get("data", {}):
                parts.append("".join(o["data"]["text/plain"]))
        out.append((i, "".join(parts)))
    return out


def numbers(text: str) -> list[tuple[float, str]]:
    """Every number in ``text`` with the few words before it (its label)."""
    found = []
    for m in NUMBER.finditer(text):
        try:
            value = float(m.group().replace(",", ""))
        except ValueError:
            continue
        label = " ".join(text[max(0, m.start() - 60):m.start()].split()[-5:])
        found.append((value, label))
    return found


def spread(paths: list[Path]) -> dict:
    runs = [cell_texts(p) for p in paths]
    if len({len(r) for r in runs}) != 1:
        raise SystemExit(f"the notebooks have different numbers of code cells: {[len(r) for r in runs]}")
    varying, reshaped, fixed = [], [], 0
    for cells in zip(*runs):
        index = cells[0][0]
        per_run = [numbers(text) for _, text in cells]
        if len({len(n) for n in per_run}) != 1:
            reshaped.append(index)
            continue
        for position, values in enumerate(zip(*per_run)):
            xs = [v for v, _ in values]
            if len(set(xs)) == 1:
                fixed += 1
                continue
            mid = statistics.median(xs)
            varying.append({"cell": index, "label": values[0][1], "min": min(xs), "max": max(xs),
                            "spread": (max(xs) - min(xs)) / abs(mid) if mid else None, "position": position})
    return {"runs": [str(p) for p in paths], "fixed_numbers": fixed, "varying": varying, "reshaped_cells": reshaped}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebooks", nargs="+", type=Path, help="the same notebook, executed two or more times")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    if len(args.notebooks) < 2:
        ap.error("give at least two executed copies of the notebook")
    res = spread(args.notebooks)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"{res['fixed_numbers']} numbers identical in every run; {len(res['varying'])} vary; cells whose output "
          f"changed shape: {res['reshaped_cells'] or 'none'}")
    for v in sorted(res["varying"], key=lambda v: -(v["spread"] or 0)):
        s = "n/a" if v["spread"] is None else f"{100 * v['spread']:.0f}%"
        print(f"  cell {v['cell']:>3}  {v['min']:>12g} .. {v['max']:<12g} spread {s:>6}  after: {v['label']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
