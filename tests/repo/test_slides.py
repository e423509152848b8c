"""tools/make_slides.py (`make slides`): the slide structure it derives from a chapter's headings on a copy, and
the reveal.js deck nbconvert makes of one chapter."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import make_slides  # noqa: E402


def _md(text: str) -> dict:
    return {"cell_type": "markdown", "id": f"m{abs(hash(text)) % 10**6}", "metadata": {}, "source": text}


def _code(text: str, printed: str = "") -> dict:
    outputs = [{"output_type": "stream", "name": "stdout", "text": printed}] if printed else []
    return {"cell_type": "code", "id": f"c{abs(hash(text)) % 10**6}", "metadata": {}, "execution_count": 1,
            "source": text, "outputs": outputs}


def _notebook() -> dict:
    cells = [
        _md("# 07 · A chapter\n\nWhat it shows."),
        _code("x = 1"),
        _md("Text that ends section 1.\n\n## 2. The next section\n\nIts first words."),
        _md("```python\n# a comment, not a heading\n```"),
        _md("### Predict, then run\n\nGuess first."),
        _code("print(x)", printed="1\n" * (make_slides.BUDGET // 2)),
        _md("A long explanation after a long output."),
        _md("## Review questions\n\n1. Why?"),
        _code("answer = 42"),
        _md("## Exercises\n\nexercises/07.ipynb\n\n## Next\n\nChapter 08."),
    ]
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_headings_make_slides_and_the_chapter_is_left_as_it_was():
    nb = _notebook()
    before = copy.deepcopy(nb)
    slides = make_slides.with_slides(nb)
    assert nb == before, "the chapter itself must not change: the slide metadata lives on a copy"
    kinds = [(c["metadata"]["slideshow"]["slide_type"], c["source"].split("\n")[0]) for c in slides["cells"]]
    assert kinds == [
        ("slide", "# 07 · A chapter"),
        ("-", "x = 1"),
        ("-", "Text that ends section 1."),
        ("slide", "## 2. The next section"),  # split out of the cell above
        ("-", "```python"),  # a '#' inside a code fence is no heading
        ("subslide", "### Predict, then run"),
        ("-", "print(x)"),
        ("subslide", "A long explanation after a long output."),  # the slide was full
        ("notes", "## Review questions"),
        ("notes", "answer = 42"),
        ("skip", "## Exercises"),
        ("skip", "## Next"),
    ]
    ids = [c["id"] for c in slides["cells"]]
    assert len(set(ids)) == len(ids)


def test_links_are_rewritten_for_the_decks_folder():
    text = "See [prefill](../docs/glossary.md#prefill), [web](https://x.org/a) and [here](#top)."
    out = make_slides.relink(text, ROOT / "notebooks", ROOT / "build" / "slides")
    assert "](../../docs/glossary.md#prefill)" in out and "](https://x.org/a)" in out and "](#top)" in out


def test_nbconvert_makes_a_deck_of_a_chapter(tmp_path):
    chapter = min(make_slides.chapters(ROOT / "notebooks", appendices=False), key=lambda p: p.stat().st_size)
    stored = chapter.read_bytes()
    (deck,) = make_slides.build([chapter], tmp_path)
    html = deck.read_text()
    assert deck.name == f"{chapter.stem}.slides.html" and "Reveal.initialize" in html
    slides = make_slides.with_slides(json.loads(stored))
    heads = sum(c["metadata"]["slideshow"]["slide_type"] in ("slide", "subslide") for c in slides["cells"])
    assert html.count("<section") >= heads
    assert chapter.read_bytes() == stored
