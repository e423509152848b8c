"""tools/dep_graph.py: the subpackage graph it reads from grimp, and the cycles it names."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("dep_graph", ROOT / "tools" / "dep_graph.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cycles_are_pairs_that_import_each_other():
    dg = _tool()
    edges = Counter({("minifer.a", "minifer.b"): 2, ("minifer.b", "minifer.a"): 1, ("minifer.b", "minifer.c"): 1})
    assert dg.cycles(edges) == [("minifer.a", "minifer.b")]
    wiring = Counter({("minifer.c", "minifer.d"): 1})
    text = dg.as_text(edges, wiring)
    assert "a <-> b" in text and "c .> d" in text
    mermaid = dg.as_mermaid(edges, wiring)
    assert mermaid.startswith("flowchart LR") and "b -->|1| c" in mermaid and "c -.->|1| d" in mermaid


def test_the_engine_core_layers_in_minifers_graph():
    """The real graph: the engine imports the layers and the layers never import the engine (the contract in
    pyproject.toml, read back through the tool's own edges)."""
    dg = _tool()
    edges = dg.subpackage_edges()
    assert ("minifer.engine", "minifer.layers") in edges
    core = {"minifer.config", "minifer.loader", "minifer.models", "minifer.layers", "minifer.sampling",
            "minifer.engine", "minifer.spec", "minifer.quant", "minifer.kernels"}
    assert not [e for e in edges if e[0] in core and e[1] in ("minifer_course", "minifer.bench")], edges
    assert not [e for e in edges if e[0] in ("minifer.layers", "minifer.kernels") and e[1] == "minifer.engine"]


def test_the_course_builds_on_the_engine_and_never_the_other_way():
    """``minifer_course`` is one node of the graph: it imports the engine's subpackages, and no module of
    ``minifer`` (benchmarks included) imports it."""
    dg = _tool()
    edges = dg.subpackage_edges()
    assert ("minifer_course", "minifer.engine") in edges and ("minifer_course", "minifer.bench") in edges
    assert not [e for e in edges if e[1] == "minifer_course"], edges


def test_the_core_reaches_features_only_at_the_wiring_points():
    """Every import from the core into ``minifer.features`` is one the contracts list (a new one fails here and in
    ``lint-imports``), and the features build on the engine: the graph without the wiring points has no cycle."""
    dg = _tool()
    core = ("minifer.config", "minifer.loader", "minifer.models", "minifer.layers", "minifer.sampling",
            "minifer.engine", "minifer.spec", "minifer.quant", "minifer.kernels")
    edges, wiring = dg.subpackage_edges(), dg.subpackage_edges(wiring=True)
    assert not [e for e in edges if e[0] in core and e[1] == "minifer.features"], edges
    assert ("minifer.engine", "minifer.features") in wiring and ("minifer.features", "minifer.engine") in edges
    assert dg.cycles(edges) == []
