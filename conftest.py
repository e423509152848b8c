"""Repository-wide pytest setup (unit tests and nbval notebooks alike).

Without a GPU, Triton kernels run on CPU tensors under Triton's interpreter, which must be switched on
*before* triton is first imported — so here, before any test module or notebook kernel starts.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _retry_kernel_starts() -> None:
    """nbval starts one Jupyter kernel per notebook. Now and then a fresh kernel dies before it answers (seen
    once in CI: "Kernel died before replying to kernel_info", the notebook then passing when run again; a
    kernel's ZeroMQ ports are picked free and bound a moment later, so two kernels starting at once on the two
    xdist workers can race for one). A kernel that never started has run none of the notebook, so starting
    another is safe: up to three tries, each failure reported on stderr. Any failure inside the notebook
    itself is untouched."""
    try:
        import nbval.kernel as nbk
    except ImportError:  # the unit tests run without nbval too
        return
    start = nbk.RunningKernel.__init__

    def init(self, *args, **kwargs):
        for attempt in range(1, 4):
            try:
                return start(self, *args, **kwargs)
            except RuntimeError as e:
                if attempt == 3 or "Kernel died" not in str(e) and "didn't respond" not in str(e):
                    raise
                print(f"nbval: kernel start failed ({e}); starting another (try {attempt + 1} of 3)",
                      file=sys.stderr)

    nbk.RunningKernel.__init__ = init


_retry_kernel_starts()
