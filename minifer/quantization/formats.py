"""Weight-only quantization formats: int8, int4 (group-wise, symmetric or with zero points) and fp8.

Decode reads every weight once per generated token, so its speed is bytes of weights over memory bandwidth
(chapter 01). Fewer bits per weight cut those bytes; activations stay in bf16/fp32 and the fused kernels of
``minifer/kernels/quant_matmul.py`` dequantize the weights on the fly. This module is the pure-PyTorch half: the
formats, quantize / dequantize, and ``quant_linear_reference``, the CPU path and the kernels' oracle.

Weights keep ``nn.Linear``'s layout, ``W: [N, K]`` (out_features x in_features), and ``y = x @ W^T``.

int8 — symmetric, one float32 scale per output channel (row)::

    qweight int8 [N, K]           scales float32 [N]
    w[n, k] = qweight[n, k] * scales[n]          scale = absmax(row) / 127, q in -127..127

fp8 (e4m3fn: 1 sign, 4 exponent, 3 mantissa bits, max 448) — one float32 scale per row::

    qweight float8_e4m3fn [N, K]  scales float32 [N]
    w[n, k] = float(qweight[n, k]) * scales[n]   scale = absmax(row) / 448

int4 — groups of ``g`` consecutive inputs along K share a scale (and, asymmetric, a zero point); two
4-bit codes per byte, the *even* column in the low nibble::

    k:        0    1    2    3   ...  K-2  K-1
    codes:   q0   q1   q2   q3   ...
    byte j:  [ q1 | q0 ] [ q3 | q2 ] ...           qweight uint8 [N, K/2], qweight[n, j] = q[2j] | q[2j+1] << 4
              high  low
    groups:  |<---- g ---->|<---- g ---->| ...     scales float32 [N, K/g], zeros uint8 [N, K/g] or None
    w[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g]      codes q in 0..15; z = 8 when symmetric

Symmetric: ``s = absmax(group) / 7``, ``q = clamp(round(w / s), -8, 7) + 8`` (no zero points stored).
Asymmetric: the group's range is widened to include 0 (as GPTQ does, so an all-positive group still has
an exact zero and its codes stay in range), ``s = (max - min) / 15``, ``z = round(-min / s)``,
``q = clamp(round(w / s) + z, 0, 15)``. Both keep every element within ``s / 2`` of its original value.

Bytes per weight, ``K`` inputs per row (float32 scales, uint8 zero points)::

    format        bytes / weight        K = 4096, g = 128
    bf16          2                     2        (16 bits)
    int8, fp8     1 + 4 / K             1.00098  (8.008 bits)
    int4 sym      1/2 + 4 / g           0.53125  (4.25 bits)
    int4 asym     1/2 + 5 / g           0.53906  (4.3125 bits)

so int8/fp8 halve the weight bytes of bf16 and int4 divides them by 3.76 (g = 128, symmetric) — the bound
on a decode matmul's speed-up when it is bandwidth-bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("int8", "int4", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_QDTYPE = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}


@dataclass
class QuantizedWeight:
    """A quantized ``[N, K]`` weight; the field layouts are drawn in the module docstring."""

    fmt: str  # "int8" | "int4" | "fp8"
    qweight: torch.Tensor  # int8 [N, K] | uint8 [N, K // 2] (int4, packed) | float8_e4m3fn [N, K]
    scales: torch.Tensor  # float32: [N] (int8, fp8) | [N, K // group_size] (int4)
    zeros: torch.Tensor | None  # int4 asymmetric: uint8 [N, K // group_size] in 0..15; otherwise None
    group_size: int | None  # int4 only
    shape: tuple[int, int]  # (N, K) of the original weight

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def nbytes(self) -> int:
        """Bytes the model stores for this weight: codes, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(self.fmt, move(self.qweight), move(self.scales), move(self.zeros), self.group_size,
                               self.shape)

    def validate(self, check_values: bool = True) -> QuantizedWeight:
        """Check every field against the others; return self, or raise ``ValueError`` naming the first mismatch.
        ``check_values=False`` checks shapes, dtypes and devices only: no GPU sync, so it can run on every call."""
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantization format {self.fmt!r}; expected one of {FORMATS}")
        if len(self.shape) != 2 or any(not isinstance(d, int) or d <= 0 for d in self.shape):
            raise ValueError(f"{self.fmt}: shape must be (N, K) with positive ints, got {self.shape}")
        n, k = self.shape
        _check_tensor(self.fmt, "qweight", self.qweight, _QDTYPE[self.fmt],
                      (n, k // 2) if self.fmt == "int4" else (n, k))
        if self.fmt == "int4":
            _check_group(k, self.group_size)
            groups = (n, k // self.group_size)
            _check_tensor(self.fmt, "scales", self.scales, torch.float32, groups)
            if self.zeros is not None:
                _check_tensor(self.fmt, "zeros", self.zeros, torch.uint8, groups)
                if check_values and self.zeros.numel() and int(self.zeros.max()) > 15:
                    raise ValueError(f"int4: zero points must be in 0..15, found {int(self.zeros.max())}")
        else:
            if self.group_size is not None or self.zeros is not None:
                zeros = "set" if self.zeros is not None else None
                raise ValueError(f"{self.fmt}: per-channel format takes no group_size or zeros "
                                 f"(got group_size={self.group_size}, zeros={zeros})")
            _check_tensor(self.fmt, "scales", self.scales, torch.float32, (n,))
        devices = {t.device for t in (self.qweight, self.scales, self.zeros) if t is not None}
        if len(devices) > 1:
            raise ValueError(f"{self.fmt}: qweight, scales and zeros must be on one device, "
                             f"got {sorted(map(str, devices))}")
        if check_values:
            _check_values(self)
        return self


def _check_tensor(fmt: str, name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fmt}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{fmt}: {name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{fmt}: {name} has shape {tuple(t.shape)}, expected {shape} for the weight's shape")
    if not t.is_contiguous():  # the kernels index rows by the shape alone: a strided view would be misread
        raise ValueError(f"{fmt}: {name} must be contiguous (row-major), got strides {t.stride()}; "
                         f"call .contiguous() on it once")


def _check_values(qw: QuantizedWeight) -> None:
    """A checkpoint's numbers, not just its shapes: scales finite and positive (``quantize`` writes no other),
    fp8 codes not NaN (e4m3fn's only special value)."""
    bad = int((~torch.isfinite(qw.scales) | (qw.scales <= 0)).sum())
    if bad:
        raise ValueError(f"{qw.fmt}: scales must be finite and > 0, found {bad} that are not")
    if qw.fmt == "fp8":
        nan = int(torch.isnan(qw.qweight.float()).sum())
        if nan:
            raise ValueError(f"fp8: qweight holds {nan} NaN code(s) (bit pattern 0x7f or 0xff)")


def _check_group(k: int, group_size: int | None) -> None:
    if k % 2:
        raise ValueError(f"int4 packs two columns per byte: K (in_features) must be even, got {k}")
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"int4 needs a positive integer group_size, got {group_size!r}")
    if group_size % 2 or k % group_size:
        raise ValueError(f"int4 group_size {group_size} must be even and divide K={k}")


def _check_weight(w: torch.Tensor) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"weight must be a tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {tuple(w.shape)}")
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"weight dtype {w.dtype} is not supported; expected one of {FLOAT_DTYPES}")
    if w.numel() == 0:
        raise ValueError(f"weight is empty: shape {tuple(w.shape)}")
    bad = int((~torch.isfinite(w)).sum())
    if bad:  # a NaN would make its row's scale meaningless and quietly round the rest of the row
        raise ValueError(f"weight has {bad} non-finite value(s) (NaN or inf) of {w.numel()}: nothing to quantize")
    return w.float()


def _safe_scale(span: torch.Tensor, levels: float) -> torch.Tensor:
    """``span / levels``, with 1 where that is 0: an all-zero row or group quantizes to exact zeros, and so
    does one so small (below about 1e-43) that its scale would underflow float32 to 0 and decode as NaN."""
    s = span / levels
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8: ``scale = absmax / 127``, codes in -127..127."""
    wf = _check_weight(w)
    s = _safe_scale(wf.abs().amax(dim=1), 127.0)
    q = torch.clamp(torch.round(wf / s[:, None]), -127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, s, None, None, tuple(w.shape))


def quantize_fp8(w: torch.Tensor) -> QuantizedWeight:
    """Per-output-channel fp8 e4m3fn: ``scale = absmax / 448`` maps each row's largest value onto fp8's."""
    wf = _check_weight(w)
    s = _safe_scale(wf.abs().amax(dim=1), FP8_MAX)
    # clamp: absmax / (absmax / 448) can round to just above 448, and e4m3fn has no infinity to saturate to.
    q = torch.clamp(wf / s[:, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", q, s, None, None, tuple(w.shape))


def quantize_int4(w: torch.Tensor, group_size: int = 128, symmetric: bool = True) -> QuantizedWeight:
    """Group-wise int4 along K, packed two codes per byte (see the module docstring)."""
    wf = _check_weight(w)
    n, k = wf.shape
    _check_group(k, group_size)
    g = wf.view(n, k // group_size, group_size)
    if symmetric:
        s = _safe_scale(g.abs().amax(dim=2), 7.0)
        q = torch.clamp(torch.round(g / s[..., None]), -8, 7) + 8
        zeros = None
    else:
        lo = g.amin(dim=2).clamp(max=0.0)
        hi = g.amax(dim=2).clamp(min=0.0)
        s = _safe_scale(hi - lo, 15.0)
        z = torch.clamp(torch.round(-lo / s), 0, 15)
        q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, 15)
        zeros = z.to(torch.uint8)
    packed = pack_int4(q.view(n, k).to(torch.uint8))
    return QuantizedWeight("int4", packed, s, zeros, group_size, (n, k))


def quantize(w: torch.Tensor, fmt: str, group_size: int = 128, symmetric: bool = True) -> QuantizedWeight:
    """Dispatch on ``fmt``; ``group_size`` and ``symmetric`` apply to int4 only."""
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "fp8":
        return quantize_fp8(w)
    if fmt == "int4":
        return quantize_int4(w, group_size, symmetric)
    raise ValueError(f"unknown quantization format {fmt!r}; expected one of {FORMATS}")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` uint8 codes in 0..15 -> ``[N, K // 2]`` bytes, column ``2j`` in the low nibble of byte ``j``."""
    if q.dtype != torch.uint8 or q.dim() != 2:
        raise ValueError(f"pack_int4 takes a 2-D uint8 tensor, got {q.dtype} of shape {tuple(q.shape)}")
    if q.shape[1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got {q.shape[1]}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError(f"pack_int4: codes must be in 0..15, found {int(q.max())}")
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: ``[N, K // 2]`` bytes -> ``[N, K]`` uint8 codes."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"unpack_int4 takes a 2-D uint8 tensor, got {packed.dtype} of shape {tuple(packed.shape)}")
    return torch.stack((packed & 0xF, packed >> 4), dim=2).view(packed.shape[0], -1)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full-precision ``[N, K]`` weight the codes stand for (computed in float32, returned in ``dtype``).
    Every CPU forward runs this, so only shapes and dtypes are checked; values were checked at build or load."""
    qw.validate(check_values=False)
    if qw.fmt == "int4":
        q = unpack_int4(qw.qweight).float()
        z = 8.0 if qw.zeros is None else qw.zeros.float().repeat_interleave(qw.group_size, dim=1)
        w = (q - z) * qw.scales.repeat_interleave(qw.group_size, dim=1)
    else:
        w = qw.qweight.float() * qw.scales[:, None]
    return w.to(dtype)


def quant_linear_reference(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(qw)^T (+ bias)`` for ``x: [..., K]``, accumulated in float32 and returned in ``x.dtype``:
    the CPU path of a quantized linear layer and the oracle the Triton kernels are tested against."""
    n, k = qw.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight expects K={k}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not supported; expected one of {FLOAT_DTYPES}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({n},)")
    y = x.float() @ dequantize(qw).to(x.device).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
