"""Bytes of a model's decoder linears in each weight format: arithmetic shared by chapter 05's tables and the
GPU track's memory plan (``gpu_plan``), kept apart so that neither imports the other's notebook helpers."""

from __future__ import annotations

from typing import Any


def decoder_linear_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """``[N, K]`` (out x in features) of each projection of one decoder layer, fused as minifer runs them
    (the names of ``minifer.quantization.linear.LINEAR_NAMES``)."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q), "mlp.gate_up_proj": (2 * i, h),
            "mlp.down_proj": (h, i)}


def quantized_linear_bytes(n: int, k: int, fmt: str, group_size: int = 128, symmetric: bool = True) -> int:
    """Bytes an ``[n, k]`` weight takes in ``fmt`` (``"bf16"``, ``"int8"``, ``"fp8"`` or ``"int4"``) as
    ``minifer.quantization.formats`` lays it out: the codes, a float32 scale per row (int8, fp8) or per group of
    ``group_size`` inputs (int4), and a uint8 zero point per group for asymmetric int4."""
    if fmt == "bf16":
        return 2 * n * k
    if fmt in ("int8", "fp8"):
        return n * k + 4 * n
    if fmt == "int4":
        if k % 2 or group_size < 2 or k % group_size:
            raise ValueError(f"int4 needs an even K divisible by the group size, got K={k}, group_size={group_size}")
        groups = n * (k // group_size)
        return n * k // 2 + 4 * groups + (0 if symmetric else groups)
    raise ValueError(f"unknown format {fmt!r}: use bf16, int8, fp8 or int4")
