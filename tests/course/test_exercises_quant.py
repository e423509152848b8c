"""The chapter-05 graders (``minifer_course.grading.quant``): minifer's own implementations pass, the classic
mistakes fail with a message that names them, and untouched stubs say "not implemented yet".

The Triton kernels here run under the interpreter on CPU (the root conftest sets ``TRITON_INTERPRET=1``
before triton is imported). The generated notebooks themselves are covered by ``tests/course/test_exercises.py``,
which discovers every exercise source."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from minifer_course.grading import quant as grading_quant
from minifer.eval import WindowScores, token_windows
from minifer.kernels import HAS_TRITON, TRITON_ERROR
from minifer.quantization.formats import QuantizedWeight, quantize_int4

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=TRITON_ERROR)


# --- minifer's implementations, in the exercises' signatures ---------------------------------------------


def _minifer_quantize(w, group_size, symmetric):
    qw = quantize_int4(w, group_size, symmetric)
    return qw.qweight, qw.scales, qw.zeros


def _minifer_int4_matmul(x, packed, scales, zeros, group_size, out):
    from minifer.kernels.quant_matmul import quant_matmul

    qw = QuantizedWeight("int4", packed.contiguous(), scales.contiguous(),
                         None if zeros is None else zeros.contiguous(), group_size, (packed.shape[0], x.shape[1]))
    out.copy_(quant_matmul(x, qw))


def _minifer_perplexity(model_fn, token_ids, window):
    """minifer.eval's framing (token_windows) and token-weighted perplexity (WindowScores)."""
    windows = token_windows(token_ids, window)
    logits = model_fn(windows[:, :-1]).float()
    nll = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none").view(len(windows), -1)
    return WindowScores(nll, logits.argmax(-1)).perplexity


def test_quantize_grader_passes_minifers_quantize_int4(capsys):
    rng = torch.random.get_rng_state()
    grading_quant.check_quantize_int4(_minifer_quantize)
    out = capsys.readouterr().out
    assert out.rstrip().endswith("quantize_int4: 8/8 checks passed") and "FAIL" not in out
    grading_quant.check_quantize_int4(_minifer_quantize)
    assert capsys.readouterr().out == out, "the report must be deterministic (nbval compares it)"
    assert torch.equal(torch.random.get_rng_state(), rng), "graders must not touch the global RNG"


def test_perplexity_grader_passes_minifers_eval(capsys):
    rng = torch.random.get_rng_state()
    grading_quant.check_perplexity(_minifer_perplexity)
    out = capsys.readouterr().out
    assert out.rstrip().endswith("perplexity: 6/6 checks passed") and "FAIL" not in out
    assert torch.equal(torch.random.get_rng_state(), rng), "graders must not touch the global RNG"


# --- int4 quantization: classic mistakes ------------------------------------------------------------------


def _quantize(w, group_size, symmetric, *, swap=False, levels=7.0, offset=8, widen=True, clamp_zero=True,
              axis="k", safe=True, half_up=False):
    """The notebook's solution with switches for the classic mistakes."""
    rnd = (lambda t: torch.floor(t + 0.5)) if half_up else torch.round  # half_up: round half up
    n, k = w.shape
    if axis == "k":
        groups = w.float().reshape(n, k // group_size, group_size)
    else:  # strided "groups": every (K // g)-th input
        groups = w.float().reshape(n, group_size, k // group_size).transpose(1, 2)
    pick = (lambda span, lv: torch.where(span > 0, span / lv, torch.ones_like(span))) if safe else (lambda s, lv: s / lv)
    if symmetric:
        scales = pick(groups.abs().amax(dim=2), levels)
        q = torch.clamp(rnd(groups / scales[..., None]), -8, 7) + offset
        zeros = None
    else:
        lo, hi = groups.amin(dim=2), groups.amax(dim=2)
        if widen:
            lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scales = pick(hi - lo, 15.0)
        z = rnd(-lo / scales)
        if clamp_zero:
            z = z.clamp(0, 15)
        q = torch.clamp(rnd(groups / scales[..., None]) + z[..., None], 0, 15)
        zeros = z.to(torch.uint8)
    if axis != "k":
        q = q.transpose(1, 2)
    q = q.reshape(n, k).to(torch.uint8)
    packed = (q[:, 1::2] | (q[:, 0::2] << 4)) if swap else (q[:, 0::2] | (q[:, 1::2] << 4))
    return packed, scales.contiguous(), zeros


WRONG_QUANTIZE = [
    ({"swap": True}, "nibbles are swapped"),
    ({"levels": 8.0}, r"absmax / 8"),
    ({"offset": 0}, r"add the offset 8"),
    ({"widen": False, "clamp_zero": False}, r"zero points are outside 0\.\.15"),
    ({"widen": False}, "Widen its range to include 0"),
    ({"axis": "n"}, "consecutive"),
    ({"safe": False}, "all zeros"),
    ({"half_up": True}, r"(?s)check 7/8.*exactly halfway between two codes.*round halves to even with torch.round"),
]


def test_quantize_grader_accepts_the_solution_and_rejects_bad_structure():
    grading_quant.check_quantize_int4(_quantize)
    with pytest.raises(AssertionError, match="return None"):  # zero points for the symmetric format
        grading_quant.check_quantize_int4(lambda w, g, s: _minifer_quantize(w, g, False))
    with pytest.raises(AssertionError, match=r"shape \[4, 64\], expected \[4, 32\]"):  # one code per byte
        grading_quant.check_quantize_int4(lambda w, g, s: (torch.zeros(w.shape, dtype=torch.uint8),
                                                           *_minifer_quantize(w, g, s)[1:]))
    with pytest.raises(AssertionError, match="transposed"):
        grading_quant.check_quantize_int4(lambda w, g, s: (_minifer_quantize(w, g, s)[0],
                                                           _minifer_quantize(w, g, s)[1].T.contiguous(), None))
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    along_n = w.T.reshape(128, -1, 32).abs().amax(2) / 7  # groups of 32 rows: scales [K, N // g]
    with pytest.raises(AssertionError, match="groups run along N"):
        grading_quant._compare_int4((_minifer_quantize(w, 32, True)[0], along_n, None), w, 32, True)

    def round_half_up(w, g, s):  # wrong codes everywhere a weight is not exactly on a code (round down)
        packed, scales, zeros = _quantize(w, g, s)
        return packed & 0xEE, scales, zeros

    with pytest.raises(AssertionError, match="(?s)check 1/8.*codes:"):
        grading_quant.check_quantize_int4(round_half_up)


# --- the Triton kernel: minifer's passes, classic mistakes fail --------------------------------------------

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _int4_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_om,
                     GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, MISTAKE: tl.constexpr = 0):
        """The notebook's solution (tl.dot) with MISTAKE switches: 1 swapped nibbles, 2 no zero point,
        3 no scale, 4 group of the byte index, 5 one group per K tile, 6 no K mask, 7 no store mask,
        8 no store, 9 rows indexed with K and N instead of the strides, 10 out's rows indexed with N, 11 x's
        rows indexed with K."""
        if MISTAKE == 11:
            stride_xm = K
        if MISTAKE == 9:
            stride_xm, stride_qn, stride_sn = K, K // 2, K // GROUP
        if MISTAKE == 9 or MISTAKE == 10:
            stride_om = N
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, BLOCK_K // 2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 2 + j
            ke = 2 * kb
            k_ok = ke < K
            if MISTAKE == 6:
                k_ok = ke < K + BLOCK_K
            w_mask = k_ok[:, None] & (rn < N)[None, :]
            b = tl.load(q_ptr + rn[None, :] * stride_qn + kb[:, None], mask=w_mask, other=0)
            g = ke // GROUP
            if MISTAKE == 4:
                g = kb // GROUP
            if MISTAKE == 5:
                g = ke * 0 + k0 // GROUP
            s = tl.load(s_ptr + rn[None, :] * stride_sn + g[:, None], mask=w_mask, other=0.0)
            if MISTAKE == 3:
                s = s * 0.0 + 1.0
            if HAS_ZEROS:
                z = tl.load(z_ptr + rn[None, :] * stride_sn + g[:, None], mask=w_mask, other=0).to(tl.float32)
            else:
                z = 8.0
            if MISTAKE == 2:
                z = 0.0
            lo = (b & 0xF).to(tl.float32)
            hi = (b >> 4).to(tl.float32)
            if MISTAKE == 1:
                lo, hi = hi, lo
            x_mask = (rm < M)[:, None] & k_ok[None, :]
            x_even = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :] + 1, mask=x_mask, other=0.0)
            acc += tl.dot(x_even, (lo - z) * s, input_precision="ieee")
            acc += tl.dot(x_odd, (hi - z) * s, input_precision="ieee")
        out_mask = (rm < M)[:, None] & (rn < N)[None, :]
        if MISTAKE == 7:
            out_mask = (rm < M + BLOCK_M)[:, None] & (rn < N + BLOCK_N)[None, :]
        if MISTAKE != 8:
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc, mask=out_mask)

    @triton.jit
    def _int4_kernel_sum(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_om,
                         GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        """Another correct answer: the products summed with tl.sum instead of tl.dot, zero points loaded
        per column of the tile."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, BLOCK_K // 2)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ke = k0 + 2 * j
            wm = (ke < K)[:, None] & (rn < N)[None, :]
            b = tl.load(q_ptr + rn[None, :] * stride_qn + (ke // 2)[:, None], mask=wm, other=0).to(tl.int32)
            gidx = rn[None, :] * stride_sn + (ke // GROUP)[:, None]
            s = tl.load(s_ptr + gidx, mask=wm, other=0.0)
            z = tl.load(z_ptr + gidx, mask=wm, other=0).to(tl.float32) if HAS_ZEROS else 8.0
            xm = (rm < M)[:, None] & (ke < K)[None, :]
            xe = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :], mask=xm, other=0.0)
            xo = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :] + 1, mask=xm, other=0.0)
            we = ((b & 15).to(tl.float32) - z) * s
            wo = ((b >> 4).to(tl.float32) - z) * s
            acc += tl.sum(xe[:, :, None] * we[None, :, :], axis=1) + tl.sum(xo[:, :, None] * wo[None, :, :], axis=1)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit
    def _stub_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_om,
                     GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            raise NotImplementedError("implement int4_matmul_kernel")


def _with_mistake(mistake):
    return lambda *args: grading_quant.launch_int4_matmul(_int4_kernel, *args, MISTAKE=mistake)


@needs_triton
def test_kernel_grader_passes_minifers_kernel_and_correct_kernels(capsys):
    grading_quant.check_int4_matmul_kernel(_minifer_int4_matmul)
    out = capsys.readouterr().out
    assert out.rstrip().endswith("int4_matmul_kernel: 5/5 checks passed") and "FAIL" not in out
    grading_quant.check_int4_matmul_kernel(_int4_kernel)  # a bare kernel: the grader launches it
    assert capsys.readouterr().out == out
    grading_quant.check_int4_matmul_kernel(_int4_kernel_sum)


WRONG_KERNEL = [
    (1, "nibbles are swapped"),
    (2, "subtract the zero point"),
    (3, "multiply each dequantized code by its group's scale"),
    (4, "not the byte index"),
    (5, "straddle groups"),
    (6, "mask the last K tile's loads"),
    (7, "mask the store"),
    (8, "never written"),
    (9, r"(?s)check 1/5.*ignores the stride arguments.*a strided packed W \(stride_qn\), scales/zeros "
        r"\(stride_sn\)\nhint: index rows with stride_xm"),  # M = 1 in check 1: x's stride is not used
    (10, r"ignores the stride arguments.*wrong with a strided out \(stride_om\)\n"),
    (11, r"(?s)check 2/5.*ignores the stride arguments.*wrong with a strided x \(stride_xm\)\n"),
]


@needs_triton
def test_kernel_stub_is_not_implemented():
    with pytest.raises(AssertionError, match="not implemented yet"):
        grading_quant.check_int4_matmul_kernel(_stub_kernel)


def test_kernel_grader_is_blocked_not_failed_without_triton(monkeypatch, capsys):
    """Where Triton is missing, ``@triton.jit`` is the grader's stand-in: a kernel, and a wrapper that launches one,
    are blocked (every check, with the reason); a function that computes in PyTorch is graded as anywhere."""
    import minifer.kernels

    monkeypatch.setattr(minifer.kernels, "HAS_TRITON", False)
    monkeypatch.setattr(minifer.kernels, "TRITON_ERROR", "Triton is not installed (test)")
    triton, tl, status = grading_quant.triton_modules()
    assert status == "Triton kernel checks skip: Triton is not installed (test)" and tl.constexpr is int

    @triton.jit
    def kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_om,
               GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
        raise AssertionError("a stand-in kernel never runs")

    def wrapper(x, packed, scales, zeros, group_size, out):
        return grading_quant.launch_int4_matmul(kernel, x, packed, scales, zeros, group_size, out)

    def imports_triton(x, packed, scales, zeros, group_size, out):
        import triton  # noqa: F401  (ModuleNotFoundError where it is missing)
        raise ModuleNotFoundError("No module named 'triton'", name="triton")

    blocked = "int4_matmul_kernel: 0/5 checks passed, 5 blocked (Triton is not installed (test)): not failed"
    for piece in (kernel, wrapper, imports_triton):
        grading_quant.check_int4_matmul_kernel(piece)  # returns: blocked is not failed
        out = capsys.readouterr().out
        assert blocked in out and "FAIL" not in out
    grading_quant.check_int4_matmul_kernel(_pytorch_int4_matmul)
    assert capsys.readouterr().out.rstrip().endswith("int4_matmul_kernel: 5/5 checks passed")
    with pytest.raises(AssertionError, match="outputs were never written"):  # graded, so a wrong one fails
        grading_quant.check_int4_matmul_kernel(lambda *a: None)


def _pytorch_int4_matmul(x, packed, scales, zeros, group_size, out):
    """The exercise's PyTorch path, through minifer's reference."""
    from minifer.quantization.formats import quant_linear_reference

    qw = QuantizedWeight("int4", packed.contiguous(), scales.contiguous(),
                         None if zeros is None else zeros.contiguous(), group_size, (packed.shape[0], x.shape[1]))
    return out.copy_(quant_linear_reference(x, qw))


# --- perplexity: classic mistakes -----------------------------------------------------------------------


def _perplexity(model_fn, token_ids, window, *, per_window=False, shift=True, count_first=False, share=True,
                whole=False):
    """The notebook's solution with switches for the classic mistakes."""
    step = window if share else window + 1
    n = (len(token_ids) - 1) // window if share else len(token_ids) // (window + 1)
    windows = torch.stack([token_ids[i * step : i * step + window + 1] for i in range(n)])
    if whole:
        windows = token_ids[None, : n * window + 1]
    logits = model_fn(windows[:, :-1])
    targets = windows[:, 1:] if shift else windows[:, :-1]
    nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape)
    if per_window:
        return float(nll.double().mean(1).exp().mean())
    if count_first:
        return float((nll.double().sum() / (n * (window + 1))).exp())
    return float(nll.double().mean().exp())


WRONG_PERPLEXITY = [
    ({"per_window": True}, "averaged the windows' perplexities"),
    ({"shift": False}, "predict token t \\+ 1"),
    ({"count_first": True}, "first token of a window is context only"),
    ({"share": False}, "share one token"),
    ({"whole": True}, "its own sequence"),
]


def test_perplexity_grader_accepts_the_solution_and_rejects_bad_calls():
    grading_quant.check_perplexity(_perplexity)
    with pytest.raises(AssertionError, match="integer tensor \\[B, T\\]"):  # one flat sequence
        grading_quant.check_perplexity(lambda m, ids, w: _perplexity(lambda t: m(t[0])[None], ids, w))
    with pytest.raises(AssertionError, match="(?s)check 1/6.*uniform logits"):  # not a perplexity at all
        grading_quant.check_perplexity(lambda m, ids, w: float(m(ids[None, :-1]).mean().exp()))


def test_an_assert_in_the_learners_code_is_reported_as_theirs():
    def asserts(w, group_size, symmetric):  # `assert symmetric, "..."` in a notebook
        if not symmetric:
            raise AssertionError("not enough memory")
        return _minifer_quantize(w, group_size, symmetric)

    with pytest.raises(AssertionError, match=r"^quantize_int4: check 3/8 \(asymmetric.*\): your function raised "
                                             r"AssertionError: not enough memory$") as info:
        grading_quant.check_quantize_int4(asserts)
    assert isinstance(info.value.__cause__, AssertionError)


def test_not_implemented_stubs_get_the_clear_message():
    def stub(*args):
        raise NotImplementedError("implement it")

    for grader in (grading_quant.check_quantize_int4, grading_quant.check_perplexity):
        with pytest.raises(AssertionError, match="not implemented yet"):
            grader(stub)


# --- every classic mistake fails, naming itself -----------------------------------------------------------

WRONG = ([pytest.param(grading_quant.check_quantize_int4, functools.partial(_quantize, **m), match, id=match)
          for m, match in WRONG_QUANTIZE]
         + [pytest.param(grading_quant.check_int4_matmul_kernel, _with_mistake(m), match, id=match, marks=needs_triton)
            for m, match in WRONG_KERNEL]
         + [pytest.param(grading_quant.check_perplexity, functools.partial(_perplexity, **m), match, id=match)
            for m, match in WRONG_PERPLEXITY])


@pytest.mark.parametrize("grader, wrong, match", WRONG)
def test_graders_reject_classic_mistakes(grader, wrong, match, capsys):
    with pytest.raises(AssertionError, match=match):
        grader(wrong)
    assert "  FAIL  " in capsys.readouterr().out
