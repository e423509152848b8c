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
    text = dg.as_text(edges)
    assert "a <-> b" in text and "c" in text
    mermaid = dg.as_mermaid(edges)
    assert mermaid.startswith("flowchart LR") and "b -->|1| c" in mermaid


def test_the_engine_core_layers_in_minifers_graph():
    """The real graph: the engine imports the layers and the layers never import the engine (the contract in
    pyproject.toml, read back through the tool's own edges)."""
    dg = _tool()
    edges = dg.subpackage_edges()
    assert ("minifer.engine", "minifer.layers") in edges
    core = {"minifer.config", "minifer.loader", "minifer.models", "minifer.layers", "minifer.sampling",
            "minifer.engine", "minifer.spec", "minifer.quant", "minifer.kernels"}
    assert not [e for e in edges if e[0] in core and e[1] in ("minifer.course", "minifer.bench")], edges
    assert not [e for e in edges if e[0] in ("minifer.layers", "minifer.kernels") and e[1] == "minifer.engine"]
