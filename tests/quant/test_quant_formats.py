"""Quantization formats (pure PyTorch): round-trip error bounds, int4 packing, the reference linear, and
every bad input the loader or a caller could hand them."""

from __future__ import annotations

import pytest
import torch

from minifer.quantization import (
    QuantizedWeight,
    dequantize,
    pack_int4,
    quant_linear_reference,
    quantize,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

pytestmark = pytest.mark.core  # the fast tier (tests/README.md)


def _weight(n: int, k: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 3  # rows of different scales
    w[0] = 0.0  # an all-zero row must not divide by zero
    return w.to(dtype)


def _scale_per_element(qw: QuantizedWeight) -> torch.Tensor:
    if qw.fmt == "int4":
        return qw.scales.repeat_interleave(qw.group_size, dim=1)
    return qw.scales[:, None].expand(qw.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_round_trip_within_half_a_step(dtype):
    w = _weight(9, 50, dtype=dtype)
    qw = quantize_int8(w).validate()
    assert qw.qweight.dtype == torch.int8 and qw.scales.shape == (9,) and qw.zeros is None
    assert int(qw.qweight.abs().max()) <= 127
    wf = w.float()
    torch.testing.assert_close(qw.scales[1:], wf[1:].abs().amax(1) / 127)
    err = (dequantize(qw) - wf).abs()
    assert (err <= _scale_per_element(qw) / 2 * (1 + 1e-6)).all()
    assert (dequantize(qw)[0] == 0).all()


@pytest.mark.parametrize("group_size", [32, 64, 128, 6])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_round_trip_within_half_a_step(group_size, symmetric):
    k = 384 if group_size != 6 else 42
    w = _weight(7, k, seed=group_size)
    qw = quantize_int4(w, group_size, symmetric).validate()
    assert qw.qweight.shape == (7, k // 2) and qw.scales.shape == (7, k // group_size)
    assert (qw.zeros is None) == symmetric
    err = (dequantize(qw) - w).abs()
    assert (err <= _scale_per_element(qw) / 2 * (1 + 1e-6) + 1e-7).all(), err.max()
    # The bound is not vacuous: the step is about a 1/7 (1/15) of each group's range.
    assert err.max() > 0 and (dequantize(qw)[0] == 0).all()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_int4_asymmetric_handles_one_signed_groups(sign):
    """A group of all-positive (or all-negative) weights: without widening the range to include 0 the zero
    point would clamp and codes would overflow 15."""
    gen = torch.Generator().manual_seed(1)
    w = sign * (0.5 + torch.rand(4, 64, generator=gen))  # every value in [0.5, 1.5) (or its negative)
    qw = quantize_int4(w, 32, symmetric=False)
    assert qw.zeros is not None and int(qw.zeros.max()) <= 15
    err = (dequantize(qw) - w).abs()
    assert (err <= _scale_per_element(qw) / 2 * (1 + 1e-6)).all()
    assert (err.max() < 1.5 / 15).item()  # error of a 15-step grid over [0, 1.5]


def test_int4_asymmetric_is_finer_than_symmetric_on_skewed_groups():
    gen = torch.Generator().manual_seed(2)
    w = torch.rand(16, 256, generator=gen) * 2 - 0.2  # mostly positive: asymmetric spends codes better
    e_sym = (dequantize(quantize_int4(w, 64, True)) - w).norm()
    e_asym = (dequantize(quantize_int4(w, 64, False)) - w).norm()
    assert e_asym < 0.8 * e_sym


def test_fp8_round_trip_within_e4m3_precision():
    w = _weight(8, 96, seed=3)
    qw = quantize_fp8(w).validate()
    assert qw.qweight.dtype == torch.float8_e4m3fn and qw.scales.shape == (8,)
    # Each row's absmax lands on 448, e4m3's largest value, exactly.
    assert torch.equal(qw.qweight[1:].float().abs().amax(1), torch.full((7,), 448.0))
    s = _scale_per_element(qw)
    err = (dequantize(qw) - w).abs()
    # 3 mantissa bits: half a unit in the last place is 2^-4 relative; subnormals (below 2^-6) step 2^-9.
    assert (err <= torch.maximum(w.abs() * 2.0 ** -4, s * 2.0 ** -10) * (1 + 1e-6)).all()
    assert torch.isfinite(dequantize(qw)).all() and (dequantize(qw)[0] == 0).all()


def test_pack_unpack_are_inverse_and_low_nibble_is_even_column():
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (5, 38), generator=gen, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 19) and torch.equal(unpack_int4(packed), q)
    assert torch.equal(packed[:, 3] & 0xF, q[:, 6]) and torch.equal(packed[:, 3] >> 4, q[:, 7])
    assert pack_int4(torch.tensor([[3, 10]], dtype=torch.uint8)).item() == 0xA3
    every_byte = torch.arange(256, dtype=torch.uint8).view(8, 32)
    assert torch.equal(pack_int4(unpack_int4(every_byte)), every_byte)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_linear_is_x_times_dequantized_transpose(fmt, dtype):
    w = _weight(12, 64, seed=5)
    qw = quantize(w, fmt, group_size=32, symmetric=False)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, 64, generator=gen).to(dtype)
    bias = torch.randn(12, generator=gen)
    y = quant_linear_reference(x, qw, bias)
    assert y.shape == (2, 3, 12) and y.dtype == dtype
    ref = x.double() @ dequantize(qw, torch.float64).T + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((y.double() - ref).norm() / ref.norm()).item() < tol


def test_nbytes_matches_the_docstring_table():
    w = torch.randn(64, 4096)
    assert quantize_int8(w).nbytes() == 64 * 4096 + 64 * 4
    assert quantize_fp8(w).nbytes() == 64 * 4096 + 64 * 4
    assert quantize_int4(w, 128).nbytes() / w.numel() == 0.53125
    assert quantize_int4(w, 128, symmetric=False).nbytes() / w.numel() == 0.5390625


def test_to_moves_every_field():
    qw = quantize_int4(torch.randn(4, 64), 32, symmetric=False).to("cpu")
    assert qw.validate().zeros.device.type == "cpu"


@pytest.mark.parametrize("call, match", [
    (lambda: quantize(torch.randn(4, 64), "int3"), "unknown quantization format 'int3'"),
    (lambda: quantize_int8(torch.randn(4, 4, 4)), "must be 2-D"),
    (lambda: quantize_int8(torch.randint(0, 5, (4, 4))), "dtype torch.int64 is not supported"),
    (lambda: quantize_fp8(torch.randn(0, 4)), "empty"),
    (lambda: quantize_int4(torch.randn(4, 63), 63), "K \\(in_features\\) must be even"),
    (lambda: quantize_int4(torch.randn(4, 96), 64), "group_size 64 must be even and divide K=96"),
    (lambda: quantize_int4(torch.randn(4, 96), 3), "group_size 3 must be even"),
    (lambda: quantize_int4(torch.randn(4, 96), 0), "positive integer group_size"),
    (lambda: pack_int4(torch.full((2, 4), 16, dtype=torch.uint8)), "codes must be in 0..15"),
    (lambda: pack_int4(torch.zeros(2, 3, dtype=torch.uint8)), "even number of columns"),
    (lambda: unpack_int4(torch.zeros(2, 3, dtype=torch.int8)), "2-D uint8"),
    (lambda: quant_linear_reference(torch.randn(2, 32), quantize_int8(torch.randn(4, 64))), "K=64"),
    (lambda: quant_linear_reference(torch.randn(2, 64), quantize_int8(torch.randn(4, 64)), torch.zeros(5)),
     "bias has shape"),
    (lambda: quantize_int8(torch.tensor([[1.0, float("nan")], [0.5, 0.25]])), r"1 non-finite value\(s\)"),
    (lambda: quantize_int4(torch.full((2, 64), float("inf")), 32), "128 non-finite"),
])
def test_bad_inputs_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _tampered(**changes) -> QuantizedWeight:
    qw = quantize_int4(torch.randn(8, 128), 32, symmetric=False)
    for name, value in changes.items():
        setattr(qw, name, value)
    return qw


@pytest.mark.parametrize("qw, match", [
    (_tampered(scales=torch.ones(8, 2)), r"scales has shape \(8, 2\), expected \(8, 4\)"),
    (_tampered(scales=torch.ones(8, 4, dtype=torch.float16)), "scales must be torch.float32"),
    (_tampered(zeros=torch.zeros(8, 3, dtype=torch.uint8)), r"zeros has shape \(8, 3\)"),
    (_tampered(zeros=torch.full((8, 4), 16, dtype=torch.uint8)), "zero points must be in 0..15"),
    (_tampered(qweight=torch.zeros(8, 128, dtype=torch.uint8)), r"qweight has shape \(8, 128\), expected \(8, 64\)"),
    (_tampered(qweight=torch.zeros(8, 64, dtype=torch.int8)), "qweight must be torch.uint8"),
    (_tampered(group_size=48), "group_size 48 must be even and divide K=128"),
    (_tampered(shape=(8, 100)), "qweight has shape"),
    (_tampered(fmt="nf4"), "unknown quantization format 'nf4'"),
    (QuantizedWeight("int8", torch.zeros(4, 8, dtype=torch.int8), torch.ones(5), None, None, (4, 8)),
     r"scales has shape \(5,\), expected \(4,\)"),
    (QuantizedWeight("fp8", torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), None, None, (4, 8)),
     "qweight must be torch.float8_e4m3fn"),
    (QuantizedWeight("int8", torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), None, 32, (4, 8)),
     "per-channel format takes no group_size"),
    # strided views: the kernels index rows by the shape alone and would read the wrong bytes
    (QuantizedWeight("int8", torch.zeros(4, 16, dtype=torch.int8)[:, :8], torch.ones(4), None, None, (4, 8)),
     "qweight must be contiguous"),
    (_tampered(scales=torch.ones(4, 8).t()), "scales must be contiguous"),
    (_tampered(zeros=torch.zeros(4, 8, dtype=torch.uint8).t()), "zeros must be contiguous"),
    # a checkpoint's numbers: quantize writes only finite, positive scales and no NaN fp8 code
    (_tampered(scales=torch.tensor([float("nan")] + [1.0] * 31).view(8, 4)), "scales must be finite and > 0"),
    (QuantizedWeight("int8", torch.zeros(4, 8, dtype=torch.int8), torch.tensor([1.0, -1, 1, 1]), None, None, (4, 8)),
     "found 1 that are not"),
    (QuantizedWeight("fp8", torch.full((4, 8), float("nan")).to(torch.float8_e4m3fn), torch.ones(4), None, None,
                     (4, 8)), "qweight holds 32 NaN code"),
])
def test_validate_names_the_mismatch(qw, match):
    with pytest.raises(ValueError, match=match):
        qw.validate()
    values = ("zero points", "finite", "that are not", "NaN code")  # checked at build and load, not per forward
    if not any(v in match for v in values):
        with pytest.raises(ValueError, match=match):
            dequantize(qw)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_rows_too_small_for_a_float32_scale_quantize_to_zeros(fmt):
    """absmax / 448 of a row near 1e-43 underflows float32 to 0: the scale must not be 0 (codes would be NaN)."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(3, 64, generator=gen)
    w[1] = 1e-43 * torch.sign(torch.randn(64, generator=gen))
    qw = quantize(w, fmt, group_size=32)
    assert bool((qw.scales > 0).all())
    out = dequantize(qw)
    assert torch.isfinite(out).all() and out[1].abs().max() < 1e-42
    # The ordinary rows keep the format's own error bound (the tiny row must not disturb them).
    err, s = (out - w).abs()[[0, 2]], _scale_per_element(qw)[[0, 2]]
    bound = torch.maximum(w.abs()[[0, 2]] * 2.0 ** -4, s * 2.0 ** -10) if fmt == "fp8" else s / 2
    assert (err <= bound * (1 + 1e-6) + 1e-7).all(), (err - bound).max()


def test_validate_can_skip_the_value_check():
    """Kernels call ``validate(check_values=False)`` on every call: shapes only, no GPU-to-CPU sync."""
    qw = _tampered(zeros=torch.full((8, 4), 16, dtype=torch.uint8))
    assert qw.validate(check_values=False) is qw
