"""minifer's dependency graph between its subpackages, from grimp, the graph import-linter checks.

    python tools/dep_graph.py                  # one line per edge: importer -> imported (number of module imports)
    python tools/dep_graph.py --mermaid        # the same as a mermaid flowchart (docs/dependency_graph.md)

A subpackage is a first-level name under ``minifer`` (``minifer.engine``, ``minifer.config``...); the course's
package, ``minifer_course``, which builds on the engine, is one node of its own. An edge counts the
module-to-module imports that cross it; imports that only a type checker runs are left out, as in the contracts in
pyproject.toml. The imports a contract lists under ``ignore_imports`` (the core's wiring points to the optional
``features/``, loaded when a run asks for a feature) are shown apart: dotted in the flowchart, their own list in
the text. Cycles between subpackages are listed last: the "no cycles" contract should keep that list empty, so a
non-empty one names the imports to cut. To see another checkout's graph, put it first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import itertools
import tomllib
from collections import Counter
from pathlib import Path

import grimp

PACKAGE = "minifer"
COURSE = "minifer_course"  # the course's machinery: one node, above the engine
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def wiring_points(pyproject: Path = PYPROJECT) -> set[tuple[str, str]]:
    """(importer, imported) module pairs that the import contracts ignore: the core's wiring points."""
    contracts = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    pairs = set()
    for contract in contracts:
        for line in contract.get("ignore_imports", []):
            a, b = (s.strip() for s in line.split("->"))
            pairs.add((a, b))
    return pairs


def subpackage(module: str) -> str:
    parts = module.split(".")
    return COURSE if parts[0] == COURSE else ".".join(parts[:2])


def subpackage_edges(package: str = PACKAGE, wiring: bool = False) -> Counter:
    """(importer subpackage, imported subpackage) -> number of direct module imports between them; the wiring
    points (``wiring_points``) only, with ``wiring=True``, else all the other imports."""
    graph = grimp.build_graph(package, COURSE, exclude_type_checking_imports=True)
    ignored = wiring_points()
    edges: Counter = Counter()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            if ((importer, imported) in ignored) != wiring:
                continue
            a, b = subpackage(importer), subpackage(imported)
            if a != b and b != package:  # the package's own __init__ is not a layer
                edges[(a, b)] += 1
    return edges


def cycles(edges: Counter) -> list[tuple[str, str]]:
    """Pairs of subpackages that import each other (both directions present)."""
    pairs = {frozenset(e) for e in edges if (e[1], e[0]) in edges}
    return sorted(tuple(sorted(p)) for p in pairs)


def as_text(edges: Counter, wiring: Counter) -> str:
    short = lambda m: m.removeprefix(PACKAGE + ".")  # noqa: E731
    lines = [f"{short(a):>16} -> {short(b):<16} {n:>3}" for (a, b), n in sorted(edges.items())]
    lines.append("wiring points (imported when a run asks for a feature; the contracts list them):")
    lines += [f"{short(a):>16} .> {short(b):<16} {n:>3}" for (a, b), n in sorted(wiring.items())]
    found = cycles(edges)
    lines.append(f"subpackages importing each other: {', '.join(' <-> '.join(map(short, c)) for c in found) or 'none'}")
    return "\n".join(lines)


def as_mermaid(edges: Counter, wiring: Counter) -> str:
    short = lambda m: m.removeprefix(PACKAGE + ".")  # noqa: E731
    nodes = sorted({short(m) for m in itertools.chain.from_iterable([*edges, *wiring])})
    out = ["flowchart LR"] + [f"    {n}[{n}]" for n in nodes]
    out += [f"    {short(a)} -->|{n}| {short(b)}" for (a, b), n in sorted(edges.items())]
    out += [f"    {short(a)} -.->|{n}| {short(b)}" for (a, b), n in sorted(wiring.items())]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mermaid", action="store_true", help="print a mermaid flowchart instead of text")
    args = parser.parse_args(argv)
    edges, wiring = subpackage_edges(), subpackage_edges(wiring=True)
    print(as_mermaid(edges, wiring) if args.mermaid else as_text(edges, wiring))


if __name__ == "__main__":
    main()
