"""Exercises that survive a learner: a saved piece carries what it uses from its notebook and is proven to run on its
own before it is kept (``workbench.save``, ``workbench_save``); the capstone says why a piece of yours did not run;
a saved piece names the version it was written for; ``python -m minifer_course.reset`` starts an exercise again;
graders tell "blocked" (no Triton) from "failed" (``grading.base.run_checks``).

The notebooks are stood in for by namespaces whose cells are registered in ``linecache``, as IPython registers
them, so that their source can be saved.
"""

from __future__ import annotations

import linecache
import subprocess
import sys
from pathlib import Path

import pytest

from minifer_course import reset, workbench, workbench_save
from minifer_course.grading import engine as graded
from minifer_course.grading.base import Blocked, blocked_by, run_checks


@pytest.fixture(autouse=True)
def my_engine(tmp_path, monkeypatch):
    monkeypatch.setenv(workbench.FOLDER_ENV, str(tmp_path / "my_engine"))
    monkeypatch.delenv(workbench_save.CHECK_ENV, raising=False)
    return tmp_path / "my_engine"


def notebook(*cells: str) -> dict:
    """A notebook's namespace after running ``cells`` (``__main__``, as a kernel's)."""
    scope: dict = {"__name__": "__main__"}
    for cell in cells:
        name = f"<test cell {len(linecache.cache)}>"
        linecache.cache[name] = (len(cell), None, cell.splitlines(True), name)
        exec(compile(cell, name, "exec", dont_inherit=True), scope)
    return scope


HELPERS = '''
import torch
from torch import cat as concat

HALF = 2


def rotate_half(x):
    half = x.shape[-1] // HALF
    return concat((-x[..., half:], x[..., :half]), dim=-1)
'''

ROTARY = '''
def apply_rotary(x, cos, sin):
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over the heads
    return x * cos + rotate_half(x) * sin
'''


def test_a_piece_saved_with_its_helper_runs_and_passes_from_its_file_alone(my_engine, capsys):
    """Exercise 00's formula names rotate_half: written as a helper beside apply_rotary, it is saved with it (and the
    constant and the import the helper uses), then graded from the file in a fresh process and by the capstone."""
    nb = notebook(HELPERS, ROTARY)
    workbench.save(nb["apply_rotary"], grade=True)
    text = (my_engine / "apply_rotary.py").read_text()
    assert "def rotate_half" in text and "HALF = 2" in text and "from torch import cat as concat" in text
    assert text.index("def rotate_half") < text.index("def apply_rotary")
    loaded = workbench.load_saved()
    assert loaded["apply_rotary"] is not nb["apply_rotary"]
    graded.GRADERS["apply_rotary"](loaded["apply_rotary"])
    assert "checks passed" in capsys.readouterr().out
    pieces, origin = graded.sort_saved(loaded, {}, {"apply_rotary": workbench.PIECES["apply_rotary"]}, solution=False)
    assert origin == {"apply_rotary": "yours"}


def test_the_saved_file_runs_in_a_process_that_never_saw_the_notebook(my_engine):
    workbench.save(notebook(HELPERS, ROTARY)["apply_rotary"])
    code = ("import torch; from minifer_course import workbench; f = workbench.load_saved()['apply_rotary']; "
            "x = torch.randn(3, 2, 8); print(f(x, torch.ones(3, 8), torch.zeros(3, 8)).equal(x))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_a_piece_that_reads_a_name_defined_nowhere_is_refused_with_the_name(my_engine):
    nb = notebook("def apply_rotary(x, cos, sin):\n    return x * cos + rotate_halff(x) * sin\n")
    with pytest.raises(workbench.PieceRefused, match="NameError: name 'rotate_halff' is not defined.*not defined in "
                                                     "this notebook either"):
        workbench.save(nb["apply_rotary"])
    assert not (my_engine / "apply_rotary.py").exists()  # refused, not saved broken


def test_a_piece_that_reads_an_object_of_the_notebook_is_refused_and_its_check_says_so(my_engine, capsys):
    """It passes in the notebook, where the list lives; its file would not have it."""
    nb = notebook("SCALE = [1.0]\n\n"
                  "def rms_norm(x, weight, eps):\n"
                  "    x32 = x.float()\n"
                  "    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * SCALE[0]\n"
                  "    return weight * y.to(x.dtype)\n", "import torch\n")
    with pytest.raises(AssertionError, match="(?s)runs in this notebook only.*name 'SCALE' is not defined: SCALE is "
                                             "a list built in the notebook"):
        graded.check_in_engine("rms_norm", nb["rms_norm"])
    assert "the engine serves" not in capsys.readouterr().out


def test_a_stub_is_still_saved_and_a_piece_saved_before_stays_when_a_new_one_is_refused(my_engine):
    stub = notebook("def apply_rotary(x, cos, sin):\n    raise NotImplementedError('fill in')\n")["apply_rotary"]
    workbench.save(stub)
    broken = notebook("def apply_rotary(x, cos, sin):\n    return missing(x)\n")["apply_rotary"]
    with pytest.raises(workbench.PieceRefused, match="keeps what was saved before"):
        workbench.save(broken)
    assert "NotImplementedError" in (my_engine / "apply_rotary.py").read_text()


def test_a_saved_piece_names_its_version_and_an_outdated_one_shows_it(my_engine):
    from minifer import __version__

    workbench.save(notebook(HELPERS, ROTARY)["apply_rotary"])
    first = (my_engine / "apply_rotary.py").read_text().splitlines()[0]
    assert first.endswith(f"for minifer {__version__}; the notebook's cell is the original.")
    assert workbench.saved_for(my_engine / "apply_rotary.py") == f"minifer {__version__}"
    (my_engine / "decoder_layer.py").write_text(
        "# decoder_layer: saved by minifer_course.workbench.save for minifer 0.0.9; the notebook's cell is the "
        "original.\ndef decoder_layer(layer, x, cos, sin, attn, ops):\n    return x\n")
    errors: dict[str, str] = {}
    workbench.load_saved(errors=errors)
    assert f"saved for minifer 0.0.9; this is minifer {__version__}" in errors["decoder_layer"]
    assert "exercises/00_building_blocks.ipynb" in errors["decoder_layer"]


def test_the_capstone_says_why_a_piece_of_yours_did_not_run(my_engine, capsys):
    wrong = notebook("import torch\n\ndef apply_rotary(x, cos, sin):\n    return x * cos + x * sin\n")
    workbench.save(wrong["apply_rotary"])
    reasons: dict[str, str] = {}
    _, origin = graded.load_pieces(solution=True, reasons=reasons)
    assert origin["apply_rotary"] == "minifer's (yours fails its checks)"
    assert set(reasons) == {"apply_rotary"} and "apply_rotary: check 1/6" in reasons["apply_rotary"]  # the grader's
    graded._last_origin.clear()
    graded._last_origin.update(origin)
    graded._last_reasons.clear()
    graded._last_reasons.update(reasons)
    graded.print_origins()
    out = capsys.readouterr().out
    assert "\n      apply_rotary: check 1/6" in out.split("apply_rotary", 1)[1]  # under its row, indented


# --- resetting an exercise ---------------------------------------------------------------------------------


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


@pytest.fixture
def course(tmp_path) -> Path:
    """A clone with two exercise notebooks, one of them since changed, and pieces saved by both."""
    root = tmp_path / "clone"
    (root / "exercises" / "my_engine").mkdir(parents=True)
    for stem in ("00_building_blocks", "03_continuous_batching"):
        (root / "exercises" / f"{stem}.ipynb").write_text(f'{{"cells": [], "name": "{stem}"}}\n')
    _git(root, "init", "-q")
    _git(root, "add", "exercises")
    _git(root, "commit", "-q", "-m", "exercises")
    (root / "exercises" / "03_continuous_batching.ipynb").write_text("a learner's broken notebook")
    for name in ("schedule_step", "preempt", "engine_step", "rms_norm"):
        (root / "exercises" / "my_engine" / f"{name}.py").write_text("")
    return root


def test_reset_restores_the_notebook_and_removes_only_its_pieces(course, capsys, monkeypatch):
    monkeypatch.delenv(workbench.FOLDER_ENV)
    assert reset.main(["03", "--root", str(course)]) == 0
    nb = course / "exercises" / "03_continuous_batching.ipynb"
    assert '"name": "03_continuous_batching"' in nb.read_text()
    assert nb.with_name(nb.name + ".bak").read_text() == "a learner's broken notebook"
    assert sorted(p.name for p in (course / "exercises" / "my_engine").iterdir()) == ["rms_norm.py"]
    out = capsys.readouterr().out
    assert "removed schedule_step.py, preempt.py, engine_step.py" in out and "restored from the repository" in out
    assert reset.main(["03_continuous_batching", "--root", str(course)]) == 0
    assert "already as the repository has it" in capsys.readouterr().out


def test_reset_outside_a_clone_says_where_to_get_the_notebook(tmp_path, monkeypatch):
    (tmp_path / "exercises" / "my_engine").mkdir(parents=True)
    (tmp_path / "exercises" / "03_continuous_batching.ipynb").write_text("{}")
    (tmp_path / "exercises" / "my_engine" / "preempt.py").write_text("")
    monkeypatch.delenv(workbench.FOLDER_ENV)
    if subprocess.run(["git", "-C", str(tmp_path), "rev-parse"], capture_output=True).returncode == 0:
        pytest.skip("the temporary folder is inside a git work tree")
    with pytest.raises(SystemExit, match="not in a git clone.*download exercises/03_continuous_batching.ipynb"):
        reset.main(["03", "--root", str(tmp_path)])
    assert not (tmp_path / "exercises" / "my_engine" / "preempt.py").exists()  # the pieces went all the same


def test_reset_names_the_exercises_when_one_is_not_found(course):
    with pytest.raises(SystemExit, match="no single exercise named '09'.*00_building_blocks, 03_continuous_batching"):
        reset.main(["09", "--root", str(course)])


# --- blocked is not failed ---------------------------------------------------------------------------------


def _ok() -> None:
    pass


def _fails() -> None:
    raise AssertionError("wrong")


def test_a_blocked_check_is_reported_and_counted_apart_without_failing(capsys):
    run_checks("kernel", [("first", _ok), ("launches", blocked_by("Triton is not installed")), ("last", _ok)])
    out = capsys.readouterr().out.splitlines()
    assert out == ["kernel", "  ok    first", "  blocked  launches: Triton is not installed", "  ok    last",
                   "kernel: 2/3 checks passed, 1 blocked (Triton is not installed): not failed, not checked on this "
                   "machine"]


def test_a_failure_is_still_a_failure_and_a_passing_report_is_unchanged(capsys):
    run_checks("piece", [("a", _ok), ("b", _ok)])
    assert capsys.readouterr().out == "piece\n  ok    a\n  ok    b\npiece: 2/2 checks passed\n"
    with pytest.raises(AssertionError, match=r"piece: check 2/2 \(b\): your function raised AssertionError: wrong"):
        run_checks("piece", [("a", _ok), ("b", _fails)])


def test_a_check_that_fails_after_a_blocked_one_is_blocked_and_a_nested_block_passes_up(capsys):
    run_checks("engine", [("kernel", blocked_by("no Triton")), ("serves", _fails)])
    assert "  blocked  serves: it needs what is blocked above (AssertionError)" in capsys.readouterr().out

    def inner() -> None:  # a grader run inside a check (grade_quietly inside the engine's check)
        run_checks("kernel", [("launches", blocked_by("no Triton"))])

    run_checks("engine", [("your kernel passes its checks", inner), ("its tokens", _ok)])
    out = capsys.readouterr().out
    assert "  blocked  your kernel passes its checks: no Triton" in out
    assert out.rstrip().endswith("engine: 1/2 checks passed, 1 blocked (no Triton): not failed, not checked on this "
                                 "machine")
    with pytest.raises(AssertionError, match="not implemented yet"):  # a stub is never excused
        run_checks("engine", [("kernel", blocked_by("no Triton")), ("stub", _stub)])


def _stub() -> None:
    raise NotImplementedError


def test_the_kernel_grader_without_triton_is_blocked_not_failed(monkeypatch, capsys):
    import minifer.kernels
    from minifer_course.grading import quant

    monkeypatch.setattr(minifer.kernels, "HAS_TRITON", False)
    monkeypatch.setattr(minifer.kernels, "TRITON_ERROR", "Triton is not installed (test)")
    triton, _, _ = quant.triton_modules()  # the stand-ins: a kernel defines, its launch is blocked
    kernel = triton.jit(lambda *a: None)
    quant.check_int4_matmul_kernel(kernel)
    assert "  blocked  M = 1 (decode), N = 24 (not a multiple of BLOCK_N), K = 64, group 32, symmetric: Triton is " \
           "not installed (test)" in capsys.readouterr().out
    with pytest.raises(Blocked, match="Triton is not installed"):
        graded.grade_quietly("int4_matmul", kernel)
