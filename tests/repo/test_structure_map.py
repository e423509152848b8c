"""docs/structure.md, the one-page map of the engine, against the tree: every module of ``minifer/`` has exactly one
line, every line names a module that exists, and each says what it holds and where vLLM keeps the same concept."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| `(minifer/[^`]+\.py)` \| (.+?) \| (.+?) \|$")


def rows(text: str) -> list[tuple[str, str, str]]:
    return [m.groups() for line in text.splitlines() if (m := ROW.match(line))]


def test_every_module_has_one_line_and_every_line_a_module():
    mapped = [path for path, _, _ in rows((ROOT / "docs" / "structure.md").read_text(encoding="utf-8"))]
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "minifer").rglob("*.py"))
    assert sorted(set(mapped)) == sorted(mapped), "a module is mapped twice"
    assert not sorted(set(modules) - set(mapped)), f"modules without a line in docs/structure.md: " \
                                                   f"{sorted(set(modules) - set(mapped))}"
    assert not sorted(set(mapped) - set(modules)), f"lines naming no module: {sorted(set(mapped) - set(modules))}"


def test_each_line_says_what_it_holds_and_its_vllm_counterpart():
    for path, holds, vllm in rows((ROOT / "docs" / "structure.md").read_text(encoding="utf-8")):
        assert len(holds) > 10, path
        assert vllm.startswith("none") or "vllm/" in vllm or "benchmarks/" in vllm, (path, vllm)


def test_the_row_pattern_reads_a_row_and_refuses_a_malformed_one():
    assert rows("| `minifer/a.py` | what it holds | `vllm/a.py` |") == [("minifer/a.py", "what it holds", "`vllm/a.py`")]
    assert rows("| minifer/a.py | no backticks | `vllm/a.py` |") == []


PIECE_ROW = re.compile(r"^\| `(\w+)` \| (\w+) \| (.+?) \| (.+?) \|$")


def test_every_exercise_piece_names_its_seam_or_that_it_is_graded_on_its_own():
    from minifer_course import workbench, workbench_quant

    table = {m.group(1): (m.group(2), m.group(3)) for line in
             (ROOT / "docs" / "structure.md").read_text(encoding="utf-8").splitlines() if (m := PIECE_ROW.match(line))}
    pieces = {**workbench.PIECES, **workbench_quant.QUANT_PIECES}
    assert sorted(table) == sorted(pieces), "docs/structure.md's table of pieces and the course's list differ"
    for name, piece in pieces.items():
        notebook, seam = table[name]
        assert notebook == piece.notebook and seam.strip("`") in (f"Components.{piece.seam}", piece.seam), name
