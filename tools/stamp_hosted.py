#!/usr/bin/env python3
"""Stamp every notebook with its hosted cells: the Colab and Kaggle badges and the setup cell.

    python3 tools/stamp_hosted.py            # stamp notebooks/, exercises/ and solutions/ (idempotent)
    python3 tools/stamp_hosted.py --check    # exit 1 if a notebook's badges or setup cell are missing or stale

One repository URL (``pyproject.toml``, ``[project.urls] Repository``) and the package's version (the release
tag ``v<version>``, ``make release``) determine both cells, so a fork changes one line and re-runs this tool.
The two cells go first, with fixed ids (``minifer-badges``, ``minifer-setup``): stamping again replaces them, never
adds a second pair, and keeps the setup cell's stored outputs (in a clone it prints the same whatever the URL).

``tools/build_exercises.py`` calls ``stamp`` on the notebooks it generates, so an exercise rebuilt from its source
carries the same cells, and ``build_exercises.py --check`` and this tool's ``--check`` agree. What the setup cell
does after installing is ``minifer_course.hosted.setup``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat import NotebookNode
from nbformat.v4 import new_code_cell, new_markdown_cell

from minifer_course.hosted import BADGES_ID, SETUP_ID  # one definition, which the other tools read too

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("notebooks", "exercises", "solutions")
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
KAGGLE_BADGE = "https://kaggle.com/static/images/open-in-kaggle.svg"

SETUP_TEMPLATE = '''\
# Setup. Hosted (Colab, Kaggle): installs the course once, keeping this machine's torch. In a clone: nothing.
import importlib, importlib.util, pathlib, sys, time
t0, here = time.perf_counter(), pathlib.Path.cwd().resolve()
clone = next((p for p in (here, *here.parents) if (p / "minifer_course" / "hosted.py").is_file()), None)
if clone is None and importlib.util.find_spec("minifer_course") is None:
    %pip install --quiet --no-deps "{requirement}"
    importlib.invalidate_caches()
elif clone is not None and importlib.util.find_spec("minifer_course") is None:
    sys.path.insert(0, str(clone))
from minifer_course.hosted import setup
track = setup(since=t0)'''


@dataclass(frozen=True)
class Hosted:
    """Where the hosted notebooks come from: the repository's URL and the release tag they install."""

    repository: str  # https://github.com/OWNER/NAME
    tag: str  # v<version>

    @property
    def slug(self) -> str:
        m = re.fullmatch(r"https://github\.com/([\w.-]+/[\w.-]+?)(?:\.git)?/?", self.repository)
        if m is None:
            raise ValueError(f"[project.urls] Repository must be https://github.com/OWNER/NAME, got {self.repository!r}")
        return m[1]

    @property
    def requirement(self) -> str:
        """What the setup cell's ``%pip install`` installs: the package at the release tag (extras come from
        ``minifer_course.hosted``, which keeps torch)."""
        return f"minifer @ git+https://github.com/{self.slug}@{self.tag}"

    def blob(self, rel_path: str) -> str:
        return f"github/{self.slug}/blob/{self.tag}/{rel_path}"


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(path.read_text(encoding="utf-8"))


def read_config(pyproject: Path = ROOT / "pyproject.toml") -> Hosted:
    """The one repository URL and the version's tag, from ``pyproject.toml``."""
    project = _toml(pyproject)["project"]
    return Hosted(project["urls"]["Repository"], f"v{project['version']}")


def badge_cell(rel_path: str, cfg: Hosted) -> NotebookNode:
    """The badges: each opens this notebook, at the release tag, on the service."""
    colab = f"https://colab.research.google.com/{cfg.blob(rel_path)}"
    kaggle = f"https://kaggle.com/kernels/welcome?src=https://github.com/{cfg.slug}/blob/{cfg.tag}/{rel_path}"
    cell = new_markdown_cell(
        f"[![Open In Colab]({COLAB_BADGE})]({colab}) [![Open in Kaggle]({KAGGLE_BADGE})]({kaggle})\n\n"
        f"*Hosted, run the setup cell below first: it installs minifer {cfg.tag} (a few minutes) and says which "
        f"track it chose (a T4's GPU track, or the CPU track). In a clone it installs nothing.*")
    cell.id = BADGES_ID
    return cell


def setup_cell(cfg: Hosted) -> NotebookNode:
    cell = new_code_cell(SETUP_TEMPLATE.format(requirement=cfg.requirement))
    cell.id = SETUP_ID
    return cell


def stamp(nb: NotebookNode, rel_path: str, cfg: Hosted | None = None) -> NotebookNode:
    """``nb`` with its badges and setup cell first (replaced where present; the setup cell's outputs kept)."""
    cfg = cfg or read_config()
    old = {c.get("id"): c for c in nb.cells if c.get("id") in (BADGES_ID, SETUP_ID)}
    setup = setup_cell(cfg)
    if SETUP_ID in old and old[SETUP_ID].cell_type == "code":
        setup.outputs = old[SETUP_ID].outputs
        setup.execution_count = old[SETUP_ID].execution_count
    nb.cells = [badge_cell(rel_path, cfg), setup] + [c for c in nb.cells if c.get("id") not in old]
    return nb


def problems(nb: NotebookNode, rel_path: str, cfg: Hosted) -> list[str]:
    """How ``nb``'s hosted cells differ from what ``stamp`` writes (empty when they match)."""
    want = [badge_cell(rel_path, cfg), setup_cell(cfg)]
    found = []
    for i, cell in enumerate(want):
        have = nb.cells[i] if i < len(nb.cells) else None
        if have is None or have.get("id") != cell.id:
            found.append(f"{rel_path}: cell {i} is not the {cell.id} cell")
        elif (have.cell_type, have.source) != (cell.cell_type, cell.source):
            found.append(f"{rel_path}: the {cell.id} cell differs from the template ({cfg.repository} at {cfg.tag})")
    extra = [c.get("id") for c in nb.cells[2:] if c.get("id") in (BADGES_ID, SETUP_ID)]
    return found + [f"{rel_path}: a second {i} cell" for i in extra]


def targets(root: Path = ROOT) -> list[Path]:
    return [p for folder in FOLDERS for p in sorted((root / folder).glob("*.ipynb"))]


def _text(nb: NotebookNode) -> str:
    text = nbformat.writes(nb)
    return text if text.endswith("\n") else text + "\n"


def stamp_all(root: Path = ROOT, check: bool = False) -> tuple[list[Path], list[str]]:
    """Stamp every notebook under ``root`` (or, with ``check``, only list what is stale); returns the notebooks
    written and the problems found. ``make release`` calls it after moving the version (the tag) on."""
    cfg, stale, written = read_config(root / "pyproject.toml"), [], []
    for path in targets(root):
        rel = path.relative_to(root).as_posix()
        nb = nbformat.read(path, as_version=4)
        if check:
            stale += problems(nb, rel, cfg)
            continue
        text = _text(stamp(nb, rel, cfg))
        if path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written, stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a notebook's hosted cells are stale")
    args = parser.parse_args(argv)
    cfg, n = read_config(), len(targets())
    written, stale = stamp_all(ROOT, args.check)
    for line in stale:
        print(line, file=sys.stderr)
    if args.check:
        print(f"{n} notebooks checked against {cfg.repository} at {cfg.tag}: "
              f"{'stale, run python3 tools/stamp_hosted.py' if stale else 'up to date'}")
        return 1 if stale else 0
    print(f"{len(written)} of {n} notebooks stamped ({cfg.repository} at {cfg.tag})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
