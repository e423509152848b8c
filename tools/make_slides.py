"""Lecture slides from the chapters: ``make slides`` (or ``python tools/make_slides.py``).

Every chapter in ``notebooks/`` (``NN_*.ipynb``; the appendices with ``--appendices``) becomes a reveal.js
deck, ``build/slides/NN_*.slides.html``, made by ``jupyter nbconvert --to slides`` from its committed outputs:
nothing is executed, so a deck shows the numbers the chapter stores.

The chapters carry no slide metadata, and they should not: they are read as notebooks first, every edit to
them goes through the lead, and hand-kept metadata would drift from the text. So the slide structure is
derived here, on a copy, from the headings the chapters already have:

* a markdown cell is split at each heading line (a chapter often opens its next section at the end of a cell),
  so that every heading begins a cell;
* ``#`` and ``##`` start a slide, ``###`` a sub-slide (reveal.js: below the slide, reached with the down key);
* the other cells belong to the current (sub-)slide, until it holds about ``BUDGET`` characters of source and
  printed text; the next markdown cell then starts a sub-slide, so that a slide fits a projector;
* "Review questions" become speaker notes (press ``s`` in the deck); "Exercises", "Next" and appendix
  pointers are skipped: a lecture points at them aloud.

The copies are written beside the decks (``build/slides/src/``) so that what nbconvert read can be looked at.
The decks load reveal.js from a CDN (nbconvert's default); for a room without a network, pass
``--reveal-prefix`` the folder of a local reveal.js copy.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from minifer_course.hosted import HOSTED_IDS

ROOT = Path(__file__).resolve().parents[1]
HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\]\(([^)\s]+)")
# Characters of source and printed text after which the next markdown cell opens a sub-slide.
BUDGET = 1500
NOTES = ("review questions",)
SKIPPED = ("exercises", "exercise", "next", "appendix")


def split_at_headings(source: str) -> list[str]:
    """``source`` cut before each heading line outside a code fence: one piece per heading, plus the text
    before the first. Why: a chapter often ends a section and opens the next in one cell."""
    pieces, current, fenced = [], [], False
    for line in source.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        if not fenced and HEADING.match(line.rstrip("\n")) and "".join(current).strip():
            pieces.append("".join(current))
            current = []
        current.append(line)
    if "".join(current).strip():
        pieces.append("".join(current))
    return pieces


def heading_of(cell: dict) -> tuple[int, str] | None:
    """``(level, title)`` when a markdown cell opens with a heading, else ``None``."""
    if cell["cell_type"] != "markdown":
        return None
    lines = _text(cell["source"]).lstrip().splitlines()
    match = HEADING.match(lines[0]) if lines else None
    return (len(match.group(1)), match.group(2).strip()) if match else None


def section_kind(title: str) -> str:
    """``notes``, ``skip`` or ``slide`` for a section's title: what a lecture does with the section."""
    words = re.sub(r"^[\d.\s]+", "", title).lower()
    if words.startswith(NOTES):
        return "notes"
    if words.split(" ")[0].strip(":·") in SKIPPED:
        return "skip"
    return "slide"


def cell_size(cell: dict) -> int:
    """Characters a cell puts on a slide: its source and its printed text (an image counts as a full slide)."""
    size = len(_text(cell["source"]))
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if any(k.startswith("image/") for k in data):
            size += BUDGET
        size += len(_text(out.get("text", ""))) + len(_text(data.get("text/plain", "")))
    return size


def slide_types(cells: list[dict]) -> list[str]:
    """Each cell's ``slideshow.slide_type`` (``slide``, ``subslide``, ``-``, ``notes``, ``skip``)."""
    types, kind, filled = [], "slide", 0
    for cell in cells:
        head = heading_of(cell)
        if head is not None and head[0] <= 3:
            level, title = head
            if level <= 2:
                kind = section_kind(title)
            if kind == "slide":
                types.append("slide" if level <= 2 else "subslide")
                filled = cell_size(cell)
                continue
        if kind != "slide":
            types.append(kind)
            continue
        starts = cell["cell_type"] == "markdown" and filled > 0 and filled + cell_size(cell) > BUDGET
        types.append("subslide" if starts else "-")
        filled = cell_size(cell) if starts else filled + cell_size(cell)
    return types


def with_slides(nb: dict) -> dict:
    """A copy of notebook ``nb`` (its JSON, as a dict) with markdown cells split at headings and every cell's
    slide type set. ``nb`` itself is left as it was."""
    out = copy.deepcopy(nb)
    cells = []
    for cell in out["cells"]:
        if cell.get("id") in HOSTED_IDS:  # the hosted notebooks' badges and setup cell: not lecture material
            continue
        if cell["cell_type"] != "markdown":
            cells.append(cell)
            continue
        for k, piece in enumerate(split_at_headings(_text(cell["source"])) or [""]):
            part = {**copy.deepcopy(cell), "source": piece}
            if "id" in cell and k:
                part["id"] = f"{cell['id']}-{k}"  # ids must stay unique in a notebook
            cells.append(part)
    for cell, kind in zip(cells, slide_types(cells)):
        cell.setdefault("metadata", {})["slideshow"] = {"slide_type": kind}
    out["cells"] = cells
    return out


def relink(source: str, notebook_dir: Path, out: Path) -> str:
    """Markdown links relative to the chapter (``../docs/glossary.md``) rewritten relative to the deck's
    folder, so that a link in a slide still reaches the repository's file."""
    def fix(match: re.Match) -> str:
        target = match.group(1)
        if re.match(r"^([a-z][a-z0-9+.-]*:|#|/)", target, re.I):
            return match.group(0)
        return f"]({os.path.relpath(notebook_dir / target, out)}"
    return LINK.sub(fix, source)


def _text(source: str | list[str]) -> str:
    return "".join(source) if isinstance(source, list) else source


def chapters(notebooks: Path, appendices: bool) -> list[Path]:
    found = sorted(notebooks.glob("[0-9][0-9]_*.ipynb"))
    return found + (sorted(notebooks.glob("appendix_*.ipynb")) if appendices else [])


def build(paths: list[Path], out: Path, reveal_prefix: str | None = None) -> list[Path]:
    """Write the derived copies to ``out/src`` and run nbconvert on them once; the decks' paths."""
    src = out / "src"
    src.mkdir(parents=True, exist_ok=True)
    copies = []
    for path in paths:
        target = src / path.name
        nb = with_slides(json.loads(path.read_text()))
        for cell in nb["cells"]:
            if cell["cell_type"] == "markdown":
                cell["source"] = relink(_text(cell["source"]), path.resolve().parent, out.resolve())
        target.write_text(json.dumps(nb, indent=1))
        copies.append(target)
    command = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "slides", "--no-prompt",
               "--SlidesExporter.reveal_scroll=True", "--SlidesExporter.reveal_theme=simple",
               "--output-dir", str(out), *map(str, copies)]
    if reveal_prefix:
        command.insert(-len(copies), f"--SlidesExporter.reveal_url_prefix={reveal_prefix}")
    subprocess.run(command, check=True, capture_output=True, text=True)
    return [out / f"{p.stem}.slides.html" for p in copies]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks to convert (default: every chapter)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "slides", help="default: build/slides")
    parser.add_argument("--appendices", action="store_true", help="the appendix notebooks too")
    parser.add_argument("--reveal-prefix", help="where reveal.js is (a local copy, for a room without a network)")
    args = parser.parse_args(argv)
    paths = args.notebooks or chapters(ROOT / "notebooks", args.appendices)
    try:
        decks = build(paths, args.out, args.reveal_prefix)
    except subprocess.CalledProcessError as err:
        print(err.stderr, file=sys.stderr)
        return err.returncode
    for deck in decks:
        print(deck.relative_to(Path.cwd()) if deck.is_relative_to(Path.cwd()) else deck)
    return 0


if __name__ == "__main__":
    sys.exit(main())
