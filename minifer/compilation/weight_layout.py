"""Float linear weights stored column-major, the layout a CPU matrix-vector product streams fastest.

``nn.Linear`` keeps its weight row-major, ``[out, in]``, and computes ``x @ W.T``. For one row of ``x`` (batch-1
decode) the BLAS library then runs a transposed matrix-vector product and first re-lays the matrix out on every
call. Stored column-major (the same ``[out, in]`` values, strides ``(1, out)``), ``W.T`` is a contiguous
``[in, out]`` matrix and the product is the plain "``y += x[i] * column i``" loop, which streams the weights once,
front to back. The gain is at one row; from 16 rows on there is little (``benchmarks/results/cpu_peer.json``).

Nothing else changes: the parameters keep their shape and values, so the model code, ``state_dict`` and
``nn.Linear`` are untouched; ``F.linear`` sees the strides. A switch (``LLM(compilation_config=
{"column_major_weights": True})``), tested token-identical to the eager model; it combines with ``pack_weights``
(whose single-row path multiplies the plain weight) and with the compiled decoder (inductor reads the strides).
"""

from __future__ import annotations

import torch
from torch import nn

from minifer.compilation.packed_linear import PackedLinear


def is_column_major(weight: torch.Tensor) -> bool:
    """``weight`` ``[out, in]`` stored so that its transpose ``[in, out]`` is contiguous."""
    return weight.dim() == 2 and weight.t().is_contiguous()


def column_major_linears(model: nn.Module) -> int:
    """Re-store every float CPU linear weight of ``model`` column-major, in place (the same ``Parameter`` objects,
    so tied and shared weights stay tied). Returns how many matrices were re-stored; quantized layers (their own
    modules) and weights already column-major are left alone."""
    seen: set[int] = set()
    with torch.no_grad():
        for m in model.modules():
            weight = getattr(m, "weight", None)
            if not isinstance(m, (nn.Linear, PackedLinear)) or weight is None:
                continue
            if id(weight) in seen or weight.device.type != "cpu" or not weight.is_floating_point():
                continue
            seen.add(id(weight))
            if not is_column_major(weight):
                weight.data = weight.data.t().contiguous().t()
    return len(seen)
