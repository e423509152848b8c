"""Graders for the chapter-05 exercises (quantization), on the machinery of :mod:`minifer_course.grading.base`.

* :func:`check_quantize_int4` grades ``fn(w, group_size, symmetric) -> (packed, scales, zeros)`` against
  :func:`minifer.quantization.formats.quantize_int4`: codes, scales and zero points equal minifer's, then a
  round-trip bound. A wrong answer is matched against the classic mistakes (nibbles swapped, ``absmax / 8``,
  the ``+ 8`` offset forgotten, groups along the wrong axis, a zero point outside 0..15, a range that does
  not include 0, an all-zero group divided by 0) to name the one made;
* :func:`check_int4_matmul_kernel` grades an int4 dequantize-matmul (a Triton kernel, the wrapper that launches
  one, or the same unpack-scale-dot written in PyTorch, the exercise's path where Triton is missing) against
  :func:`~minifer.quantization.formats.quant_linear_reference`: odd shapes, inputs and output placed inside larger
  NaN-filled buffers (an unmasked load reads NaN, an unmasked store is seen in the margin), the output poisoned
  with NaN before every launch. Without a GPU a kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set
  before triton is imported); where Triton is not installed (macOS, Windows) a kernel's checks are reported
  blocked, with the reason (not failed), and a PyTorch function is graded as anywhere;
* :func:`check_perplexity` grades ``fn(model_fn, token_ids, window) -> perplexity`` on a synthetic model
  (a bigram table plus position biases, so the framing of the windows matters) and on the bundled
  ``tinystories-target`` against :func:`minifer.eval.perplexity`.

Reports list pass/fail lines only: no measured errors or timings, so a notebook stores the same report on
every machine. Each grader takes a few seconds on one CPU core; ``tests/course/test_exercises_quant.py`` checks
that minifer's implementations pass and the classic mistakes fail.
"""

from __future__ import annotations

import functools
import math
import os
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from minifer_course.grading.base import (Blocked, Check, call_unmodified, fmt_index, raised_by_learner,
                                         run_checks, seeded)

__all__ = ["check_quantize_int4", "check_int4_matmul_kernel", "check_perplexity", "launch_int4_matmul",
           "triton_modules"]


# --- chapter 05: int4 group-wise quantization ------------------------------------------------------------


def _as_int4_triple(got: Any, n: int, k: int, group_size: int, symmetric: bool) -> tuple[torch.Tensor, ...]:
    """``got`` checked for structure, shapes and dtypes; returns ``(packed, scales, zeros)``."""
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        raise AssertionError(f"expected a tuple (packed, scales, zeros), got {type(got).__name__}"
                             + (f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""))
    packed, scales, zeros = got
    want_groups = (n, k // group_size)
    for name, t, dtype, shape, hint in (
            ("packed", packed, torch.uint8, (n, k // 2), "two 4-bit codes per byte: uint8 [N, K // 2]"),
            ("scales", scales, torch.float32, want_groups,
             "one float32 scale per group of group_size consecutive inputs of a row: [N, K // group_size]")):
        if not isinstance(t, torch.Tensor):
            raise AssertionError(f"{name}: expected a torch.Tensor, got {type(t).__name__}\nhint: {hint}")
        if tuple(t.shape) != shape:
            extra = ""
            if name == "scales" and tuple(t.shape) == (k // group_size, n):
                extra = "; transposed? row n of the scales holds the groups of row n of w"
            elif name == "scales" and tuple(t.shape) in {(n // group_size, k), (k, n // group_size)}:
                extra = "; your groups run along N: a group is group_size consecutive inputs along K (dim 1)"
            raise AssertionError(f"{name}: shape {list(t.shape)}, expected {list(shape)}{extra}\nhint: {hint}")
        if t.dtype != dtype:
            raise AssertionError(f"{name}: dtype {t.dtype}, expected {dtype}\nhint: {hint}")
    if symmetric:
        if zeros is not None:
            raise AssertionError("zeros: symmetric quantization stores no zero points (they are all 8): return None")
    else:
        if not isinstance(zeros, torch.Tensor):
            raise AssertionError(f"zeros: asymmetric quantization stores one zero point per group, got "
                                 f"{type(zeros).__name__}\nhint: uint8 [N, K // group_size], values in 0..15")
        if tuple(zeros.shape) != want_groups or zeros.dtype != torch.uint8:
            raise AssertionError(f"zeros: {zeros.dtype} {list(zeros.shape)}, expected torch.uint8 {list(want_groups)}")
    return packed, scales, zeros


def _nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return packed & 0xF, packed >> 4


def _where(n: int, k: int, w: torch.Tensor, group_size: int) -> str:
    return f"row {n}, column {k} (group {k // group_size}), weight {float(w[n, k]):.6g}"


def _compare_int4(got: Any, w: torch.Tensor, group_size: int, symmetric: bool) -> None:
    """Raise an AssertionError naming the first difference from ``quantize_int4`` and the likely mistake."""
    from minifer.quantization.formats import quantize_int4, unpack_int4

    n, k = w.shape
    packed, scales, zeros = _as_int4_triple(got, n, k, group_size, symmetric)
    want = quantize_int4(w, group_size, symmetric)
    groups = w.view(n, k // group_size, group_size)

    if not symmetric and int(zeros.max()) > 15:
        r, g = (int(v) for v in (zeros > 15).nonzero()[0])
        raise AssertionError(
            f"zeros: {int((zeros > 15).sum())} zero points are outside 0..15; first at row {r}, group {g}: "
            f"{int(zeros[r, g])}\nhint: a zero point is a 4-bit code: clamp z = round(-lo / scale) to 0..15 (a "
            f"negative z wraps around in uint8), and widen each group's range to include 0, lo = min(group min, 0), "
            f"hi = max(group max, 0), so that z stays in range for groups of one sign")

    # scales
    if not torch.allclose(scales, want.scales, rtol=1e-6, atol=0.0):
        bad = ~torch.isclose(scales, want.scales, rtol=1e-6, atol=0.0)
        i = int(bad.flatten().nonzero()[0])
        r, g = divmod(i, k // group_size)
        head = (f"scales: {int(bad.sum())} of {bad.numel()} differ; first at row {r}, group {g}: got "
                f"{float(scales[r, g]):.6g}, expected {float(want.scales[r, g]):.6g}")
        zero_group = groups.abs().amax(dim=2) == 0
        strided = w.view(n, group_size, k // group_size).abs().amax(dim=1) / 7.0
        if bool(zero_group[r, g]):
            hint = ("this group is all zeros, so its absmax (or range) is 0: use scale 1 there instead of dividing by "
                    "0 (its codes then stand for exact zeros)")
        elif symmetric and torch.allclose(scales[~zero_group], (want.scales * 7 / 8)[~zero_group], rtol=1e-5):
            hint = ("your scales are absmax / 8. Codes run from -8 to 7, and the largest magnitude must map to 7, "
                    "not 8 (which would be clamped): scale = absmax / 7")
        elif symmetric and torch.allclose(scales[~zero_group], strided[~zero_group], rtol=1e-5):
            hint = ("your groups take every (K // group_size)-th input (w.view(N, group_size, K // group_size)); a "
                    "group is group_size *consecutive* inputs of a row: w.view(N, K // group_size, group_size), "
                    "reduce over the last dim")
        elif not symmetric and bool(((groups.amin(2) > 0) | (groups.amax(2) < 0))[r, g]):
            hint = ("this group has one sign. Widen its range to include 0, lo = min(group min, 0) and "
                    "hi = max(group max, 0), so that 0 is exactly representable: scale = (hi - lo) / 15")
        else:
            hint = ("symmetric: scale = absmax / 7 of each group of group_size consecutive weights of a row"
                    if symmetric else "asymmetric: scale = (hi - lo) / 15 with lo = min(group min, 0), "
                                      "hi = max(group max, 0)")
        raise AssertionError(f"{head}\nhint: {hint}")

    # zero points
    if not symmetric and not torch.equal(zeros, want.zeros):
        bad = zeros != want.zeros
        i = int(bad.flatten().nonzero()[0])
        r, g = divmod(i, k // group_size)
        raise AssertionError(f"zeros: {int(bad.sum())} of {bad.numel()} differ; first at row {r}, group {g}: got "
                             f"{int(zeros[r, g])}, expected {int(want.zeros[r, g])}\nhint: z = round(-lo / scale), "
                             f"clamped to 0..15, with lo = min(group min, 0)")

    # codes
    if torch.equal(packed, want.qweight):
        return
    got_lo, got_hi = _nibbles(packed)
    want_lo, want_hi = _nibbles(want.qweight)
    codes, want_codes = unpack_int4(packed), unpack_int4(want.qweight)
    bad = codes != want_codes
    i = int(bad.flatten().nonzero()[0])
    r, c = divmod(i, k)
    head = (f"codes: {int(bad.sum())} of {bad.numel()} differ; first at {_where(r, c, w, group_size)}: got "
            f"{int(codes[r, c])}, expected {int(want_codes[r, c])}")
    ratio = (groups / want.scales[..., None]).reshape(n, k)
    halfway = (ratio - ratio.floor()) == 0.5
    if torch.equal(got_lo, want_hi) and torch.equal(got_hi, want_lo):
        hint = ("your nibbles are swapped: column 2j goes in the LOW nibble of byte j and column 2j + 1 in the "
                "high one, byte = q[:, 0::2] | (q[:, 1::2] << 4)")
    elif symmetric and torch.equal(got_lo, (want_lo.int() - 8).remainder(16).to(torch.uint8)):
        hint = ("your codes are the signed values -8..7: add the offset 8, q = clamp(round(w / scale), -8, 7) + 8, "
                "so that they are in 0..15 before packing")
    elif bool(halfway[bad].all()):
        hint = (f"the codes differ only where w / scale is exactly halfway between two codes (here "
                f"{float(ratio[r, c]):g}): round halves to even with torch.round, as minifer does, not with "
                f"floor(x + 0.5) or away from zero")
    elif not symmetric:
        hint = "asymmetric: q = clamp(round(w / scale) + z, 0, 15), then pack two codes per byte"
    else:
        hint = "symmetric: q = clamp(round(w / scale), -8, 7) + 8, then pack two codes per byte"
    raise AssertionError(f"{head}\nhint: {hint}")


def check_quantize_int4(fn: Callable[[torch.Tensor, int, bool], Any]) -> None:
    """Grade ``fn(w, group_size, symmetric) -> (packed, scales, zeros)`` against
    :func:`minifer.quantization.formats.quantize_int4` (exact codes and zero points, scales to float rounding)."""
    from minifer.quantization.formats import QuantizedWeight, dequantize

    gen = seeded(50)

    def compare_all(items: list[tuple[torch.Tensor, int, bool]]) -> Check:
        def run() -> None:
            for w, g, sym in items:
                try:
                    _compare_int4(call_unmodified(fn, w, g, sym), w, g, sym)
                except AssertionError as exc:
                    if raised_by_learner(exc):  # an assert in the learner's own code: run_checks says so
                        raise
                    raise AssertionError(f"w {list(w.shape)}, group_size={g}, symmetric={sym}: {exc}") from None
        return run

    def case(shapes: list[tuple[int, int, int]], symmetrics: tuple[bool, ...], make=None) -> Check:
        weights = [(make or (lambda n, k: torch.randn(n, k, generator=gen) * 0.05))(n, k) for n, k, _ in shapes]
        return compare_all([(w, g, sym) for w, (_, _, g) in zip(weights, shapes) for sym in symmetrics])

    def halfway(n: int, k: int, symmetric: bool) -> torch.Tensor:
        """Weights at exact halves of the scale 2**-6 (codes -6.5 .. 6.5), each group's range set so that its
        scale is exactly 2**-6: w / scale lands halfway between two codes, where the rounding rule decides."""
        m = torch.randint(-7, 7, (n, k), generator=gen).float() + 0.5
        ends = m.view(n, k // 32, 32)
        if symmetric:
            ends[:, :, 0] = 7.0  # absmax 7 steps: scale = 7 * 2**-6 / 7
        else:
            ends[:, :, 0], ends[:, :, 1] = -7.5, 7.5  # range 15 steps: scale = 15 * 2**-6 / 15
        return m * 2.0 ** -6

    def one_sign(n: int, k: int) -> torch.Tensor:  # rows alternate all-positive and all-negative groups
        w = torch.rand(n, k, generator=gen) * 0.1 + 0.01
        w[1::2] *= -1
        return w

    def with_zero_group(n: int, k: int) -> torch.Tensor:
        w = torch.randn(n, k, generator=gen)
        w[1, 32:64] = 0.0  # the second group of row 1 (group size 32)
        return w

    round_trip_weights = [(torch.randn(16, 512, generator=gen) * torch.rand(16, 1, generator=gen) * 0.2, g)
                          for g in (32, 64, 128)]

    def round_trip() -> None:
        for w, g in round_trip_weights:
            for sym in (True, False):
                packed, scales, zeros = _as_int4_triple(fn(w.clone(), g, sym), *w.shape, g, sym)
                if not sym and int(zeros.max()) > 15:
                    raise AssertionError("zero points outside 0..15; clamp them")
                deq = dequantize(QuantizedWeight("int4", packed, scales, zeros, g, tuple(w.shape)))
                bound = scales.repeat_interleave(g, dim=1) / 2 * (1 + 1e-5) + 1e-7
                far = (deq - w).abs() > bound
                if bool(far.any()):
                    r, c = (int(v) for v in far.nonzero()[0])
                    raise AssertionError(
                        f"group_size={g}, symmetric={sym}: {int(far.sum())} weights are more than half a step (s / 2) "
                        f"from their dequantized value; first at {_where(r, c, w, g)}, dequantized "
                        f"{float(deq[r, c]):.6g}\nhint: round to the nearest code (torch.round), and choose the "
                        f"scale so that no weight of the group is clamped")

    checks: list[Check] = [
        ("symmetric, [4, 64], group 32: uint8 [4, 32] codes, float32 [4, 2] scales, no zeros",
         case([(4, 64, 32)], (True,))),
        ("symmetric, [8, 256], group 128: the same bytes and scales as minifer's", case([(8, 256, 128)], (True,))),
        ("asymmetric, [6, 192], group 64: scales, zero points and codes", case([(6, 192, 64)], (False,))),
        ("odd shapes ([1, 32], [7, 96], [3, 128], [5, 384]; groups 32, 32, 64, 128), both modes",
         case([(1, 32, 32), (7, 96, 32), (3, 128, 64), (5, 384, 128)], (True, False))),
        ("groups of one sign: the asymmetric range is widened to include 0",
         case([(4, 128, 32), (3, 64, 64)], (True, False), make=one_sign)),
        ("an all-zero group: scale 1, every weight exactly 0 after dequantization",
         case([(3, 128, 32)], (True, False), make=with_zero_group)),
        ("weights exactly halfway between two codes: halves round to even (torch.round)",
         compare_all([(halfway(4, 64, True), 32, True), (halfway(4, 64, False), 32, False)])),
        ("round trip ([16, 512], groups 32, 64, 128): every weight within s / 2 of its dequantized value",
         round_trip),
    ]
    run_checks("quantize_int4", checks)


# --- chapter 05: the Triton dequantize-matmul kernel -----------------------------------------------------


class StandInKernel:
    """What ``@triton.jit`` makes where Triton is not installed: the function, kept (``fn``, for saving it), and a
    launch, ``kernel[grid](...)``, that raises ``Blocked`` with the reason: a grader reports the check blocked, not
    failed."""

    stand_in_for_triton = True

    def __init__(self, fn: Callable[..., Any], reason: str) -> None:
        self.fn, self.reason = fn, reason
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        raise Blocked(self.reason)


def triton_modules() -> tuple[Any, Any, str]:
    """``(triton, triton.language, status)``: the real modules, switching Triton to its CPU interpreter
    first when there is no CUDA GPU; where Triton is not installed (macOS, Windows), stand-ins with which a kernel
    cell still *defines* its kernel (``@triton.jit`` makes a ``StandInKernel``, ``tl.constexpr`` is ``int``), and a
    status saying that the kernel checks skip."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
    from minifer.kernels import HAS_TRITON, TRITON_ERROR

    if HAS_TRITON:
        import triton
        import triton.language as tl

        where = ("natively on the GPU" if torch.cuda.is_available() else
                 "in Triton's CPU interpreter (TRITON_INTERPRET=1)" if os.environ.get("TRITON_INTERPRET") == "1" else
                 "nowhere: there is no GPU and TRITON_INTERPRET is set, but not to 1")
        return triton, tl, f"Triton kernels run {where}"

    def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        return StandInKernel(fn, TRITON_ERROR) if fn is not None else (lambda f: StandInKernel(f, TRITON_ERROR))

    stand_in = types.SimpleNamespace(jit=jit, cdiv=lambda a, b: -(-a // b))
    return stand_in, types.SimpleNamespace(constexpr=int), f"Triton kernel checks skip: {TRITON_ERROR}"


def launch_int4_matmul(kernel: Any, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor | None, group_size: int, out: torch.Tensor, BLOCK_M: int = 16,
                       BLOCK_N: int = 16, BLOCK_K: int = 32, **meta: Any) -> torch.Tensor:
    """Launch an exercise kernel (the signature of the notebook's ``int4_matmul_kernel``) to write
    ``out[M, N] = x[M, K] @ dequantize(W)^T``: one program per ``[BLOCK_M, BLOCK_N]`` tile of ``out``.
    Rows may be strided (the grader passes views into larger buffers); ``zeros`` and ``scales`` share
    their row stride. ``meta``: extra constexprs of a test kernel."""
    m, k = x.shape
    n = packed.shape[0]
    if zeros is not None and zeros.stride(0) != scales.stride(0):
        raise ValueError("zeros and scales must have the same row stride")
    kernel[(-(-m // BLOCK_M), -(-n // BLOCK_N))](  # a StandInKernel (no Triton) raises Blocked here
        x, packed, scales, scales if zeros is None else zeros, out, m, n, k,
        x.stride(0), packed.stride(0), scales.stride(0), out.stride(0),
        GROUP=group_size, HAS_ZEROS=zeros is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, **meta)
    return out


def _is_triton_kernel(obj: Any) -> bool:
    if isinstance(obj, StandInKernel):
        return True
    return hasattr(obj, "fn") and callable(getattr(obj, "__getitem__", None)) and hasattr(obj, "run")


def _not_implemented(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a stub: the interpreter wraps the kernel's NotImplementedError in an
    InterpreterError, and on a GPU the compiler rejects the ``raise`` statement, quoting it."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, NotImplementedError) or "NotImplementedError" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


# The tensors the grader hands over as row-strided views, with the stride argument that walks each one's rows.
_STRIDES = {"x": "x (stride_xm)", "packed": "packed W (stride_qn)", "scales": "scales/zeros (stride_sn)",
            "out": "out (stride_om)"}

_MARGIN = 64  # NaN margin around every input and the output: wider than any tile overrun of the wrapper


def _in_margin(t: torch.Tensor, fill: float | int, device: str,
               strided: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` copied into the top-left corner of a ``fill``-filled buffer with ``_MARGIN`` extra rows and
    (``strided``) extra columns, so that the view's row stride is not its width; returns ``(view, buffer)``."""
    cols = t.shape[1] + (2 * _MARGIN if strided else 0)
    buf = torch.full((t.shape[0] + _MARGIN, cols), fill, dtype=t.dtype, device=device)
    view = buf[: t.shape[0], : t.shape[1]]
    view.copy_(t)
    return view, buf


def _dequant_variant(qw: Any, *, swap: bool = False, zero_point: bool = True, scale: bool = True,
                     group_of: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``dequantize(qw)`` with one of the kernel's classic mistakes (to name the mistake a result fits)."""
    from minifer.quantization.formats import unpack_int4

    n, k = qw.shape
    q = unpack_int4(qw.qweight).float()
    if swap:
        q = q.view(n, k // 2, 2).flip(-1).reshape(n, k)
    cols = torch.arange(k)
    gi = (group_of or (lambda c: c // qw.group_size))(cols).clamp(max=k // qw.group_size - 1)
    z = 8.0 if qw.zeros is None else qw.zeros.float()[:, gi]
    return (q - (z if zero_point else 0.0)) * (qw.scales[:, gi] if scale else 1.0)


def _kernel_mistakes(qw: Any) -> list[tuple[torch.Tensor, str]]:
    g = qw.group_size
    return [
        (_dequant_variant(qw, swap=True), "your nibbles are swapped: byte j holds column 2j in its LOW nibble "
                                          "(b & 0xF) and column 2j + 1 in its high nibble (b >> 4)"),
        (_dequant_variant(qw, zero_point=False), "subtract the zero point from the codes before scaling: 8 when "
                                                 "symmetric (HAS_ZEROS is False), else the group's zero point"),
        (_dequant_variant(qw, scale=False), "multiply each dequantized code by its group's scale"),
        (_dequant_variant(qw, group_of=lambda c: (c // 2) // g),
         "the group of column k is k // GROUP, with k the column (2 * byte index + 0 or 1), not the byte index"),
        *[(_dequant_variant(qw, group_of=lambda c, bk=bk: (c // bk * bk) // g),
           f"a K tile can straddle groups (here a tile of {bk} columns, groups of {g}): load the scale (and zero "
           f"point) of each column's own group, k // GROUP, not one per tile")
          for bk in (32, 64) if g % bk],
    ]


_NO_INTERPRETER = ("no GPU, and Triton's interpreter is off. TRITON_INTERPRET=1 must be set before triton is imported: "
                   "restart the kernel and run the notebook from its first cell.")


def _under_test(name: str, kernel_or_fn: Any) -> Callable[..., Any]:
    """``fn(x, packed, scales, zeros, group_size, out)`` for the grader to call: a kernel launched by
    ``launch_int4_matmul``, or the learner's function itself (a wrapper that launches a kernel, or PyTorch)."""
    from minifer.kernels import HAS_TRITON

    if _is_triton_kernel(kernel_or_fn):
        if HAS_TRITON and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise AssertionError(f"{name}: {_NO_INTERPRETER}")
        return functools.partial(launch_int4_matmul, kernel_or_fn)
    if callable(kernel_or_fn):
        return kernel_or_fn
    raise AssertionError(f"{name}: expected a @triton.jit kernel or a function, got {type(kernel_or_fn).__name__}")


def _called(fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)``, its failures in the grader's terms: a stub's ``NotImplementedError`` (the interpreter wraps it,
    the GPU compiler quotes it); Triton missing (a launch of a ``StandInKernel``, an ``import triton``): ``Blocked``;
    Triton there but neither a GPU nor its interpreter: say so."""
    from minifer.kernels import HAS_TRITON, TRITON_ERROR

    try:
        fn(*args)
    except Blocked:
        raise
    except Exception as exc:
        if _not_implemented(exc):
            raise NotImplementedError from None
        if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] == "triton":
            raise Blocked(TRITON_ERROR) from exc
        if HAS_TRITON and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            raise AssertionError(f"{_NO_INTERPRETER} (your function raised {type(exc).__name__}: {exc})") from exc
        raise


def check_int4_matmul_kernel(kernel_or_fn: Any) -> None:
    """Grade an int4 dequantize-matmul: a Triton kernel with the notebook's signature (launched by
    :func:`launch_int4_matmul` with 16 x 16 output tiles and 32-column K tiles), or a function
    ``fn(x, packed, scales, zeros, group_size, out)`` that writes ``out`` ``[M, N]`` float32: the wrapper that
    launches the kernel, or the same unpack-scale-dot in PyTorch (exercise 05's path where Triton is not installed).
    Compared with ``quant_linear_reference`` on odd shapes; float32 inputs. Where Triton is not installed, a kernel's
    launch raises ``Blocked`` (``StandInKernel``): its checks are blocked, not failed; a PyTorch function is graded
    as anywhere."""
    name = "int4_matmul_kernel"
    fn = _under_test(name, kernel_or_fn)
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"

    every = frozenset(_STRIDES)

    def launch(x: torch.Tensor, qw: Any, x_fill: float, s_fill: float,
               strided: frozenset[str] = every) -> tuple[torch.Tensor, torch.Tensor]:
        """``out`` and its buffer after one launch on inputs inside margins (NaN, or ``*_fill``); the tensors
        named in ``strided`` are views with a row stride wider than their rows, the others contiguous."""
        m, n = x.shape[0], qw.shape[0]
        xv, _ = _in_margin(x, x_fill, device, "x" in strided)
        qv, _ = _in_margin(qw.qweight, 0xFF, device, "packed" in strided)
        sv, _ = _in_margin(qw.scales, s_fill, device, "scales" in strided)
        zv = None if qw.zeros is None else _in_margin(qw.zeros, 0xFF, device, "scales" in strided)[0]
        out, buf = _in_margin(torch.full((m, n), float("nan")), float("nan"), device, "out" in strided)
        _called(fn, xv, qv, sv, zv, qw.group_size, out)
        if on_gpu:
            torch.cuda.synchronize()
        return out.cpu(), buf.cpu()

    def problem(x: torch.Tensor, qw: Any, want: torch.Tensor, strided: frozenset[str]) -> str | None:
        """What is wrong with the kernel's output on these inputs (``None``: nothing)."""
        m, n, k = x.shape[0], qw.shape[0], x.shape[1]
        got, buf = launch(x, qw, float("nan"), float("nan"), strided)
        outside = buf.clone()
        outside[:m, :n] = float("nan")
        if not bool(outside.isnan().all()):
            r, c = (int(v) for v in (~outside.isnan()).nonzero()[0])
            return (f"out [{m}, {n}]: the kernel wrote outside it (at row {r}, column {c} of the buffer around "
                    f"it)\nhint: mask the store: mask=(rm < M)[:, None] & (rn < N)[None, :]")
        if bool(got.isnan().any()):
            again, _ = launch(x, qw, 0.0, 0.0, strided)
            if not bool(again.isnan().any()):
                return (f"{int(got.isnan().sum())} of {got.numel()} outputs are NaN because the kernel read past the "
                        f"end of a row of x or of the scales (they sit in NaN-filled buffers here)\nhint: K = {k} "
                        f"need not be a multiple of BLOCK_K: mask the last K tile's loads (columns < K) with other=0")
            return (f"{int(again.isnan().sum())} of {got.numel()} outputs were never written (still NaN); first at "
                    f"{fmt_index(int(again.isnan().flatten().nonzero()[0]), got.shape)}\nhint: every program "
                    f"stores its [BLOCK_M, BLOCK_N] tile of acc into out (the wrapper's out, not a new tensor; "
                    f"in PyTorch, out.copy_(...))")
        scale = float(want.abs().max())
        bad = (got - want).abs() > 5e-3 * scale
        if bool(bad.any()):
            fits = [why for w_alt, why in _kernel_mistakes(qw)
                    if bool(((got - x @ w_alt.T).abs() <= 5e-3 * scale).all())]
            i = int(bad.flatten().nonzero()[0])
            return (f"{int(bad.sum())} of {bad.numel()} outputs differ from x @ dequantize(W)^T; first at "
                    f"{fmt_index(i, got.shape)}: got {float(got.flatten()[i]):.5g}, expected "
                    f"{float(want.flatten()[i]):.5g}\nhint: " + (fits[0] if fits else
                    "per K tile: unpack each byte into (b & 0xF) for column 2j and (b >> 4) for 2j + 1, subtract "
                    "the zero point, multiply by the scale of the column's group, and accumulate the even and "
                    "odd columns' products with x's even and odd columns"))
        return None

    def case(m: int, n: int, k: int, group: int, symmetric: bool, seed: int) -> Check:
        def run() -> None:
            from minifer.quantization.formats import quant_linear_reference, quantize_int4

            gen = seeded(seed)
            qw = quantize_int4(torch.randn(n, k, generator=gen), group, symmetric)
            x = torch.randn(m, k, generator=gen)
            want = quant_linear_reference(x, qw)
            msg = problem(x, qw, want, every)
            if msg is None:
                return
            if problem(x, qw, want, frozenset()) is None:  # right on contiguous tensors: the strides are ignored
                ignored = [_STRIDES[t] for t in _STRIDES if problem(x, qw, want, frozenset({t})) is not None]
                raise AssertionError(
                    "your kernel ignores the stride arguments: its output is right when every tensor is contiguous, "
                    "wrong on row-strided views (here each tensor is a view into a wider buffer, as a slice of a "
                    "bigger tensor would be)" + (f"; wrong with a strided {', '.join(ignored)}" if ignored else "")
                    + "\nhint: index rows with stride_xm, stride_qn, stride_sn (scales and zero points) and "
                    "stride_om, not with K or N: x_ptr + rm[:, None] * stride_xm, q_ptr + rn * stride_qn, "
                    "s_ptr + rn * stride_sn, out_ptr + rm[:, None] * stride_om")
            raise AssertionError(msg)
        return run

    checks: list[Check] = [
        ("M = 1 (decode), N = 24 (not a multiple of BLOCK_N), K = 64, group 32, symmetric",
         case(1, 24, 64, 32, True, 1)),
        ("M = 3, N = 40, K = 128, group 64, asymmetric zero points", case(3, 40, 128, 64, False, 2)),
        ("a K tile straddles groups: M = 2, N = 20, K = 96, group 16, asymmetric", case(2, 20, 96, 16, False, 3)),
        ("K = 80, not a multiple of the K tile: M = 5, N = 17, group 40, symmetric", case(5, 17, 80, 40, True, 4)),
        ("M = 17 (two row tiles), N = 33, K = 256, group 128, symmetric", case(17, 33, 256, 128, True, 5)),
    ]
    run_checks(name, checks)


# --- chapter 05: perplexity ------------------------------------------------------------------------------


class _SyntheticModel:
    """``model_fn(ids [B, T]) -> logits [B, T, V]``: a bigram table plus a bias per position, so that the
    score depends on where each window starts (as a real model's does), deterministic and fast."""

    def __init__(self, vocab: int, seed: int, max_len: int = 1024, uniform: bool = False) -> None:
        gen = seeded(seed)
        self.vocab, self.max_len = vocab, max_len
        self.table = torch.zeros(vocab, vocab) if uniform else torch.randn(vocab, vocab, generator=gen) * 2.0
        self.pos = torch.zeros(max_len, vocab) if uniform else torch.randn(max_len, vocab, generator=gen)

    def __call__(self, ids: Any) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            shape = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise AssertionError(f"model_fn takes a batch of token ids, an integer tensor [B, T]; got {shape}"
                                 f"\nhint: pass the windows' inputs, e.g. windows[:, :-1] (or a single row as ids[None])")
        if ids.shape[1] > self.max_len:
            raise AssertionError(f"model_fn got sequences of {ids.shape[1]} tokens, more than its {self.max_len}: "
                                 f"call it on windows, not on the whole stream")
        return self.table[ids.long()] + self.pos[: ids.shape[1]]


def _nll(model_fn: Callable[[torch.Tensor], torch.Tensor], windows: torch.Tensor) -> torch.Tensor:
    """NLL ``[n, T - 1]`` (float64) of each window's tokens 1.. given the tokens before them."""
    logits = model_fn(windows[:, :-1]).double()
    return F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(len(windows), -1)


def _ppl_mistakes(model_fn: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
                  window: int) -> list[tuple[float, str]]:
    """What the classic mistakes return, each with its hint."""
    n = (len(ids) - 1) // window
    windows = torch.stack([ids[i * window : i * window + window + 1] for i in range(n)])
    nll = _nll(model_fn, windows)
    out = [
        (float(nll.mean(1).exp().mean()), "you averaged the windows' perplexities; average the NLL over all "
                                          "predicted tokens first (token-weighted), then take exp once"),
        (float(nll.sum().div(n * (window + 1)).exp()), "you divided by n_windows * (window + 1) tokens: the first "
                                                       "token of a window is context only (nothing predicts it), so "
                                                       "a window predicts `window` tokens"),
    ]
    logits = model_fn(windows[:, :-1]).double()
    same = F.cross_entropy(logits.flatten(0, 1), windows[:, :-1].flatten())
    out.append((float(same.exp()), "the logits at position t predict token t + 1: score logits[:, :-1] against "
                                   "the targets shifted by one, windows[:, 1:]"))
    m = len(ids) // (window + 1)
    if m:
        out.append((float(_nll(model_fn, ids[: m * (window + 1)].view(m, -1)).mean().exp()),
                    "consecutive windows share one token: window i is token_ids[i * window : i * window + window + 1], "
                    "so the last token of a window is the first (context) token of the next"))
    m = len(ids) // window
    if m:
        out.append((float(_nll(model_fn, ids[: m * window].view(m, -1)).mean().exp()),
                    "a window has window + 1 tokens (window predictions), and consecutive windows share one token; "
                    "chunks of `window` tokens leave the first token of every chunk unpredicted"))
    if n * window + 1 <= 1024:
        out.append((float(_nll(model_fn, ids[None, : n * window + 1]).mean().exp()),
                    "run each window as its own sequence, from position 0 (a model's context is the window: "
                    "that is what makes the perplexity of a long text computable)"))
    return out


@functools.lru_cache(maxsize=1)
def _bundled() -> tuple[Any, torch.Tensor]:
    """The bundled target model and the held-out token stream of its first 12 stories."""
    import minifer
    from minifer.eval import read_stories, token_stream

    llm = minifer.LLM("tinystories-target", device="cpu")  # float32: the same numbers on every machine
    return llm.model, token_stream(llm.tokenizer, read_stories()[:12])


def _bundled_model_fn(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    from minifer.eval import causal_forward

    @torch.inference_mode()
    def model_fn(ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise AssertionError("model_fn takes a batch of token ids [B, T]")
        return model.compute_logits(causal_forward(model, ids.long())).float().view(*ids.shape, -1)

    return model_fn


def check_perplexity(fn: Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, int], Any]) -> None:
    """Grade ``fn(model_fn, token_ids, window) -> perplexity`` (minifer.eval's framing: windows of
    ``window + 1`` tokens from the start of the stream, consecutive windows sharing one token, the tail
    dropped; token-weighted mean NLL, then exp)."""
    from minifer.eval import perplexity, token_windows

    def score(model_fn: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, window: int) -> float:
        ids_in = ids.clone()
        got = fn(model_fn, ids_in, window)
        if not torch.equal(ids_in, ids):
            raise AssertionError("your function modified token_ids; work on slices or copies")
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, (bool, str)) or not hasattr(got, "__float__"):
            raise AssertionError(f"expected a number (a float), got {type(got).__name__}")
        got = float(got)
        if not math.isfinite(got):
            raise AssertionError(f"the perplexity is {got}\nhint: exp of the mean NLL, from log_softmax (or "
                                 f"F.cross_entropy) of the logits, is finite")
        return float(got)

    def compare(got: float, want: float, what: str, mistakes: Callable[[], list[tuple[float, str]]],
                hint: str) -> None:
        if math.isclose(got, want, rel_tol=1e-4):
            return
        fits = [why for value, why in mistakes() if math.isclose(got, value, rel_tol=1e-4)]
        raise AssertionError(f"{what}: got perplexity {got:.6g}, expected {want:.6g}\nhint: "
                             f"{fits[0] if fits else hint}")

    default_hint = ("cut token_ids into n = (len - 1) // window windows of window + 1 tokens, window i starting at "
                    "i * window; model_fn(windows[:, :-1]) gives logits whose position t predicts windows[:, t + 1]; "
                    "perplexity = exp(mean NLL over all n * window predicted tokens)")

    def synthetic(length: int, window: int, seed: int, uniform: bool = False) -> Check:
        gen = seeded(seed)
        model = _SyntheticModel(37, seed, uniform=uniform)
        ids = torch.randint(0, 37, (length,), generator=gen)

        def run() -> None:
            got = score(model, ids, window)
            n = (length - 1) // window
            want = float(_nll(model, torch.stack([ids[i * window : i * window + window + 1]
                                                  for i in range(n)])).mean().exp())
            compare(got, want, f"{length} tokens, window {window}", lambda: _ppl_mistakes(model, ids, window),
                    "perplexity = exp(mean NLL); with uniform logits every token's NLL is log(V), so it is V = 37"
                    if uniform else default_hint)
        return run

    def bundled(window: int, n_windows: int, tail: int) -> Check:
        def run() -> None:
            model, stream = _bundled()
            ids = stream[: n_windows * window + 1 + tail]
            model_fn = _bundled_model_fn(model)
            want = perplexity(model, token_windows(ids, window))
            what = f"tinystories-target, {len(ids)} held-out tokens, window {window}"
            compare(score(model_fn, ids, window), want, what, lambda: _ppl_mistakes(model_fn, ids, window),
                    default_hint)
        return run

    checks: list[Check] = [
        ("a uniform model over 37 tokens: perplexity 37", synthetic(65, 16, 60, uniform=True)),
        ("a bigram-plus-position model, 4 windows of 16", synthetic(65, 16, 61)),
        ("windows share one token; a tail shorter than a window is dropped (120 tokens, window 16)",
         synthetic(120, 16, 62)),
        ("a single window (17 tokens, window 16)", synthetic(17, 16, 63)),
        ("the bundled tinystories-target, 3 windows of 64: minifer.eval.perplexity", bundled(64, 3, 13)),
        ("the bundled tinystories-target, 2 windows of 100", bundled(100, 2, 0)),
    ]
    run_checks("perplexity", checks)
