"""Linear layers whose float weights are packed once, in the layout the CPU's matmul kernels read.

On the CPU ``nn.Linear`` hands its ``[out, in]`` weight to the BLAS library, which re-lays it out ("packs" it into
the blocked order its inner loop reads) on every call: for small matrices at a few dozen rows, about as much work as
the multiplication. ``PackedLinear`` packs the weight once, with oneDNN (``mkldnn``), when the model is loaded. A
single row (batch-1 decode) keeps the plain matrix-vector product, which needs no packing and is faster there, so
both copies are kept (twice the decoder's float weight memory; the course's models are small).

A switch (``LLM(compilation_config={"pack_weights": True})``), tested token-identical to the eager model on greedy
float32 generation; the eager model stays what a learner reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MIN_PACKED_ROWS = 2  # fewer rows than this: the plain matrix-vector product (no packing to amortise)


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN packs float32 and bfloat16 weights on the CPU, when this torch was built with it."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward on a weight packed once for oneDNN (see the module docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same tensor (shared, not copied): rows below MIN_PACKED_ROWS, and state_dict
        self.bias = linear.bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows < MIN_PACKED_ROWS or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1), self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replace every float ``nn.Linear`` of ``model`` (the decoder's projections and ``lm_head``) by a
    ``PackedLinear`` over the same weight, in place. Returns how many were packed (0 where oneDNN cannot)."""
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and can_pack(m.weight)]
    for name, m in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, PackedLinear(m))
    return len(targets)
