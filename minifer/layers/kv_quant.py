"""A quantized KV cache: keys and values stored as 8-bit codes with one scale per token and head.

Decode reads the whole KV cache of every sequence at every step, and the cache's size caps how many
sequences fit at once (chapter 02). Storing it in 8 bits instead of 16 halves both: twice the sequences in
the same memory, half the bytes per decode step. Attention dequantizes on the fly (``codes * scale``).

Layout, per layer, beside the ``[num_blocks, block_size, kv_heads, head_dim]`` code tensor (int8, or fp8
e4m3 kept as its uint8 bit pattern so that every index op works on any device):

    scales: float16 [num_blocks, block_size, kv_heads]      one per (token, head)

Why per (token, head): a token's keys are written once and never change, so its scale can be chosen from
its own values as it is written, with no re-quantization when a block fills up; and heads differ in range
(some carry large outliers) so they do not share one. The scale costs 2 bytes per ``head_dim`` codes:
(128 + 2) / 256 bytes of bf16 = 0.51 for a head_dim of 128.

- ``int8``: symmetric, ``scale = absmax / 127``, codes in [-127, 127];
- ``fp8`` (e4m3): ``scale = absmax / 448`` (e4m3's largest finite value), 3 mantissa bits: finer near zero,
  coarser at the top, the format vLLM's ``kv_cache_dtype="fp8"`` uses.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
_QMAX = {"int8": 127.0, "fp8": 448.0}
_MIN_SCALE = 2.0**-14  # float16's smallest normal: a scale never underflows to zero


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def code_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The storage dtype of the codes (fp8 is stored as its bit pattern)."""
    return torch.int8 if kv_cache_dtype == "int8" else torch.uint8


def bytes_per_value(kv_cache_dtype: str, model_dtype: torch.dtype, head_dim: int) -> float:
    """Bytes per cached number, scales included."""
    if kv_cache_dtype == "auto":
        return torch.empty((), dtype=model_dtype).element_size()
    return 1 + 2 / head_dim


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[N, heads, head_dim]`` -> (codes of the same shape, float16 scales ``[N, heads]``)."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / _QMAX[kv_cache_dtype]).clamp(min=_MIN_SCALE).half()
    y = x32 / scale.float()[..., None]
    if kv_cache_dtype == "int8":
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8), scale


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, kv_cache_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv` for gathered codes ``[..., head_dim]`` and scales ``[...]``."""
    values = codes.float() if kv_cache_dtype == "int8" else codes.view(torch.float8_e4m3fn).float()
    return (values * scales.float()[..., None]).to(dtype)
