"""Triton kernels, each beside the PyTorch reference it must match: paged attention (``paged_attention.py``), its
fp8 decoding (``fp8.py``), and the fused dequantize-matmul of quantized weights (``quant_matmul.py``, its kernels in
``quant_matmul_jit.py``), which ``quant_kernel_for`` hands a quantized model on CUDA.

``triton_available()`` alone asks if Triton imports (Linux wheels only; ``tools/no_triton``'s shim is obeyed). Kernels
run on a CUDA GPU, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set *before* triton is
imported): how tests and notebooks check them without a GPU (``minifer_course.experiments.aot`` compiles for GPUs).
"""

from __future__ import annotations

import os

import torch


def triton_available() -> tuple[bool, str]:
    """``(True, "")`` when Triton imports; else ``(False, why)``, the reason the Triton cells print when they skip."""
    try:
        import triton  # noqa: F401
    except ImportError as e:  # macOS, Windows, a minimal install, or tools/no_triton's shim
        return False, f"Triton is not installed ({e}); it publishes Linux wheels only, so the CPU path is used"
    return True, ""


HAS_TRITON, TRITON_ERROR = triton_available()
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"



def quant_kernel_for(device: torch.device | str):
    """``QuantLinear``'s kernel on ``device`` (its ``QuantKernel`` seam, ``minifer.quantization.linear``): ``quant_matmul``
    on a CUDA GPU with Triton; None elsewhere, which leaves the layer on ``quant_linear_reference``."""
    if torch.device(device).type == "cuda" and HAS_TRITON:
        from minifer.kernels.quant_matmul import quant_matmul

        return quant_matmul
    return None
