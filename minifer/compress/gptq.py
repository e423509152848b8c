"""GPTQ (Frantar et al., 2023): round the weights so that the layer's *outputs* change least on real inputs.

Round-to-nearest (RTN) minimises each weight's own error. What matters is the output error of the layer on
the activations it will see: for inputs ``X [n, K]`` and a row ``w`` of the weight quantized to ``q``,

    || X w^T - X q^T ||^2 / n  =  (w - q) H (w - q)^T / 2,        H = 2 X^T X / n   (K x K)

so errors along directions the inputs rarely excite cost little, and errors in correlated inputs can cancel.
GPTQ quantizes the columns (inputs) of ``W`` one at a time, left to right, and after rounding column ``j``
moves the columns not yet quantized to absorb its error, as far as their correlation with ``j`` allows
(the Optimal Brain Quantization update, with ``U`` the upper Cholesky factor of ``H^-1``):

    err_j       = (w_j - q_j) / U[j, j]
    w_{j+1:}   -= err_j  U[j, j+1:]

The updates inside a block of 128 columns are applied at once; the rest of the matrix gets the whole
block's errors in one matrix product when the block is done ("lazy batch" updates, same result, fast).
``H`` is damped by ``DAMP`` times its mean diagonal so its Cholesky factor is stable and the compensation
does not overfit the calibration set; an input that is zero on every calibration token gets ``H[j, j] = 1``
and a zero weight. The paper uses 1%; on windows of the *training* split (not the held-out text) 10% gave a
slightly lower perplexity for the bundled target at every calibration size we tried (8 x 256 to 64 x 512).

Formats and groups. The grid a column is rounded to comes from ``formats.py``'s rules, computed on the
weights as updated so far: for int4, when the loop reaches the first column of a group, from that group's
``g`` columns; for int8 and fp8 (one scale per row), from the whole row before the first column. The
result is a ``QuantizedWeight`` in exactly the layout of the round-to-nearest one.

Column order (``act_order``, AutoGPTQ's ``desc_act``; on by default in ``gptq_quantize_model``). The columns
quantized last have the fewest columns left to absorb their error, so GPTQ goes through them in order of
decreasing ``H[j, j]`` (the inputs with the most energy first). A group's columns are then no longer
visited together, so every int4 group's grid is fixed from the weights *before* any update ("static
groups"): the stored layout stays contiguous groups along K, and kernels need no permutation index.

Calibration, layer by layer. Hooks record the inputs of a decoder layer's four linears while the layer runs
on the calibration activations; each linear is quantized with its ``H``; the layer is then run again,
quantized, to produce the inputs of the next layer. Every layer thus compensates for the errors of the
layers before it. The calibration tokens are the caller's: the course takes them from the *training* split
(``minifer.eval.calibration_data``), never from the held-out text the result is judged on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minifer.attention.layer import causal_backend
from minifer.quantization.formats import FP8_MAX, QuantizedWeight, dequantize, pack_int4, quantize
from minifer.quantization.linear import LINEAR_NAMES, QuantKernel, QuantLinear, set_module
from minifer.quantization.model import QuantizationConfig, quantize_model

DAMP = 0.1  # times the mean of diag(H), added to its diagonal


class _Grid:
    """The quantization grid of one group of columns (every row has its own scale and zero point)."""

    def __init__(self, w: torch.Tensor, fmt: str, symmetric: bool) -> None:
        qw = quantize(w, fmt, w.shape[1], symmetric)  # formats.py's scale and zero-point rules
        self.fmt, self.scale = fmt, qw.scales.reshape(-1)
        self.zero = qw.zeros.reshape(-1).float() if qw.zeros is not None else torch.full_like(self.scale, 8.0)
        self.zeros = qw.zeros

    def codes(self, col: torch.Tensor) -> torch.Tensor:
        if self.fmt == "int4":
            return torch.clamp(torch.round(col / self.scale) + self.zero, 0, 15)
        if self.fmt == "int8":
            return torch.clamp(torch.round(col / self.scale), -127, 127)
        return torch.clamp(col / self.scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()

    def value(self, codes: torch.Tensor) -> torch.Tensor:
        return (codes - self.zero) * self.scale if self.fmt == "int4" else codes * self.scale


def gptq_quantize_weight(w: torch.Tensor, h: torch.Tensor, fmt: str, group_size: int | None = None,
                         symmetric: bool = True, damp: float = DAMP, block_size: int = 128,
                         act_order: bool = False) -> QuantizedWeight:
    """GPTQ of one weight ``[N, K]`` with the Hessian ``H = 2 X^T X / n`` ``[K, K]`` of its inputs."""
    w = w.detach().float().clone()
    n, k = w.shape
    g = group_size if fmt == "int4" else k
    block = max(block_size // g, 1) * g if g < k else block_size  # a group never straddles two blocks
    h = h.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    grids: dict[int, _Grid] = {}
    if act_order:  # a group's columns are no longer visited together: fix its grid before any update
        grids = {gi: _Grid(w[:, gi * g : gi * g + g], fmt, symmetric) for gi in range(k // g)}
    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h.diagonal().add_(damp * torch.diagonal(h).mean())
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    codes = torch.empty_like(w)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        err = torch.empty(n, i2 - i1, device=w.device)
        for j in range(i1, i2):
            gi = int(perm[j]) // g
            if gi not in grids:
                grids[gi] = _Grid(w[:, j : j + g], fmt, symmetric)
            grid = grids[gi]
            codes[:, j] = grid.codes(w[:, j])
            err[:, j - i1] = (w[:, j] - grid.value(codes[:, j])) / u[j, j]
            w[:, j:i2] -= err[:, j - i1, None] * u[j, j:i2][None, :]
        w[:, i2:] -= err @ u[i1:i2, i2:]
    codes[:, perm] = codes.clone()
    grids = [grids[gi] for gi in range(k // g)]
    scales = torch.stack([gr.scale for gr in grids], dim=1)
    if fmt == "int4":
        zeros = None if symmetric else torch.stack([gr.zeros.reshape(-1) for gr in grids], dim=1)
        return QuantizedWeight("int4", pack_int4(codes.to(torch.uint8)), scales, zeros, g, (n, k)).validate()
    qdtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    return QuantizedWeight(fmt, codes.to(qdtype), scales.reshape(-1), None, None, (n, k)).validate()


def output_error(w: torch.Tensor, qw: QuantizedWeight, h: torch.Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T)``: the layer's squared output error on the calibration inputs (x 2 / n)."""
    d = w.detach().float() - dequantize(qw).to(w.device)
    return float(((d @ h.float()) * d).sum())


def gptq_quantize_model(model: nn.Module, method: str = "int4", group_size: int = 128, symmetric: bool = True, *,
                        calib_data: torch.Tensor, kernel: QuantKernel | None = None, damp: float = DAMP,
                        block_size: int = 128, act_order: bool = True, true_sequential: bool = False,
                        batch_size: int = 8) -> QuantizationConfig:
    """``quantize_model`` with GPTQ in place of round-to-nearest: the same formats, groups and result (a model
    whose decoder linears are ``QuantLinear``), calibrated on ``calib_data``, token ids ``[num_sequences,
    seq_len]``. The returned config's ``calibration`` says what the calibration saw and, per linear, its output
    error relative to round-to-nearest's on the same inputs. ``true_sequential``: quantize q/k/v first, then
    o_proj on inputs computed with the quantized q/k/v, and so on (each linear also compensates for the linears
    before it in the same layer)."""
    if not isinstance(calib_data, torch.Tensor) or calib_data.dim() != 2 or calib_data.dtype != torch.long:
        raise ValueError("calib_data must be token ids [num_sequences, seq_len] (int64), got "
                         f"{getattr(calib_data, 'dtype', type(calib_data).__name__)} of shape "
                         f"{tuple(getattr(calib_data, 'shape', ()))}")

    def calibrate(model: nn.Module, fmt: str, groups: dict[str, int | None], symmetric: bool) -> dict[str, Any]:
        return _quantize_layers(model, fmt, groups, symmetric, calib_data, damp, block_size, act_order,
                                true_sequential, batch_size)

    return quantize_model(model, method, group_size, symmetric, kernel=kernel, calibrate=calibrate)


@torch.no_grad()
def _quantize_layers(model: nn.Module, fmt: str, groups: dict[str, int | None], symmetric: bool,
                     calib_data: torch.Tensor, damp: float, block_size: int, act_order: bool,
                     true_sequential: bool, batch_size: int) -> dict[str, Any]:
    """GPTQ of the decoder linears named in ``groups`` (name -> int4 group size), layer by layer, in place."""
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    chunks = list(calib_data.to(device).split(batch_size))
    xs = [model.model.embed_tokens(c.reshape(-1)) for c in chunks]
    rope = [model.model.rotary(torch.arange(c.shape[1], device=device).repeat(c.shape[0]), dtype) for c in chunks]
    ratios: dict[str, float] = {}

    def run(layer: nn.Module) -> list[torch.Tensor]:
        return [layer(x, cos, sin, causal_backend(model, *c.shape)[0]) for x, (cos, sin), c in zip(xs, rope, chunks)]

    steps = tuple((n,) for n in LINEAR_NAMES) if true_sequential else (LINEAR_NAMES,)
    for i, layer in enumerate(model.model.layers):
        for names in steps:
            mods = {n: layer.get_submodule(n) for n in names}
            hess = {n: torch.zeros(m.in_features, m.in_features, device=device) for n, m in mods.items()}
            rows = dict.fromkeys(mods, 0)

            def record(name):
                def hook(module, inputs, output):
                    x = inputs[0].reshape(-1, module.in_features).float()
                    hess[name].addmm_(x.T, x)
                    rows[name] += x.shape[0]
                return hook

            hooks = [m.register_forward_hook(record(n)) for n, m in mods.items()]
            try:
                run(layer)
            finally:
                for hk in hooks:
                    hk.remove()
            for n, m in mods.items():
                full = f"model.layers.{i}.{n}"
                h = 2 * hess[n] / rows[n]
                qw = gptq_quantize_weight(m.weight, h, fmt, groups[full], symmetric, damp, block_size, act_order)
                rtn = quantize(m.weight.detach(), fmt, groups[full] or 128, symmetric)
                ratios[full] = output_error(m.weight, qw, h) / max(output_error(m.weight, rtn, h), 1e-30)
                set_module(model, full, QuantLinear(qw, None if m.bias is None else m.bias.detach().clone()))
        xs = run(layer)
    values = sorted(ratios.values())
    return {"method": "gptq", "sequences": calib_data.shape[0], "seq_len": calib_data.shape[1],
            "tokens": calib_data.numel(), "damp": damp, "block_size": block_size, "act_order": act_order,
            "true_sequential": true_sequential,
            "output_error_vs_rtn": {"median": values[len(values) // 2], "max": values[-1], "per_layer": ratios}}
