"""The instructor's guide (docs/instructor-guide.md): it times and summarises every chapter, and the tool its
spread table comes from (tools/notebook_spread.py) lines numbers up correctly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "instructor-guide.md").read_text()
sys.path.insert(0, str(ROOT / "tools"))
import notebook_spread  # noqa: E402


def test_the_guide_times_and_summarises_every_notebook():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb")):
        assert f"`{path.parent.name}/{path.stem}`" in GUIDE, f"the guide's timing table has no row for {path}"
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):  # chapters; appendices are timed only
        assert f"### {path.stem[:2]} · " in GUIDE, f"the guide has no one-page summary of chapter {path.stem[:2]}"
        assert f"\n| {path.stem[:2]} | " in GUIDE, f"the guide's spread table has no row for chapter {path.stem[:2]}"
    for fmt in ("90 minutes", "half a day", "two days"):
        assert fmt in GUIDE.lower()


def _notebook(tmp_path: Path, name: str, outputs: list[str]) -> Path:
    cells = [{"cell_type": "markdown", "source": ["# t"]}]
    cells += [{"cell_type": "code", "source": [], "outputs": [{"output_type": "stream", "name": "stdout", "text": [o]}]}
              for o in outputs]
    path = tmp_path / name
    path.write_text(json.dumps({"cells": cells}))
    return path


def test_spread_lines_up_numbers_by_position(tmp_path):
    a = _notebook(tmp_path, "a.ipynb", ["speedup 1.50x at batch 1, 1,024 tokens", "seed 0"])
    b = _notebook(tmp_path, "b.ipynb", ["speedup 1.20x at batch 1, 1,024 tokens", "seed 0 1"])
    c = _notebook(tmp_path, "c.ipynb", ["speedup 1.35x at batch 1, 1,024 tokens", "seed 0"])
    res = notebook_spread.spread([a, b, c])
    assert res["fixed_numbers"] == 2  # batch 1 and 1,024 (read as 1024) agree
    (v,) = res["varying"]
    assert (v["min"], v["max"], v["label"]) == (1.2, 1.5, "speedup")
    assert abs(v["spread"] - 0.3 / 1.35) < 1e-9
    assert res["reshaped_cells"] == [2]  # the second code cell printed another count of numbers in run b
