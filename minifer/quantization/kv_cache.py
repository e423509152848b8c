"""A quantized KV cache: keys and values stored as 8-bit codes with one scale per token and head.

Decode reads every sequence's whole KV cache at every step, and the cache's size caps how many sequences fit at
once (chapter 02); 8 bits instead of 16 halve both. Attention dequantizes on the fly (``codes * scale``).

Layout, per layer, beside the ``[num_blocks, block_size, kv_heads, head_dim]`` code tensor (int8, or fp8
e4m3 kept as its uint8 bit pattern so that every index op works on any device):

    scales: float16 [num_blocks, block_size, kv_heads]      one per (token, head)

Per (token, head) because a token's keys never change once written, so its scale comes from its own values with
no re-quantization as a block fills, and heads differ in range (some carry large outliers). The scale costs 2
bytes per ``head_dim`` codes: (128 + 2) / 256 = 0.51 of bf16's bytes at a head_dim of 128.

- ``int8``: symmetric, ``scale = absmax / 127``, codes in [-127, 127];
- ``fp8`` (e4m3, vLLM's ``kv_cache_dtype="fp8"``): ``scale = absmax / 448`` (e4m3's largest finite value),
  3 mantissa bits: finer near zero, coarser at the top.

``kv_cache_scales="head"`` keeps instead one *static* scale per (layer, head) for keys and one for values (vLLM's
``k_scale``/``v_scale``): exactly one byte per number. They are calibrated once, at start-up, on
:data:`CALIBRATION_TEXT` (the largest magnitude seen per head, times :data:`STATIC_HEADROOM`; a later value beyond
that saturates). The price is precision, one range for every token (``python -m minifer_course.kv_quant``).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
KV_CACHE_SCALES = ("token", "head")
STATIC_HEADROOM = 2.0  # static scales cover twice the largest magnitude seen in calibration
CALIBRATION_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her dog, "
    "Max. One day, they found a big red ball in the park. \"Can we keep it?\" Lily asked her mom. Her mom smiled "
    "and said, \"Yes, but we must share it with your friends.\" The quarterly report lists revenue of 4,213 "
    "million dollars, up 12.5% from 2023; see Table 3. def mean(xs): return sum(xs) / len(xs)  # average "
    "The committee will meet on Tuesday at 10:30 to discuss the budget, the schedule and the new rules.")
_QMAX = {"int8": 127.0, "fp8": 448.0}
_MIN_SCALE = 2.0**-14  # float16's smallest normal: a scale never underflows to zero


def check_kv_cache_dtype(kv_cache_dtype: str, kv_cache_scales: str = "token") -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_scales not in KV_CACHE_SCALES:
        raise ValueError(f"kv_cache_scales must be one of {KV_CACHE_SCALES}, got {kv_cache_scales!r}")


def code_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The storage dtype of the codes (fp8 is stored as its bit pattern)."""
    return torch.int8 if kv_cache_dtype == "int8" else torch.uint8


def bytes_per_value(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int, kv_cache_scales: str = "token") -> float:
    """Bytes per cached number, scales included (static per-head scales are a few bytes per layer: none)."""
    if kv_cache_dtype == "auto":
        return torch.empty((), dtype=model_dtype).element_size()
    return 1.0 if kv_cache_scales == "head" else 1 + 2 / head_dim


def static_scale(absmax: torch.Tensor, kv_cache_dtype: str, headroom: float = STATIC_HEADROOM) -> torch.Tensor:
    """A static per-head scale (float32) from the largest magnitudes seen in calibration, with headroom."""
    return (absmax.float() * headroom / _QMAX[kv_cache_dtype]).clamp(min=_MIN_SCALE)


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str,
                scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[N, heads, head_dim]`` -> (codes of the same shape, float16 scales ``[N, heads]``). With a given
    static ``scale`` ``[heads]`` the codes use it (saturating beyond its range), and it is returned as is."""
    x32 = x.float()
    if scale is None:
        scale = (x32.abs().amax(dim=-1) / _QMAX[kv_cache_dtype]).clamp(min=_MIN_SCALE).half()
    y = x32 / scale.float()[..., None]
    if kv_cache_dtype == "int8":
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv` for gathered codes ``[..., head_dim]`` and scales ``[...]``."""
    values = codes.float() if kv_cache_dtype == "int8" else codes.view(torch.float8_e4m3fn).float()
    return (values * scales.float()[..., None]).to(dtype)
