"""Repository-wide pytest setup (unit tests and nbval notebooks alike).

Without a GPU, Triton kernels run on CPU tensors under Triton's interpreter, which must be switched on
*before* triton is first imported — so here, before any test module or notebook kernel starts.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
