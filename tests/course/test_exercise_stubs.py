"""Untouched exercises fail only in their check cells: every stub says it is not implemented yet, and nothing else
in the notebook errors. (A file of its own so that CI's two workers each execute one set of notebooks: the solutions
run in ``test_exercises.py``.)"""

from __future__ import annotations

import pytest

from test_exercises import EXERCISE_IDS, EXERCISES, _errors, _execute, bx, my_engine  # noqa: F401  (a fixture)


@pytest.mark.slow
@pytest.mark.parametrize("ex", EXERCISES, ids=EXERCISE_IDS)
def test_untouched_exercises_fail_their_checks(ex, my_engine):
    nb = _execute(ex.exercise_path, allow_errors=True)
    checks = [c for c in nb.cells if bx.is_check_cell(c)]
    assert checks
    for cell in checks:
        errors = _errors(cell)
        assert errors, f"this check passed on the untouched exercise, so it grades nothing:\n{cell.source}"
        assert errors[0]["ename"] == "AssertionError", (errors[0]["ename"], errors[0]["evalue"])
        assert "not implemented yet" in errors[0]["evalue"]
    for cell in nb.cells:
        if cell.cell_type == "code" and not bx.is_check_cell(cell):
            assert not _errors(cell), f"only check cells may fail in an untouched exercise:\n{cell.source}"
