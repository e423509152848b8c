"""``QuantLinear``: a decoder's linear layer holding quantized weights, and the kernel seam it multiplies through.

Every ``nn.Linear`` of the decoder layers (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) becomes a
``QuantLinear``: most of the parameters (89% of the bundled target's), all read once per decoded token. Two layers
stay in the model's dtype, as in GPTQ, AWQ and vLLM's defaults: ``embed_tokens`` is a lookup (a step reads one row
per token, so quantizing it saves memory, not bandwidth), and ``lm_head`` writes the logits directly, with no later
layer to average its error away (with tied embeddings it *is* ``embed_tokens``).

``QuantLinear`` multiplies through the ``QuantKernel`` the engine hands in: ``LLM`` passes
``minifer.kernels.quant_kernel_for(device)``, the fused Triton dequantize-matmul on CUDA
(``minifer/kernels/quant_matmul.py``). The default, ``quant_linear_reference``, dequantizes to float32 on every
call and caches nothing: slower than ``nn.Linear``, but the model holds only the quantized bytes that
``weight_bytes`` counts.

Two schemes share the int8 weight format (symmetric codes, one scale per output channel) and differ in what the
activations are, so they are two choices of ``LLM(quantization=...)``, each the same on every device:

- ``"int8"``: weight-only (W8A16 in the literature): the activations stay in the model's dtype and the layer computes
  ``x @ dequantize(W).T`` (the reference on the CPU, the fused Triton kernel on CUDA). Its only error is the weights'
  rounding, so it is the format the quality benchmarks measure.
- ``"w8a8"``: weights *and* activations in int8 (``w8a8_linear``): each token's activations are rounded to 8 bits with
  their own scale (absmax / 127, computed at run time), vLLM's "INT8 W8A8" scheme (compressed-tensors' W8A8 preset:
  per-channel weights, dynamic per-token activations). Why it exists: on the CPU, dequantizing first makes int8
  *slower* than float32 (every step converts every weight back to float before the float GEMM), while int8 x int8
  codes multiply in an integer GEMM (``torch._int_mm``, int32 accumulate) that reads the one-byte codes directly and
  needs only a rescale per output. The price is a second rounding: it is not token-identical to ``"int8"``
  (``tests/quant/test_int8_cpu.py`` bounds both schemes' error from their quantization steps). On CUDA the
  activations are rounded the same way and handed to the Triton weight-only kernel (``w8a8_kernel``): the same
  numerics, without an int8 tensor-core GEMM (so no speed-up there; correctness first).
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch import nn

from minifer.quantization.formats import QuantizedWeight, quant_linear_reference, quantize

LINEAR_NAMES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_QUANT_BUFFERS = ("qweight", "scales", "zeros")


class QuantKernel(Protocol):
    """The seam between a quantized linear layer and the code that multiplies by it.

    ``kernel(x, qw, bias)`` returns ``x @ dequantize(qw).T + bias``: ``x`` is ``[..., K]`` in the model's dtype,
    ``qw`` a ``QuantizedWeight`` of shape ``[N, K]`` (``formats.py``), ``bias`` ``[N]`` or None; the result is
    ``[..., N]`` in ``x``'s dtype, within the format's rounding of ``quant_linear_reference`` (the reference
    implementation, which dequantizes to float32). A kernel must not change ``qw`` or keep a dequantized copy:
    the model holds only the quantized bytes."""

    def __call__(self, x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor: ...


class QuantLinear(nn.Module):
    """A linear layer whose weight is a ``QuantizedWeight``: codes, scales and zero points held as buffers
    (nothing to train), plus the optional bias in the model's dtype. ``forward(x)`` maps ``[..., K]`` to
    ``[..., N]`` in ``x``'s dtype through ``kernel`` (a ``QuantKernel``; the PyTorch reference by default, and
    whatever the engine hands in: on CUDA ``LLM`` passes the fused Triton kernel, ``minifer.kernels.quant_kernel_for``)."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, kernel: QuantKernel | None = None) -> None:
        super().__init__()
        self.kernel: QuantKernel = kernel or quant_linear_reference
        qw.validate()
        self.fmt, self.group_size = qw.fmt, qw.group_size
        self.out_features, self.in_features = qw.shape
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({self.out_features},)")
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("zeros", qw.zeros)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, group_size: int = 128, symmetric: bool = True,
                    kernel: QuantKernel | None = None) -> QuantLinear:
        """Round-to-nearest quantization of an ``nn.Linear`` (``group_size``/``symmetric``: int4 only)."""
        qw = quantize(linear.weight.detach(), fmt, group_size, symmetric)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(qw, bias, kernel)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.fmt, self.qweight, self.scales, self.zeros, self.group_size,
                               (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.quantized_weight, self.bias)

    def _apply(self, fn, recurse: bool = True):
        # ``model.to(torch.bfloat16)`` converts every floating buffer, and fp8 codes and float32 scales are
        # floating: let such calls move the quantized storage between devices but never convert it.
        before = {n: self._buffers[n] for n in _QUANT_BUFFERS if self._buffers.get(n) is not None}
        super()._apply(fn, recurse)
        for n, t in before.items():
            if self._buffers[n].dtype != t.dtype:
                self._buffers[n] = t.to(self._buffers[n].device)
        return self

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}, symmetric={self.zeros is None}" if self.fmt == "int4" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}{group}, "
                f"bias={self.bias is not None}")


_PACKED: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id(codes) -> (codes, their version, [K, N] copy)


def _codes_kn(qw: QuantizedWeight) -> torch.Tensor:
    """``qw``'s codes as a contiguous ``[K, N]`` copy, the layout ``torch._int_mm`` reads without repacking; kept
    while the codes live (redone if they change in place)."""
    codes = qw.qweight
    hit = _PACKED.get(id(codes))
    if hit is None or hit[0]() is not codes or hit[1] != codes._version:
        if hit is None:
            weakref.finalize(codes, _PACKED.pop, id(codes), None)
        hit = _PACKED[id(codes)] = (weakref.ref(codes), codes._version, codes.t().contiguous())
    return hit[2]


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's activation rounding: ``x`` ``[..., K]`` as rows ``[M, K]`` of int8 codes in -127..127 and a float32
    scale per row ``[M, 1]`` (absmax / 127, so each value is off by at most half a step, ``scale / 2``). Dynamic:
    computed from each token's own values at every call, so no calibration data is needed and one outlier token
    coarsens only its own row."""
    rows = x.reshape(-1, x.shape[-1]).float()  # (few ops: at a small model's sizes each op's overhead shows)
    scale = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True).clamp_(min=1e-12).div_(127)
    return (rows / scale).round_().to(torch.int8), scale


def _check_w8a8(qw: QuantizedWeight) -> None:
    if qw.fmt != "int8":
        raise ValueError(f"W8A8 multiplies int8 weight codes, got a {qw.fmt} weight: quantize with 'w8a8' (int8 "
                         f"weights) or use a weight-only kernel for {qw.fmt}")


def w8a8_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A ``QuantKernel`` for ``quantization="w8a8"``: ``quantize_per_token(x) @ dequantize(qw).T + bias`` for int8
    weights, returned in ``x``'s dtype.

    On the CPU the codes multiply in integers (``torch._int_mm``: int8 x int8 -> int32, exact), then one float
    rescale by both scales: the reason the scheme exists (the module docstring). On another device the activations
    are rounded the same way and multiplied by the dequantized weight in float32 (the reference, correct but not
    fast; ``w8a8_kernel`` puts the device's weight-only kernel under it)."""
    _check_w8a8(qw)
    if x.device.type != "cpu":
        return w8a8_kernel(quant_linear_reference)(x, qw, bias)
    codes, scale = quantize_per_token(x)
    y = torch._int_mm(codes, _codes_kn(qw)) * scale  # int32 * float32 -> float32
    y.mul_(qw.scales)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], -1).to(x.dtype)


def w8a8_kernel(weight_kernel: QuantKernel | None = None) -> QuantKernel:
    """The W8A8 ``QuantKernel`` over ``weight_kernel``: each token's activations rounded as ``quantize_per_token``
    does, then multiplied by ``weight_kernel`` (a weight-only ``QuantKernel``: the fused Triton kernel on CUDA, a
    learner's own). The rounded activations are handed over in ``x``'s dtype (float32 keeps ``code * scale`` to
    2^-24 of it; bfloat16 rounds it as it rounds every activation). None: ``w8a8_linear`` (the integer GEMM on the CPU)."""
    if weight_kernel is None:
        return w8a8_linear

    def kernel(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        _check_w8a8(qw)
        codes, scale = quantize_per_token(x)
        return weight_kernel((codes * scale).view(x.shape).to(x.dtype), qw, bias)

    return kernel


def decoder_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The decoder layers' projections by module name (``model.layers.3.mlp.down_proj``)."""
    return {f"model.layers.{i}.{n}": layer.get_submodule(n)
            for i, layer in enumerate(model.model.layers) for n in LINEAR_NAMES}


def set_quant_kernel(model: nn.Module, kernel: QuantKernel) -> None:
    """Run every ``QuantLinear`` of ``model`` through ``kernel`` (the engine's choice of the seam's implementation)."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.kernel = kernel


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the weights the model stores (a shared tensor, as tied embeddings, counts once), in three parts:
    ``decoder_linears`` (the projection matrices: a ``QuantLinear``'s codes, scales and zero points, an
    ``nn.Linear``'s weight; no biases), ``embed_lm_head``, and ``other`` (norm weights and biases). ``*_params``
    count the parameters each part stands for (``N x K`` for a quantized matrix): other formats' bytes are
    ``params x bytes per parameter``."""
    linear_names = set(decoder_linears(model))
    out = dict.fromkeys(("decoder_linears", "decoder_linears_params", "embed_lm_head", "embed_lm_head_params",
                         "other", "other_params"), 0)
    seen: set[int] = set()

    def add(part: str, t: torch.Tensor, params: int | None = None) -> None:
        if t is None or t.data_ptr() in seen:
            return
        seen.add(t.data_ptr())
        out[part] += t.numel() * t.element_size()
        out[part + "_params"] += t.numel() if params is None else params

    for name, mod in model.named_modules():
        if name in linear_names:
            if isinstance(mod, QuantLinear):
                qw = mod.quantized_weight
                out["decoder_linears"] += qw.nbytes()
                out["decoder_linears_params"] += mod.out_features * mod.in_features
            else:
                add("decoder_linears", mod.weight)
            add("other", mod.bias)
        elif name.endswith(("embed_tokens", "lm_head")):
            add("embed_lm_head", mod.weight)
            add("other", getattr(mod, "bias", None))
        else:
            for t in mod.parameters(recurse=False):
                add("other", t)
    out["total"] = out["decoder_linears"] + out["embed_lm_head"] + out["other"]
    out["total_params"] = out["decoder_linears_params"] + out["embed_lm_head_params"] + out["other_params"]
    return out
