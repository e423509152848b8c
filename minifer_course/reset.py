"""Start an exercise again: ``python -m minifer_course.reset 03_continuous_batching`` (or just ``03``).

A learner's notebook can break beyond repair (a cell deleted, outputs of a kernel long gone), and the pieces it saved
in ``my_engine/`` outlive it: the capstone would go on running them. Resetting an exercise does both halves:

* its notebook, ``exercises/NAME.ipynb``, comes back as the repository has it (``git checkout HEAD -- PATH`` in a
  clone; yours is kept beside it as ``NAME.ipynb.bak`` when it differs). Outside a clone (an installed package) it
  says where to download it from;
* the pieces it saved are removed from ``my_engine/`` (``exercises/my_engine/``, or ``$MINIFER_MY_ENGINE``): those
  ``workbench.PIECES`` and ``workbench_quant.QUANT_PIECES`` list for that notebook, and the older exercise's file a
  piece replaced (``workbench.RETIRED``). Other exercises' pieces stay.

``--keep-notebook`` or ``--keep-pieces`` does one half only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPOSITORY = "the course's repository (where you cloned or downloaded it from)"


def course_root(given: str | None = None) -> Path:
    """The folder that holds ``exercises/``: ``given``, else the clone this package sits in, else the working
    directory (or its parent, when that is ``exercises/``)."""
    candidates = [Path(given)] if given else [Path(__file__).resolve().parents[1], Path.cwd(), Path.cwd().parent]
    for root in candidates:
        if (root / "exercises").is_dir():
            return root.resolve()
    raise SystemExit(f"no exercises/ folder in {', '.join(map(str, candidates))}: run this from the course's folder, "
                     f"or give it with --root")


def exercise_name(given: str, root: Path) -> str:
    """``03`` or ``03_continuous_batching`` (or its path) -> ``03_continuous_batching``."""
    stem = Path(given).name.removesuffix(".ipynb")
    names = sorted(p.stem for p in (root / "exercises").glob("*.ipynb"))
    found = [n for n in names if n == stem or n.split("_")[0] == stem]
    if len(found) != 1:
        raise SystemExit(f"no single exercise named {given!r}: the exercises are {', '.join(names)}")
    return found[0]


def pieces_of(exercise: str) -> list[str]:
    """The saved files' names of ``exercise``'s pieces (with the older files they replaced)."""
    from minifer_course import workbench, workbench_quant

    pieces = [n for n, p in {**workbench.PIECES, **workbench_quant.QUANT_PIECES}.items() if p.notebook == exercise]
    return pieces + [workbench.RETIRED[n] for n in pieces if n in workbench.RETIRED]


def remove_pieces(exercise: str, my_engine: Path) -> list[Path]:
    removed = []
    for name in pieces_of(exercise):
        file = my_engine / f"{name}.py"
        if file.is_file():
            file.unlink()
            removed.append(file)
    return removed


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def restore_notebook(root: Path, exercise: str) -> str:
    """Put the repository's notebook back; what was done, in words. Raises ``SystemExit`` outside a clone."""
    path = Path("exercises") / f"{exercise}.ipynb"
    notebook = root / path
    if shutil.which("git") is None or _git(root, "ls-files", "--error-unmatch", str(path)).returncode != 0:
        raise SystemExit(f"{notebook} is not in a git clone, so it cannot be restored from here: download "
                         f"exercises/{exercise}.ipynb again from {REPOSITORY} and put it in place of yours")
    if _git(root, "diff", "--quiet", "HEAD", "--", str(path)).returncode == 0:
        return f"{path}: already as the repository has it"
    backup = notebook.with_name(notebook.name + ".bak")
    if notebook.is_file():
        shutil.copy2(notebook, backup)
    done = _git(root, "checkout", "HEAD", "--", str(path))
    if done.returncode != 0:
        raise SystemExit(f"git could not restore {path}: {done.stderr.strip()}")
    return f"{path}: restored from the repository (yours is kept as {backup.name})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minifer_course.reset", description=__doc__.split("\n")[0])
    parser.add_argument("exercise", help="the exercise: 03_continuous_batching, or 03")
    parser.add_argument("--root", help="the course's folder (default: the clone this package is in, or here)")
    parser.add_argument("--my-engine", help="the saved pieces' folder (default: $MINIFER_MY_ENGINE, or "
                                            "exercises/my_engine, where the notebooks save them)")
    parser.add_argument("--keep-notebook", action="store_true", help="remove the saved pieces only")
    parser.add_argument("--keep-pieces", action="store_true", help="restore the notebook only")
    args = parser.parse_args(argv)
    root = course_root(args.root)
    exercise = exercise_name(args.exercise, root)
    my_engine = Path(args.my_engine or os.environ.get("MINIFER_MY_ENGINE") or root / "exercises" / "my_engine")
    if not args.keep_pieces:
        removed = remove_pieces(exercise, my_engine)
        print(f"{my_engine}: removed {', '.join(p.name for p in removed)}" if removed else
              f"{my_engine}: no saved piece of {exercise}")
    if not args.keep_notebook:
        print(restore_notebook(root, exercise))
    return 0


if __name__ == "__main__":
    sys.exit(main())
