"""The instructor's guide (docs/instructor-guide.md): it times and summarises every chapter, and the tool its
spread table comes from (tools/notebook_spread.py) lines numbers up correctly."""

from __future__ import annotations

import importlib.util
import json
import re
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


def _row(table_start: str) -> str:
    """The guide's table row that begins with ``table_start``."""
    (row,) = [line for line in GUIDE.splitlines() if line.startswith(table_start)]
    return row


def test_the_guide_gives_every_exercise_a_working_time_naming_what_the_learner_writes():
    for path in sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb")):
        row = _row(f"| `{path.stem}` |")
        source = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
        for name in re.findall(r'NotImplementedError\("implement (\w+)', source):
            assert f"`{name}`" in row, f"the working-times row of {path.stem} does not name {name}"
        assert re.search(r"\d+(-[\d.]+)? (min|h)\b", row.split("|")[3]), f"{path.stem}: no working time"
    assert "not yet timed by an engineer solving it from its instructions" in " ".join(GUIDE.split())


def test_the_ninety_minute_format_has_a_hands_on_exercise_with_its_measured_time():
    ninety = GUIDE[GUIDE.index("**90 minutes"):GUIDE.index("**Half a day")]
    hands_on = [line for line in ninety.splitlines() if "**hands-on**" in line]
    assert hands_on and "exercises/" in hands_on[0]
    assert re.search(r"spent \d+ s in §1's three grading cells", ninety)


def test_troubleshooting_gives_the_reset_command_and_the_requirements_are_one_table():
    row = _row("| my notebook broke")
    assert "`python -m minifer_course.reset NN`" in row
    assert importlib.util.find_spec("minifer_course.reset") is not None
    requirements = (ROOT / "docs" / "requirements.md").read_text()
    assert "(requirements.md)" in GUIDE and "make slides" in GUIDE
    rows = [line for line in requirements.splitlines() if line.startswith("| **")]
    assert [r.split("**")[1] for r in rows[:3]] == ["disk", "memory", "install minutes"]
    for r in rows:
        assert r.rstrip(" |").endswith("not run | not run"), "macOS and Windows were not run: say so"
