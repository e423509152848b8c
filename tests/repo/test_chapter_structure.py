"""Each chapter's core path has the same frame (objectives first; review questions and a summary last; a
"predict, then run" cell; the engine source it teaches), reads in at most ~35 minutes, and links the glossary
on first use with links that land; the deep dives live in appendix notebooks that a chapter links to and
that nbval executes with the chapters (the Makefile runs it over the whole ``notebooks`` folder)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minifer_course.hosted import HOSTED_IDS

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
APPENDICES = sorted(NOTEBOOKS.glob("appendix_*.ipynb"))
GLOSSARY = ROOT / "docs" / "glossary.md"
WORDS_PER_MINUTE = 200  # technical prose; code cells are counted in words too
CORE_PATH_MINUTES = 35




def _cells(path: Path) -> list[dict]:
    """The chapter's own cells: the hosted badges and setup cell stamped above them are not part of its frame."""
    return [c for c in json.loads(path.read_text())["cells"] if c.get("id") not in HOSTED_IDS]


def _text(cell: dict) -> str:
    return "".join(cell["source"])


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def glossary_anchors() -> set[str]:
    return {_slug(m) for m in re.findall(r"^#{2,4} (.+)$", GLOSSARY.read_text(), re.M)}


def reading_minutes(path: Path) -> float:
    return sum(len(_text(c).split()) for c in _cells(path)) / WORDS_PER_MINUTE


@pytest.mark.parametrize("path", CHAPTERS + APPENDICES, ids=lambda p: p.stem)
def test_glossary_links_land(path):
    anchors = glossary_anchors()
    links = [a for c in _cells(path) if c["cell_type"] == "markdown"
             for a in re.findall(r"glossary\.md#([\w\-]+)", _text(c))]
    assert not set(links) - anchors, f"{path.name} links to glossary terms that have no heading: {set(links) - anchors}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_frame(path):
    cells = _cells(path)
    md = [_text(c) for c in cells if c["cell_type"] == "markdown"]
    code = [_text(c) for c in cells if c["cell_type"] == "code"]
    assert "## Objectives" in "".join(md[:2]), "objectives come first"
    tail = "\n".join(md[-4:])
    assert "## Review questions" in tail and "## Summary" in tail, "review questions and a summary close the core path"
    assert any("glossary.md#" in m for m in md), "the chapter links the glossary"
    assert any(re.search(r"^my_prediction = None", c, re.M) for c in code), "a predict-then-run cell"
    assert any("check_prediction(my_prediction" in c for c in code), "the prediction is set beside the measurement"
    assert any("show_source(" in c for c in code), "the chapter shows the engine source it teaches"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_core_path_reads_in_35_minutes(path):
    assert reading_minutes(path) <= CORE_PATH_MINUTES, f"{path.name}: {reading_minutes(path):.0f} minutes of reading"


@pytest.mark.parametrize("path", APPENDICES, ids=lambda p: p.stem)
def test_appendix_is_linked_from_its_chapter(path):
    chapter = next(NOTEBOOKS.glob(f"{path.stem.split('_')[1]}_*.ipynb"))
    assert any(path.name in _text(c) for c in _cells(chapter)), f"{chapter.name} does not link {path.name}"
    assert (ROOT / "Makefile").read_text().count("NOTEBOOKS = notebooks"), "nbval runs over the notebooks folder"


NBVAL_TAGS = {"nbval-check-output", "nbval-ignore-output", "nbval-skip", "nbval-raises-exception"}


@pytest.mark.parametrize("path", sorted([*NOTEBOOKS.rglob("*.ipynb"), *(ROOT / "exercises").glob("*.ipynb"),
                                         *(ROOT / "solutions").glob("*.ipynb")]), ids=lambda p: p.name)
def test_nbval_markers_are_cell_tags_not_comments(path):
    """A learner reads the cell, not the test harness: nbval's markers live in the cell's tags."""
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] == "code":
            assert not re.search(r"#\s*NBVAL_", _text(cell)), f"{path.name} cell {i}: an nbval comment, use a tag"
            unknown = {t for t in cell["metadata"].get("tags", []) if t.startswith("nbval")} - NBVAL_TAGS
            assert not unknown, f"{path.name} cell {i}: {unknown} is not one of nbval's tags"
