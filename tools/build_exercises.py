#!/usr/bin/env python3
"""Build the exercise notebooks and their solved twins from one source per notebook.

    python3 tools/build_exercises.py            # regenerate what changed (`make exercises`)
    python3 tools/build_exercises.py --check    # exit 1 if exercises/ or solutions/ are out of date
    python3 tools/build_exercises.py --force    # re-execute every solutions notebook
    python3 tools/build_exercises.py NAME ...   # only these sources (file stems)

Each ``exercises/source/NAME.py`` gives two notebooks:

* ``exercises/NAME.ipynb``: every solution block replaced by a stub, stored unexecuted (the learner's copy);
* ``solutions/NAME.ipynb``: the markers stripped, executed with nbclient so its outputs are stored
  (readers see the results on GitHub; nbval re-runs it in CI and compares the check cells).

Both start with the hosted notebooks' badges and setup cell (``tools/stamp_hosted.py``, which writes the same two
cells into the chapters).

The source is a Python file in the "percent" format (the one jupytext and VS Code read):

    # %% [markdown]
    # # A title
    # Prose, every line commented with "# " (or a bare "#" for an empty line).

    # %%
    def rms_norm(x, weight, eps):
        \"\"\"The docstring stays in the exercise.\"\"\"
        ### BEGIN SOLUTION
        ...the answer...
        ### END SOLUTION

    # %% nbval-check-output
    from minifer_course.grading.building_blocks import check_rms_norm
    check_rms_norm(rms_norm)

Markers (nbgrader's), each alone on its line, in code or markdown cells:

* ``### BEGIN SOLUTION`` / ``### END SOLUTION``: kept (markers removed) in the solution; in the exercise
  replaced by ``# YOUR CODE HERE`` and ``raise NotImplementedError("implement NAME")`` at the marker's
  indentation, NAME being the enclosing function (``Class.method`` inside a class), or by nothing in a
  markdown cell;
* ``### BEGIN STUB`` / ``### END STUB``: exercise-only lines. Directly after a solution block they replace
  the default stub (a skeleton to fill in, a hint); anywhere else they are simply dropped from the solution.

A cell header may add ``exercise-only`` or ``solution-only`` after ``# %%`` / ``# %% [markdown]``, and a code
cell's header ``nbval-check-output``: the cell gets that tag, which makes it a check cell. It must print a
deterministic report (graders in ``minifer_course.grading``) that nbval compares; the solution must pass it and the
untouched exercise must fail it (``tests/course/test_exercises.py``). Everything before the first ``# %%`` is a note
for authors and is not copied.

The output is deterministic: cell ids are ``cell-<index in the source>``, notebook metadata is fixed, no
timings are recorded, and a solutions notebook whose source did not change is not re-executed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat import NotebookNode
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stamp_hosted import stamp  # noqa: E402 - the tools folder is not a package

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIR = ROOT / "exercises" / "source"
EXERCISE_DIR = ROOT / "exercises"
SOLUTION_DIR = ROOT / "solutions"

CHECK_TAG = "nbval-check-output"  # nbval's cell tag: compare this cell's output (under --nbval-lax)
BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_STUB, END_STUB = "### BEGIN STUB", "### END STUB"
_MARKERS = (BEGIN_SOLUTION, END_SOLUTION, BEGIN_STUB, END_STUB)
_CELL_RE = re.compile(r"^# %%(?P<rest>.*)$")
_DEF_RE = re.compile(r"^(?P<indent>\s*)(?:async\s+def|def|class)\s+(?P<name>\w+)")
_FLAGS = {"exercise-only": "exercise", "solution-only": "solution"}
VARIANTS = ("exercise", "solution")
EXECUTE_TIMEOUT_S = 300

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


class SourceError(ValueError):
    """A malformed exercise source; the message names the file and line."""


@dataclass
class SourceCell:
    kind: str  # "code" or "markdown"
    lines: list[str]  # markdown already uncommented
    only: str | None  # None, "exercise" or "solution"
    check: bool  # a check cell: tagged CHECK_TAG
    index: int  # position among the source's cells: the cell id in both notebooks
    lineno: int  # 1-based line of the cell's first body line, for error messages


# --- parsing --------------------------------------------------------------------------------------


def parse_source(text: str, origin: str = "<source>") -> list[SourceCell]:
    """Split a percent-format source into cells (markdown uncommented, blank edges trimmed)."""
    cells: list[SourceCell] = []
    current: SourceCell | None = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        m = _CELL_RE.match(line)
        if m:
            kind, only, check = _parse_header(m["rest"], f"{origin}:{lineno}")
            current = SourceCell(kind=kind, lines=[], only=only, check=check, index=len(cells), lineno=lineno + 1)
            cells.append(current)
            continue
        if current is None:
            continue  # the author's note before the first cell
        if current.kind == "markdown":
            if line.strip() and not (line == "#" or line.startswith("# ")):
                raise SourceError(f"{origin}:{lineno}: markdown lines must start with '# ' (or be '#'): {line!r}")
            line = line[2:]
        current.lines.append(line.rstrip())
    for cell in cells:
        while cell.lines and not cell.lines[0].strip():
            cell.lines.pop(0)
            cell.lineno += 1
        while cell.lines and not cell.lines[-1].strip():
            cell.lines.pop()
    if not cells:
        raise SourceError(f"{origin}: no cells (a cell starts with a '# %%' line)")
    for cell in cells:
        _blocks(cell, origin)  # validate markers now, with line numbers
    return cells


def _parse_header(rest: str, where: str) -> tuple[str, str | None, bool]:
    words = rest.split()
    kind = "code"
    if words and words[0] == "[markdown]":
        kind, words = "markdown", words[1:]
    only, check = None, False
    for word in words:
        if word == CHECK_TAG and kind == "code" and not check:
            check = True
        elif word not in _FLAGS or only is not None:
            raise SourceError(f"{where}: unexpected {word!r} in the cell header (allowed: [markdown], "
                              f"{', '.join(_FLAGS)}, and {CHECK_TAG} on a code cell)")
        else:
            only = _FLAGS[word]
    return kind, only, check


def _blocks(cell: SourceCell, origin: str) -> list[tuple[str, int, int]]:
    """The cell as ``(kind, start, end)`` line ranges: kind "text", "solution" or "stub" (markers excluded
    from the content range; ``start`` of a block is its BEGIN marker's line)."""
    blocks: list[tuple[str, int, int]] = []
    open_kind, open_at, text_from = None, 0, 0
    for i, line in enumerate(cell.lines):
        marker = line.strip()
        if marker not in _MARKERS:
            if any(m.split(maxsplit=1)[1] in line.upper() for m in _MARKERS) and "###" in line:
                raise SourceError(f"{origin}:{cell.lineno + i}: malformed marker {line.strip()!r} "
                                  f"(write exactly one of {', '.join(_MARKERS)} on its own line)")
            continue
        where = f"{origin}:{cell.lineno + i}"
        verb, kind = marker.split()[1], marker.split()[2].lower()
        if verb == "BEGIN":
            if open_kind is not None:
                raise SourceError(f"{where}: {marker} inside an open {open_kind} block")
            blocks.append(("text", text_from, i))
            open_kind, open_at = kind, i
        else:
            if open_kind != kind:
                raise SourceError(f"{where}: {marker} without a matching BEGIN")
            blocks.append((kind, open_at, i))
            open_kind, text_from = None, i + 1
    if open_kind is not None:
        raise SourceError(f"{origin}:{cell.lineno + open_at}: {open_kind} block never closed")
    blocks.append(("text", text_from, len(cell.lines)))
    return [b for b in blocks if b[0] != "text" or b[2] > b[1]]


# --- rendering ------------------------------------------------------------------------------------


def _enclosing_name(lines: list[str], at: int) -> str | None:
    """``Class.method`` (or ``function``) that encloses line ``at``, from the def/class lines above it."""
    indent = len(lines[at]) - len(lines[at].lstrip())
    names = []
    for line in reversed(lines[:at]):
        m = _DEF_RE.match(line)
        if m and len(m["indent"]) < indent:
            names.append(m["name"])
            indent = len(m["indent"])
    return ".".join(reversed(names)) or None


def _default_stub(cell: SourceCell, at: int) -> list[str]:
    if cell.kind == "markdown":
        return []
    marker = cell.lines[at]
    pad = marker[: len(marker) - len(marker.lstrip())]
    name = _enclosing_name(cell.lines, at)
    what = f"implement {name}" if name else "complete this cell"
    return [f"{pad}# YOUR CODE HERE", f'{pad}raise NotImplementedError("{what}")']


def render_cell(cell: SourceCell, variant: str, origin: str = "<source>") -> str | None:
    """The cell's text in ``variant`` ("exercise" or "solution"), or None if the cell is not in it."""
    if cell.only not in (None, variant):
        return None
    out: list[str] = []
    blocks = _blocks(cell, origin)
    for n, (kind, start, end) in enumerate(blocks):
        if kind == "text":
            out += cell.lines[start:end]
        elif kind == "solution":
            if variant == "solution":
                out += cell.lines[start + 1:end]
            elif not (n + 1 < len(blocks) and blocks[n + 1][0] == "stub" and blocks[n + 1][1] == end + 1):
                out += _default_stub(cell, start)
        elif kind == "stub" and variant == "exercise":
            out += cell.lines[start + 1:end]
    return "\n".join(out)


def build_notebook(cells: list[SourceCell], variant: str, origin: str) -> NotebookNode:
    """An unexecuted notebook for ``variant``, with stable ids and fixed metadata."""
    nb = new_notebook()
    nb.nbformat, nb.nbformat_minor = 4, 5
    nb.metadata = notebook_metadata(origin, variant)
    for cell in cells:
        text = render_cell(cell, variant, origin)
        if text is None:
            continue
        new = new_markdown_cell(text) if cell.kind == "markdown" else new_code_cell(text)
        new.id = f"cell-{cell.index:02d}"
        if cell.check:
            new.metadata["tags"] = [CHECK_TAG]
        nb.cells.append(new)
    nbformat.validate(nb)
    return nb


def notebook_metadata(origin: str, variant: str) -> dict:
    return {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"},
            "minifer": {"generated_from": origin, "variant": variant,
                        "regenerate_with": "make exercises"}}


def is_check_cell(cell: NotebookNode) -> bool:
    return cell.cell_type == "code" and CHECK_TAG in cell.get("metadata", {}).get("tags", [])


# --- execution, comparison, files -----------------------------------------------------------------


def execute(nb: NotebookNode, cwd: Path) -> NotebookNode:
    """Run every cell in a fresh kernel (cwd as nbval uses: the notebook's folder); raise on any error."""
    from nbclient import NotebookClient

    client = NotebookClient(nb, timeout=EXECUTE_TIMEOUT_S, kernel_name=KERNELSPEC["name"],
                            resources={"metadata": {"path": str(cwd)}}, record_timing=False)
    client.execute()
    metadata = nb.metadata.get("minifer", {})
    nb.metadata = notebook_metadata(metadata.get("generated_from", ""), metadata.get("variant", "solution"))
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = coalesce_streams(cell.outputs)
    return nb


def coalesce_streams(outputs: list) -> list:
    """Merge consecutive stdout (or stderr) chunks, which the kernel splits wherever its flushes fall."""
    merged: list = []
    for out in outputs:
        if (out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                and merged[-1].get("name") == out.get("name")):
            merged[-1]["text"] += out["text"]
        else:
            merged.append(out)
    return merged


def fingerprint(nb: NotebookNode) -> str:
    """What the source determines: cell types, ids, sources and metadata (not outputs or counts)."""
    cells = [{"type": c.cell_type, "id": c.get("id"), "source": c.source,
              "metadata": {k: v for k, v in c.metadata.items() if k != "execution"}} for c in nb.cells]
    return json.dumps({"metadata": nb.metadata, "cells": cells}, sort_keys=True)


def execution_problems(nb: NotebookNode) -> list[str]:
    """Why a stored solutions notebook does not count as executed and passing (empty if it does)."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        if cell.get("execution_count") is None:
            problems.append(f"cell {i} was not executed")
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            problems.append(f"cell {i} stored an error")
    return problems


def has_outputs(nb: NotebookNode) -> bool:
    return any(c.cell_type == "code" and (c.outputs or c.execution_count is not None) for c in nb.cells)


def to_text(nb: NotebookNode) -> str:
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def read(path: Path) -> NotebookNode | None:
    return nbformat.read(path, as_version=4) if path.exists() else None


def write_if_changed(path: Path, nb: NotebookNode) -> bool:
    text = to_text(nb)
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True


@dataclass
class Exercise:
    name: str
    source: Path

    @property
    def origin(self) -> str:
        return self.source.relative_to(ROOT).as_posix()

    @property
    def exercise_path(self) -> Path:
        return EXERCISE_DIR / f"{self.name}.ipynb"

    @property
    def solution_path(self) -> Path:
        return SOLUTION_DIR / f"{self.name}.ipynb"

    def cells(self) -> list[SourceCell]:
        return parse_source(self.source.read_text(encoding="utf-8"), self.origin)

    def notebooks(self) -> dict[str, NotebookNode]:
        """Both variants, each with the hosted notebooks' badges and setup cell first (``stamp_hosted.stamp``, the
        same cells the stamp tool writes, so its ``--check`` and this one's agree)."""
        cells = self.cells()
        paths = {"exercise": self.exercise_path, "solution": self.solution_path}
        nbs = {v: stamp(build_notebook(cells, v, self.origin), paths[v].relative_to(ROOT).as_posix())
               for v in VARIANTS}
        if not any(is_check_cell(c) for c in nbs["solution"].cells):
            raise SourceError(f"{self.origin}: no check cell (a code cell tagged {CHECK_TAG!r})")
        return nbs


def discover(names: list[str] | None = None) -> list[Exercise]:
    found = {p.stem: Exercise(p.stem, p) for p in sorted(SOURCE_DIR.glob("*.py")) if not p.name.startswith("_")}
    if names:
        missing = [n for n in names if n not in found]
        if missing:
            raise SourceError(f"no source for {', '.join(missing)} in {SOURCE_DIR.relative_to(ROOT)}")
        return [found[n] for n in names]
    return list(found.values())


def orphans(exercises: list[Exercise]) -> list[Path]:
    """Generated-looking notebooks with no source (a renamed or deleted source leaves them behind)."""
    names = {e.name for e in exercises}
    return [p for d in (EXERCISE_DIR, SOLUTION_DIR) for p in sorted(d.glob("*.ipynb")) if p.stem not in names]


def check(exercises: list[Exercise], all_sources: bool) -> list[str]:
    """Every way the stored notebooks differ from what the sources generate."""
    stale = []
    for ex in exercises:
        nbs = ex.notebooks()
        fix = f"run `make exercises` (python3 tools/build_exercises.py {ex.name})"
        stored_ex, stored_sol = read(ex.exercise_path), read(ex.solution_path)
        rel_ex, rel_sol = ex.exercise_path.relative_to(ROOT), ex.solution_path.relative_to(ROOT)
        if stored_ex is None:
            stale.append(f"{rel_ex} is missing: {fix}")
        elif to_text(stored_ex) != to_text(nbs["exercise"]):
            why = "has outputs (exercises are stored unexecuted)" if has_outputs(stored_ex) else \
                "differs from its source"
            stale.append(f"{rel_ex} {why}: {fix}")
        if stored_sol is None:
            stale.append(f"{rel_sol} is missing: {fix}")
        elif fingerprint(stored_sol) != fingerprint(nbs["solution"]):
            stale.append(f"{rel_sol} differs from its source: {fix}")
        else:
            stale += [f"{rel_sol}: {p}: {fix}" for p in execution_problems(stored_sol)]
    if all_sources:
        stale += [f"{p.relative_to(ROOT)} has no source in {SOURCE_DIR.relative_to(ROOT)}/: delete it or add one"
                  for p in orphans(exercises)]
    return stale


def build(exercises: list[Exercise], force: bool) -> int:
    failed = 0
    for ex in exercises:
        nbs = ex.notebooks()
        rel_ex, rel_sol = ex.exercise_path.relative_to(ROOT), ex.solution_path.relative_to(ROOT)
        print(f"{rel_ex}: {'written' if write_if_changed(ex.exercise_path, nbs['exercise']) else 'up to date'}")
        stored = read(ex.solution_path)
        if (not force and stored is not None and fingerprint(stored) == fingerprint(nbs["solution"])
                and not execution_problems(stored)):
            print(f"{rel_sol}: up to date (--force re-executes it)")
            continue
        print(f"{rel_sol}: executing ...", flush=True)
        try:
            executed = execute(nbs["solution"], SOLUTION_DIR)
        except Exception as exc:  # CellExecutionError carries the cell and its traceback
            print(f"{rel_sol}: NOT written, the solution failed:\n{exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"{rel_sol}: {'written' if write_if_changed(ex.solution_path, executed) else 'unchanged'}")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="source stems to build (default: all in exercises/source/)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the generated notebooks are out of date")
    parser.add_argument("--force", action="store_true", help="re-execute solutions even if up to date")
    args = parser.parse_args(argv)
    try:
        exercises = discover(args.names)
        if args.check:
            stale = check(exercises, all_sources=not args.names)
            for line in stale:
                print(line, file=sys.stderr)
            if not stale:
                print(f"{len(exercises)} exercise notebook(s) and their solutions are up to date")
            return 1 if stale else 0
        for path in orphans(exercises) if not args.names else []:
            print(f"warning: {path.relative_to(ROOT)} has no source; delete it if its source was removed",
                  file=sys.stderr)
        return 1 if build(exercises, args.force) else 0
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
