"""fp8 e4m3 in Triton kernels: its bits to float32 in registers, and whether the GPU converts it in hardware.
Shared by the 8-bit KV cache's decode attention (``paged_attention.py``) and the fused weight kernels
(``minifer/kernels/quant_matmul.py``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def fp8_to_f32(b, NATIVE: tl.constexpr):
    """fp8 e4m3fn bits (as int8) -> float32. NATIVE (sm_89+): the hardware conversion. Otherwise the value
    times 2^-8, exactly: sign to bit 15, exponent and mantissa to bits 13..7 of a float16 (callers fold the 256
    into the scale)."""
    if NATIVE:
        f = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        f = ((b.to(tl.int32) << 7) & 0xBF80).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return f


@functools.lru_cache(maxsize=None)
def fp8_native(device: torch.device) -> bool:
    """sm_89+ converts e4m3 in hardware; sm_80 (and the interpreter, by default) decode the bits."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
