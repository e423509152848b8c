"""tools/dep_graph.py: the subpackage graph it reads from grimp, and the cycles it names."""

from __future__ import annotations

import importlib.util
import tomllib
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
    """The real graph: the engine imports the model, the model its layers, and the layers never import the engine (the contract in
    pyproject.toml, read back through the tool's own edges)."""
    dg = _tool()
    edges = dg.subpackage_edges()
    assert ("minifer.models", "minifer.layers") in edges and ("minifer.engine", "minifer.models") in edges
    core = {"minifer.config", "minifer.model_loader", "minifer.models", "minifer.layers", "minifer.attention",
            "minifer.sample", "minifer.core", "minifer.worker", "minifer.engine", "minifer.spec_decode",
            "minifer.quantization", "minifer.kernels"}
    assert not [e for e in edges if e[0] in core and e[1] in ("minifer_course", "minifer.bench")], edges
    assert not [e for e in edges if e[0] in ("minifer.layers", "minifer.attention", "minifer.kernels")
                and e[1] in ("minifer.engine", "minifer.core", "minifer.worker")]


def test_the_course_builds_on_the_engine_and_never_the_other_way():
    """``minifer_course`` is one node of the graph: it imports the engine's subpackages, and no module of
    ``minifer`` (benchmarks included) imports it."""
    dg = _tool()
    edges = dg.subpackage_edges()
    assert ("minifer_course", "minifer.engine") in edges and ("minifer_course", "minifer.bench") in edges
    assert not [e for e in edges if e[1] == "minifer_course"], edges


def test_minifers_subpackages_import_each_other_without_cycles():
    """The engine's subpackages form a graph with no cycle, and the contracts need no ignored import for it: an
    opt-in policy (adaptive k) is chosen where the engine is built, not imported back by what it builds on."""
    dg = _tool()
    assert dg.cycles(dg.subpackage_edges()) == []
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    assert not [c["name"] for c in contracts if c.get("ignore_imports")]
