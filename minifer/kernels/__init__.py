"""Triton kernels, each beside the PyTorch reference it must match.

Triton publishes Linux wheels only. ``HAS_TRITON`` says whether it imported; the CPU path never needs
it. Kernels run on a CUDA GPU, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set
*before* triton is imported), which is how the tests and notebooks check them on a laptop (``minifer.bench.aot``
compiles them for GPU targets with no GPU present).
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
    """The kernel ``QuantLinear`` should multiply through on ``device`` (its ``QuantKernel`` seam,
    ``minifer.quant.linear``): the fused Triton dequantize-matmul (``quant_matmul.py``) on a CUDA GPU when Triton is
    installed; None elsewhere, which leaves the layer on its PyTorch reference (``quant_linear_reference``)."""
    if torch.device(device).type == "cuda" and HAS_TRITON:
        from minifer.kernels.quant_matmul import quant_matmul

        return quant_matmul
    return None
