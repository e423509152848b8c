"""The course on a machine without Triton: ``make test``'s no-Triton step, under ``tools/no_triton``'s shim.

    MINIFER_NO_TRITON_STEP=1 PYTHONPATH=$PWD/tools/no_triton python3 -m pytest -n 2 -p no:randomly \
        tests/no_triton/test_notebooks_without_triton.py

Every notebook that uses Triton (found by ``tools/no_triton/scan.py``, not listed by hand) runs whole, each of its
cells that acts on Triton printing why Triton did not run, and no cell failing; every other notebook runs its first
code cell (its imports and its model: the notebook starts). This proves the course on Linux without Triton, not on
macOS or Windows (other torch builds, paths, process start methods: not simulated).

The stored outputs are a Linux machine's with Triton, so they are not compared (nbval does that, with Triton, in the
step before): a check cell must run without an error, and a Triton one say ``blocked``. Without the shim these tests
skip: Triton is installed, and the chapters run under nbval with it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "no_triton"))
import scan  # noqa: E402

from minifer.kernels import triton_available  # noqa: E402

HIDDEN = not triton_available()[0] and "sitecustomize" in sys.modules \
    and Path(sys.modules["sitecustomize"].__file__).parent == ROOT / "tools" / "no_triton"
if os.environ.get("MINIFER_NO_TRITON_STEP") == "1" and not HIDDEN:  # make test's step must not pass by skipping
    raise RuntimeError("the no-Triton step runs without tools/no_triton's shim: Triton is still importable")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HIDDEN, reason="run with PYTHONPATH=$PWD/tools/no_triton "
                                                   "(make test's no-Triton step): here Triton is not hidden")]
WHOLE, FIRST = scan.plan() if HIDDEN else ([], [])
TIMEOUT_S = 600


@pytest.fixture(autouse=True)
def my_engine(tmp_path, monkeypatch):
    """The solutions save their pieces to a folder of their own, never a learner's ``my_engine/``."""
    monkeypatch.setenv("MINIFER_MY_ENGINE", str(tmp_path / "my_engine"))


def execute(nb: nbformat.NotebookNode, path: Path) -> nbformat.NotebookNode:
    """Run ``nb`` as if it were at ``path``, in a kernel that inherits this process's environment (the shim)."""
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", allow_errors=False, record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return nb


def printed(cell: nbformat.NotebookNode) -> str:
    """What a cell showed: its streams and its text results."""
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.get("outputs", []))


@pytest.mark.parametrize("found", WHOLE, ids=[nb.rel for nb in WHOLE])
def test_a_notebook_that_uses_triton_runs_whole_and_its_triton_cells_say_why_they_skip(found):
    nb = execute(nbformat.read(found.path, as_version=4), found.path)  # a cell's error raises here
    silent = [i for i in found.acting if not any(reason in printed(nb.cells[i]) for reason in scan.REASONS)]
    assert not silent, [f"cell {i} uses Triton and does not say why it skipped:\n{nb.cells[i].source}" for i in silent]
    shown = "".join(printed(c) for c in nb.cells if c.cell_type == "code")
    assert "Triton is not installed" in shown, "no cell said Triton is missing: was the shim on in the kernel?"


@pytest.mark.parametrize("path", FIRST, ids=[p.relative_to(ROOT).as_posix() for p in FIRST])
def test_every_other_notebook_runs_its_first_code_cell(path):
    nb = nbformat.read(path, as_version=4)
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.get("id") != scan.SETUP_ID)
    nb.cells = nb.cells[: first + 1]  # the hosted setup cell (run too: a learner runs it first) and its own first
    execute(nb, path)
