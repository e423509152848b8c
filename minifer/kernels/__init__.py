"""Triton kernels, each beside the PyTorch reference it must match.

Triton publishes Linux wheels only. ``HAS_TRITON`` says whether it imported; the CPU path never needs
it. Kernels run on a CUDA GPU, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set
*before* triton is imported), which is how the tests and notebooks check them on a laptop. ``aot.py``
compiles them ahead of time for sm_80 / sm_90 with no GPU present.
"""

from __future__ import annotations

import os

try:
    import triton  # noqa: F401

    HAS_TRITON = True
    TRITON_ERROR = ""
except ImportError as e:  # macOS, or a minimal install
    HAS_TRITON = False
    TRITON_ERROR = f"Triton is not installed ({e}); it publishes Linux wheels only, so the CPU path is used"

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
