"""Graders for the course exercises, shared by the exercise notebooks and the test suite.

Each ``check_<piece>(fn)`` runs a learner's function and minifer's own implementation on the same
inputs (random tensors from a fixed seed, odd shapes, edge cases) and compares them. It prints one line
per check and a summary such as ``rms_norm: 6/6 checks passed``, and raises ``AssertionError`` at the
first failure, saying which check failed, where, by how much, and a hint. The printed report never
contains numbers that vary from run to run or machine to machine, so nbval can compare it (the check
cells of the notebooks carry the cell tag ``nbval-check-output``).

Because a grader only receives a function, the same checks grade the notebook's solution, the learner's
attempt, the reference in ``minifer`` (the tests check that it passes) and deliberately wrong versions
(the tests check that they fail).

Adding a grader for a new exercise:

* write ``check_<piece>(fn)`` that builds a list of ``(label, thunk)`` pairs and passes it to
  :func:`run_checks`; each thunk calls ``fn`` on fixed inputs and compares with :func:`assert_close` (or
  plain ``assert`` with a message). Labels must be deterministic text: no timings, addresses or measured
  values;
* draw inputs from a local ``torch.Generator`` (see :func:`seeded`), never the global RNG, so a check is
  reproducible and leaves the learner's random state alone;
* a check that cannot run on some machines (it needs Triton) raises :class:`Blocked` with the reason there
  (:func:`blocked_by`): reported ``blocked``, counted apart, never failed;
* keep it quick (well under a second on CPU) and make it fail on the likely mistakes, with a test of
  each in ``tests/course/test_exercises.py``.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

Check = tuple[str, Callable[[], None]]


# --- the machinery ----------------------------------------------------------------------------------


class Blocked(Exception):
    """Raised by a check that cannot run on this machine (Triton is not installed): the check is reported
    ``blocked`` with this reason, neither passed nor failed."""


def blocked_by(reason: str) -> Callable[[], None]:
    """A check that is blocked for ``reason``."""
    def check() -> None:
        raise Blocked(reason)
    return check


_nesting = [0]  # above 0 while a check runs: a grader run inside another's check passes "blocked" up to it


@contextlib.contextmanager
def nested() -> Iterator[None]:
    """Within this block a ``run_checks`` that has blocked checks raises ``Blocked`` after its report, so that the
    check that ran it (``grade_quietly`` inside a check in the engine) is blocked too, not passed."""
    _nesting[0] += 1
    try:
        yield
    finally:
        _nesting[0] -= 1


def run_checks(name: str, checks: Sequence[Check]) -> None:
    """Run ``checks`` in order and print a report (``ok``/``FAIL``/``blocked`` per check, then a summary); raise an
    ``AssertionError`` at the first failure.

    A ``NotImplementedError`` (the untouched exercise stub) becomes an ``AssertionError`` that says so. An
    ``AssertionError`` raised by a grader module is a failed expectation, reported with its message; any
    other exception, and an ``AssertionError`` raised elsewhere (an ``assert`` in the learner's own code), is
    reported as "your function raised ..." with the check that triggered it and chained, so its traceback
    still points into the learner's function.

    A check that raises ``Blocked`` cannot run here (no Triton): it is reported ``blocked`` with the reason and
    counted apart in the summary, and the checks after it still run; one of those that then fails may need what
    was blocked, so it is blocked too, not failed. Blocked is not failed: nothing is raised (but ``Blocked``, when
    this report runs inside another's check).
    """
    total = len(checks)
    report = [name]
    reasons: list[str] = []

    def fail(label: str) -> None:
        report.append(f"  FAIL  {label}")
        emit(report)

    for i, (label, check) in enumerate(checks, start=1):
        try:
            with nested():
                check()
        except Blocked as why:
            reasons.append(str(why))
            report.append(f"  blocked  {label}: {why}")
            continue
        except Exception as exc:
            if reasons and not isinstance(exc, NotImplementedError):
                report.append(f"  blocked  {label}: it needs what is blocked above ({type(exc).__name__})")
                continue
            fail(label)
            if isinstance(exc, NotImplementedError):
                raise AssertionError(
                    f"{name}: not implemented yet. Replace the `raise NotImplementedError(...)` in the cell that "
                    f"defines it with your code, run that cell, then run this check again.") from None
            if isinstance(exc, AssertionError) and not raised_by_learner(exc):
                raise AssertionError(f"{name}: check {i}/{total} failed ({label}):\n{exc}") from None
            # the learner's code crashed (or failed its own assert): say where, keep its traceback
            raise AssertionError(f"{name}: check {i}/{total} ({label}): {learner_error(exc)}") from exc
        report.append(f"  ok    {label}")
    summarise(name, total, report, reasons)


def summarise(name: str, total: int, report: list[str], reasons: list[str]) -> None:
    """Print the report's summary line; with blocked checks, raise ``Blocked`` to a check that ran this one."""
    if not reasons:
        report.append(f"{name}: {total}/{total} checks passed")
        emit(report)
        return
    n_blocked = sum(line.startswith("  blocked") for line in report)
    why = "; ".join(dict.fromkeys(reasons))
    report.append(f"{name}: {total - n_blocked}/{total} checks passed, {n_blocked} blocked ({why}): not failed, "
                  f"not checked on this machine")
    emit(report)
    if _nesting[0]:
        raise Blocked(why)


_GRADER_DIR = os.path.dirname(os.path.abspath(__file__))


def raised_by_learner(exc: BaseException) -> bool:
    """Whether ``exc`` was raised outside the grader modules (``minifer_course/grading/``): by the learner's code,
    or by a library it called. A grader's own failed expectation is raised inside a grader module."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = os.path.abspath(tb.tb_frame.f_code.co_filename)
    return os.path.dirname(path) != _GRADER_DIR


def learner_error(exc: BaseException) -> str:
    """``your function raised KeyError: 0``: an exception from inside the learner's function, in words."""
    text = str(exc)
    return f"your function raised {type(exc).__name__}" + (f": {text}" if text else "")


def or_minifer(yours: Callable[..., Any], minifers: Callable[..., Any]) -> Callable[..., Any]:
    """The learner's function once it runs, minifer's while it is still the stub: a notebook cell that uses a piece
    (to show a measurement, not to grade it) then runs before the exercise is done, as every non-check cell must."""
    def call(*args: Any) -> Any:
        try:
            return yours(*args)
        except NotImplementedError:
            return minifers(*args)
    return call


def emit(lines: list[str]) -> None:
    """Print the report in one write, so a notebook stores it as one output whatever the timing."""
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def fmt_index(flat: int, shape: torch.Size) -> str:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return "(" + ", ".join(str(i) for i in reversed(idx)) + ")"


def assert_close(got: Any, want: torch.Tensor, *, atol: float, rtol: float, what: str = "output",
                 hint: str = "") -> None:
    """Assert ``got`` is a tensor of ``want``'s shape and dtype whose values match within tolerance.

    Infinities and NaNs must sit at the same places as in ``want``. The message names the first bad
    element, the expected and the actual value, and the largest error.
    """
    tail = f"\nhint: {hint}" if hint else ""
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a torch.Tensor, got {type(got).__name__}{tail}")
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)}, expected {list(want.shape)}{tail}")
    if got.dtype != want.dtype:
        raise AssertionError(f"{what}: dtype {got.dtype}, expected {want.dtype}{tail}")
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    same_special = (g.isnan() == w.isnan()) & (g.isposinf() == w.isposinf()) & (g.isneginf() == w.isneginf())
    finite = w.isfinite() & g.isfinite()
    close = torch.zeros_like(same_special)
    close[finite] = (g[finite] - w[finite]).abs() <= atol + rtol * w[finite].abs()
    bad = ~(same_special & (close | ~finite))
    if bool(bad.any()):
        first = int(bad.flatten().nonzero()[0])
        gv, wv = float(g.flatten()[first]), float(w.flatten()[first])
        err = (g[finite] - w[finite]).abs()
        worst = f"; largest error {float(err.max()):.3g}" if err.numel() else ""
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} values differ; first at index "
            f"{fmt_index(first, want.shape)}: got {gv:.6g}, expected {wv:.6g}{worst} "
            f"(tolerance atol={atol:g}, rtol={rtol:g}){tail}")


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def call_unmodified(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn`` and assert it left its tensor arguments unchanged (in-place ops are a classic bug)."""
    before = [a.clone() if isinstance(a, torch.Tensor) else None for a in args]
    out = fn(*args)
    for i, (a, b) in enumerate(zip(args, before)):
        if b is None:
            continue
        if not (torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())):
            raise AssertionError(f"your function modified its argument #{i + 1} in place; compute a new tensor "
                                 "instead (avoid in-place ops such as `x.mul_(...)`, `x[...] = ...`, `x *= ...`)")
    return out


def as_int_list(got: Any, what: str) -> list[int]:
    """``got`` (a list, tuple or tensor of whole numbers) as a list of ints; a fraction is an error, not
    truncated."""
    if isinstance(got, torch.Tensor):
        got = got.tolist()
    if not isinstance(got, (list, tuple)):
        raise AssertionError(f"{what}: expected a list of ints, got {type(got).__name__}")
    out = []
    for v in got:
        try:
            i = int(v)
        except (TypeError, ValueError, OverflowError):
            raise AssertionError(f"{what}: expected a list of ints, got {got!r:.200}") from None
        if isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral) and v != i:
            raise AssertionError(f"{what}: {v!r} is not a whole number (in {got!r:.200})\nhint: return ints; "
                                 f"use // rather than / for integer division")
        out.append(i)
    return out
