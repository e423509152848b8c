"""Graders for the course exercises, shared by the exercise notebooks and the test suite.

Each ``check_<piece>(fn)`` runs a learner's function and minifer's own implementation on the same
inputs (random tensors from a fixed seed, odd shapes, edge cases) and compares them. It prints one line
per check and a summary such as ``rms_norm: 6/6 checks passed``, and raises ``AssertionError`` at the
first failure, saying which check failed, where, by how much, and a hint. The printed report never
contains numbers that vary from run to run or machine to machine, so nbval can compare it (the check
cells of the notebooks start with ``# NBVAL_CHECK_OUTPUT``).

Because a grader only receives a function, the same checks grade the notebook's solution, the learner's
attempt, the reference in ``minifer`` (the tests check that it passes) and deliberately wrong versions
(the tests check that they fail).

Adding a grader for a new exercise:

* write ``check_<piece>(fn)`` that builds a list of ``(label, thunk)`` pairs and passes it to
  :func:`run_checks`; each thunk calls ``fn`` on fixed inputs and compares with :func:`assert_close` (or
  plain ``assert`` with a message). Labels must be deterministic text: no timings, addresses or measured
  values;
* draw inputs from a local ``torch.Generator`` (see :func:`_gen`), never the global RNG, so a check is
  reproducible and leaves the learner's random state alone;
* keep it quick (well under a second on CPU) and make it fail on the likely mistakes, with a test of
  each in ``tests/test_exercises.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["run_checks", "assert_close", "check_rms_norm", "check_rope_inv_freq", "check_apply_rotary",
           "check_top_p"]

Check = tuple[str, Callable[[], None]]


# --- the machinery ----------------------------------------------------------------------------------


def run_checks(name: str, checks: Sequence[Check]) -> None:
    """Run ``checks`` in order and print a report (``ok``/``FAIL`` per check, then a summary); raise an
    ``AssertionError`` at the first failure.

    A ``NotImplementedError`` (the untouched exercise stub) becomes an ``AssertionError`` that says so;
    any other exception from the learner's code is reported with the check that triggered it and chained,
    so its traceback still points into the learner's function.
    """
    total = len(checks)
    report = [name]

    def fail(label: str) -> None:
        report.append(f"  FAIL  {label}")
        _emit(report)

    for i, (label, check) in enumerate(checks, start=1):
        try:
            check()
        except NotImplementedError:
            fail(label)
            raise AssertionError(
                f"{name}: not implemented yet. Replace the `raise NotImplementedError(...)` in the cell that "
                f"defines it with your code, run that cell, then run this check again.") from None
        except AssertionError as exc:
            fail(label)
            raise AssertionError(f"{name}: check {i}/{total} failed ({label}):\n{exc}") from None
        except Exception as exc:  # the learner's code crashed: say where, keep its traceback
            fail(label)
            raise AssertionError(
                f"{name}: check {i}/{total} ({label}): your function raised {type(exc).__name__}: {exc}") from exc
        report.append(f"  ok    {label}")
    report.append(f"{name}: {total}/{total} checks passed")
    _emit(report)


def _emit(lines: list[str]) -> None:
    """Print the report in one write, so a notebook stores it as one output whatever the timing."""
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _fmt_index(flat: int, shape: torch.Size) -> str:
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
            f"{_fmt_index(first, want.shape)}: got {gv:.6g}, expected {wv:.6g}{worst} "
            f"(tolerance atol={atol:g}, rtol={rtol:g}){tail}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _call_unmodified(fn: Callable[..., Any], *args: Any) -> Any:
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


# --- chapter 00/01: RMSNorm ---------------------------------------------------------------------------


def check_rms_norm(fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> None:
    """Grade ``fn(x, weight, eps)`` against :func:`minifer.layers.norm.rms_norm`."""
    from minifer.layers.norm import rms_norm as ref

    gen = _gen(0)
    hint = "rms_norm(x) = x / sqrt(mean(x**2 over the last dim) + eps) * weight"

    def case(x: torch.Tensor, weight: torch.Tensor, eps: float, atol: float = 1e-5, rtol: float = 1e-5,
             extra_hint: str = "") -> Check:
        def run() -> None:
            got = _call_unmodified(fn, x, weight, eps)
            assert_close(got, ref(x, weight, eps), atol=atol, rtol=rtol, hint=extra_hint or hint)
        return run

    tiny = _randn(gen, 3, 16, scale=1e-3)
    zero_row = _randn(gen, 3, 32)
    zero_row[1] = 0.0
    checks: list[Check] = [
        ("float32 [4, 64], random weight", case(_randn(gen, 4, 64), _randn(gen, 64), 1e-6)),
        ("3-D [2, 3, 48]: normalise the last dim only", case(_randn(gen, 2, 3, 48, scale=3.0), _randn(gen, 48), 1e-5,
                                                            extra_hint="reduce over dim=-1 with keepdim=True so "
                                                                       "it broadcasts back over x")),
        ("odd width [5, 7]", case(_randn(gen, 5, 7), _randn(gen, 7), 1e-6)),
        ("tiny inputs, eps=1e-2: eps goes inside the square root",
         case(tiny, torch.ones(16), 1e-2, extra_hint="add eps to the mean of squares, before the square root")),
        ("an all-zero row gives zeros, not NaN",
         case(zero_row, _randn(gen, 32), 1e-6, extra_hint="without eps, 0 / sqrt(0) is NaN")),
        ("bfloat16 [4, 256] in, bfloat16 out",
         case(_randn(gen, 4, 256, scale=4.0).bfloat16(), _randn(gen, 256).bfloat16(), 1e-6, atol=2e-2, rtol=2e-2,
              extra_hint="compute in float32 (x.float()), cast back with .to(x.dtype), then multiply by weight")),
    ]
    run_checks("rms_norm", checks)


# --- chapter 00/01: RoPE ------------------------------------------------------------------------------


def check_rope_inv_freq(fn: Callable[[int, float], torch.Tensor]) -> None:
    """Grade ``fn(head_dim, theta)`` against :func:`minifer.layers.rotary.rope_inv_freq` (no scaling)."""
    from minifer.layers.rotary import rope_inv_freq as ref

    hint = ("one frequency per pair: theta ** (-2i / head_dim) for i = 0 .. head_dim/2 - 1, "
            "as a float32 tensor of shape [head_dim // 2]")

    def case(head_dim: int, theta: float) -> Check:
        def run() -> None:
            assert_close(fn(head_dim, theta), ref(head_dim, theta), atol=0.0, rtol=1e-5, hint=hint)
        return run

    checks: list[Check] = [
        ("head_dim 64, theta 10000 (Llama 2)", case(64, 10000)),
        ("head_dim 128, theta 500000 (Llama 3)", case(128, 500000.0)),
        ("head_dim 128, theta 1e6 (Qwen2/Qwen3)", case(128, 1e6)),
        ("head_dim 2: a single pair turning 1 radian per token", case(2, 10000.0)),
    ]
    run_checks("rope_inv_freq", checks)


def _cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor]:
    from minifer.layers.rotary import rope_inv_freq

    freqs = torch.outer(positions.float(), rope_inv_freq(head_dim, theta))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def check_apply_rotary(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Grade ``fn(x, cos, sin)`` (x ``[tokens, heads, head_dim]``, cos/sin ``[tokens, head_dim]``) against
    :func:`minifer.layers.rotary.apply_rotary`."""
    from minifer.layers.rotary import apply_rotary as ref

    gen = _gen(1)
    hint = ("rotate-half layout: feature i pairs with feature i + head_dim/2; "
            "out = x * cos + cat(-x2, x1) * sin, with cos/sin broadcast over heads as cos[:, None, :]")

    def versus_ref(tokens: int, heads: int, head_dim: int, positions: list[int], theta: float = 10000.0,
                   dtype: torch.dtype = torch.float32, tol: float = 1e-5) -> Check:
        x = _randn(gen, tokens, heads, head_dim).to(dtype)
        cos, sin = _cos_sin(torch.tensor(positions), head_dim, theta, dtype)

        def run() -> None:
            got = _call_unmodified(fn, x, cos, sin)
            assert_close(got, ref(x, cos, sin), atol=tol, rtol=tol, hint=hint)
        return run

    def position_zero_is_identity() -> None:
        x = _randn(gen, 3, 2, 16)
        cos, sin = _cos_sin(torch.zeros(3, dtype=torch.long), 16, 10000.0)
        assert_close(fn(x, cos, sin), x, atol=1e-6, rtol=1e-6, what="rotation at position 0",
                     hint="at position 0 every angle is 0 (cos = 1, sin = 0), so x must come back unchanged")

    def relative_positions() -> None:
        head_dim = 32
        q, k = _randn(gen, 1, 1, head_dim), _randn(gen, 1, 1, head_dim)
        pairs = [(5, 2), (8, 5), (53, 50), (103, 100)]  # the same distance m - n = 3 everywhere
        scores = []
        for m, n in pairs:
            cq, sq = _cos_sin(torch.tensor([m]), head_dim, 10000.0)
            ck, sk = _cos_sin(torch.tensor([n]), head_dim, 10000.0)
            scores.append((fn(q, cq, sq) * fn(k, ck, sk)).sum())
        got = torch.stack(scores)
        assert_close(got, scores[0].expand(len(pairs)).clone(), atol=1e-3, rtol=1e-4,
                     what="q·k at positions (5,2), (8,5), (53,50), (103,100)",
                     hint="rotating q by m·θ and k by n·θ must leave q·k depending on m - n only: "
                          "rotate each pair (x[i], x[i + head_dim/2]) by the same angle")

    checks: list[Check] = [
        ("float32, 5 tokens x 4 heads x 64, positions 0..4", versus_ref(5, 4, 64, [0, 1, 2, 3, 4])),
        ("decode positions [17, 300, 4095], 2 heads x 128, theta 5e5",
         versus_ref(3, 2, 128, [17, 300, 4095], theta=5e5, tol=1e-4)),
        ("head_dim 2: a single pair", versus_ref(4, 3, 2, [0, 1, 7, 9])),
        ("position 0 leaves x unchanged", position_zero_is_identity),
        ("q·k depends only on the distance m - n", relative_positions),
        ("bfloat16 in, bfloat16 out", versus_ref(6, 2, 64, [0, 5, 6, 7, 50, 51], dtype=torch.bfloat16, tol=2e-2)),
    ]
    run_checks("apply_rotary", checks)


# --- chapter 00/01: top-p (nucleus) sampling ------------------------------------------------------------


def _nucleus_p(logits_row: torch.Tensor, target: float, min_margin: float = 1e-4) -> float:
    """A ``top_p`` near ``target`` whose nucleus boundary is unambiguous: half-way between two consecutive
    cumulative probabilities, so float rounding (ascending vs descending sums) cannot change the answer."""
    probs = logits_row.double().softmax(-1).sort(descending=True).values
    cum = probs.cumsum(-1)
    k = int((cum < target).sum())  # the token that crosses target
    k = min(k, len(probs) - 1)
    while k > 0 and float(probs[k]) < 2 * min_margin:
        k -= 1
    return float(cum[k] - probs[k] / 2)


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


def check_top_p(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """Grade ``fn(logits [B, V], top_p [B])`` against :func:`minifer.sampling.apply_top_p`: dropped tokens
    must be ``-inf``, kept tokens must keep their logit, the nucleus must be exactly the reference's."""
    from minifer.sampling import apply_top_p as ref

    gen = _gen(2)

    def case(logits: torch.Tensor, top_p: list[float]) -> Check:
        p = torch.tensor(top_p, dtype=torch.float32)

        def run() -> None:
            got = _call_unmodified(fn, logits, p)
            want = ref(logits, p)
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                assert_close(got, want, atol=0, rtol=0, hint="return the logits themselves (same shape and "
                                                             "dtype) with dropped tokens set to -inf, not a mask")
            got_kept, want_kept = got > float("-inf"), want > float("-inf")
            for row in range(want.shape[0]):
                if torch.equal(got_kept[row], want_kept[row]):
                    continue
                probs = logits[row].softmax(-1)
                n_got, n_want = int(got_kept[row].sum()), int(want_kept[row].sum())
                top = ", ".join(f"{v:.3f}" for v in probs.sort(descending=True).values[: min(n_want + 1, 6)].tolist())
                if n_got == 0:
                    why = "you kept no token at all: always keep the most likely one, however small p is"
                elif n_got < n_want:
                    why = ("you dropped a token of the nucleus: keep every token until the kept probability "
                           "reaches p, including the one that crosses p (and always the most likely one)")
                elif n_got > n_want:
                    why = "you kept a token outside the nucleus: stop as soon as the kept probability reaches p"
                else:
                    why = "the right number of tokens, but not the right ones: map the sorted order back " \
                          "to vocabulary positions (e.g. with scatter)"
                raise AssertionError(
                    f"row {row} (top_p={top_p[row]:.4g}): you kept {_tokens(n_got)}, expected {n_want}; the largest "
                    f"probabilities are [{top}, ...]\nhint: {why}")
            assert_close(got, want, atol=0, rtol=0, what="kept logits",
                         hint="kept tokens must keep their original logit (no softmax, no renormalising)")
        return run

    hand = torch.tensor([[0.2, 0.05, 0.5, 0.25]] * 2).log()  # sorted: 0.5, 0.25, 0.2, 0.05
    rows = _randn(gen, 4, 50, scale=2.0)
    with_inf = _randn(gen, 2, 20, scale=2.0)
    with_inf[:, 1::3] = float("-inf")  # as left by top-k
    big = _randn(gen, 2, 4096, scale=3.0)
    peaked = _randn(gen, 4, 30)
    peaked[1, 7] = 10.0  # one token holds ~99.9% of the mass
    peaked[3, 12] = 4.0
    checks: list[Check] = [
        ("4 rows x 50 tokens, a different top_p per row",
         case(rows, [_nucleus_p(rows[i], t) for i, t in enumerate([0.5, 0.9, 0.95, 0.3])])),
        ("the token that crosses p is kept: probs (.5, .25, .2, .05), p = 0.7 and 0.8", case(hand, [0.7, 0.8])),
        ("top_p = 1 keeps every token", case(_randn(gen, 3, 10), [1.0, 1.0, 1.0])),
        ("a tiny top_p keeps only the most likely token", case(peaked, [1e-8, 0.5, 1e-4, 1e-8])),
        ("logits already -inf (after top-k) stay -inf",
         case(with_inf, [_nucleus_p(with_inf[0], 0.8), 1.0])),
        ("2 rows x 4096 tokens, p near 0.9 and 0.95",
         case(big, [_nucleus_p(big[0], 0.9), _nucleus_p(big[1], 0.95)])),
    ]
    run_checks("top_p", checks)

