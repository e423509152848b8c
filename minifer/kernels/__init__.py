"""Triton kernels, each beside the PyTorch reference it must match: paged attention (``paged_attention.py``), its
fp8 decoding (``fp8.py``), and the fused dequantize-matmul of quantized weights (``quant_matmul.py``, its kernels in
``quant_matmul_jit.py``), which ``quant_kernel_for`` hands a quantized model on CUDA.

``HAS_TRITON`` says whether Triton imported (Linux wheels only; the CPU path never needs it). Kernels run on a
CUDA GPU, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set *before* triton is imported),
which is how the tests and notebooks check them without a GPU (``minifer_course.experiments.aot`` compiles them
for GPUs).
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

    HAS_TRITON = True
    TRITON_ERROR = ""
except ImportError as e:  # macOS, or a minimal install
    HAS_TRITON = False
    TRITON_ERROR = f"Triton is not installed ({e}); it publishes Linux wheels only, so the CPU path is used"

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"



def quant_kernel_for(device: torch.device | str):
    """``QuantLinear``'s kernel on ``device`` (its ``QuantKernel`` seam, ``minifer.quantization.linear``): ``quant_matmul``
    on a CUDA GPU with Triton; None elsewhere, which leaves the layer on ``quant_linear_reference``."""
    if torch.device(device).type == "cuda" and HAS_TRITON:
        from minifer.kernels.quant_matmul import quant_matmul

        return quant_matmul
    return None
