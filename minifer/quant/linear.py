"""``QuantLinear`` and ``quantize_model``: weight-only quantization of a loaded decoder, in place.

Which layers. Every ``nn.Linear`` of the decoder layers — ``self_attn.qkv_proj``, ``self_attn.o_proj``,
``mlp.gate_up_proj``, ``mlp.down_proj`` — becomes a ``QuantLinear``. They are 89% of the bundled target's
parameters and 82% of Qwen3-1.7B's, and a decode step reads all of them once per token. Two layers stay in
the model's dtype, as in GPTQ, AWQ and vLLM's defaults:

- ``embed_tokens`` is a lookup: a step reads one row per token, not the matrix, so quantizing it saves
  memory but no bandwidth;
- ``lm_head`` writes the logits directly: its error is not averaged away by later layers, and the softmax
  over the whole vocabulary makes it the most sensitive projection (with tied embeddings it *is*
  ``embed_tokens``).

Group sizes. int4 scales groups of ``group_size`` consecutive inputs (``formats.py``), so the group must
divide K. A power-of-two ``group_size`` that does not divide a layer's K falls back, for that layer only,
to the largest power of two that does (``gcd``): the bundled target's ``down_proj`` has K = 704 = 11 x 64,
so "int4 g128" runs it at g64, and the returned ``QuantizationConfig`` lists every layer's group. The
fallback stops at ``MIN_FALLBACK_GROUP`` (32): a smaller group stores a float32 scale per few codes (group 2
costs 2.5 bytes a weight, more than bf16) and the GPU's ``tl.dot`` kernels need whole 32-code K-steps. Any
other ``group_size`` that does not divide K, and an odd K (no two codes to pack), raise ``ValueError`` naming
the layer.

CPU and GPU. On CUDA (with Triton) ``QuantLinear`` calls the fused dequantize-matmul kernel of
``minifer.kernels.quant_matmul``, which reads the packed codes and never materialises the full weight. On
the CPU it runs ``quant_linear_reference``: the weight is dequantized to float32 on every call and nothing
is cached. That is slower than a plain ``nn.Linear`` (it is there for correctness, not speed) but honest:
the model holds only the quantized bytes that ``weight_bytes`` counts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from minifer.quant.formats import FORMATS, QuantizedWeight, quant_linear_reference, quantize

LINEAR_NAMES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
CALIBRATIONS = ("rtn", "gptq")  # rtn: round-to-nearest, no data
_QUANT_BUFFERS = ("qweight", "scales", "zeros")


class QuantLinear(nn.Module):
    """A linear layer whose weight is a ``QuantizedWeight``: codes, scales and zero points held as buffers
    (nothing to train), plus the optional bias in the model's dtype. ``forward(x)`` maps ``[..., K]`` to
    ``[..., N]`` in ``x``'s dtype."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
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
    def from_linear(cls, linear: nn.Linear, fmt: str, group_size: int = 128, symmetric: bool = True) -> QuantLinear:
        """Round-to-nearest quantization of an ``nn.Linear`` (``group_size``/``symmetric``: int4 only)."""
        qw = quantize(linear.weight.detach(), fmt, group_size, symmetric)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(qw, bias)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        return QuantizedWeight(self.fmt, self.qweight, self.scales, self.zeros, self.group_size,
                               (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from minifer.kernels import HAS_TRITON

            if HAS_TRITON:
                from minifer.kernels.quant_matmul import quant_matmul

                return quant_matmul(x, self.quantized_weight, self.bias)
        return quant_linear_reference(x, self.quantized_weight, self.bias)

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


@dataclass
class QuantizationConfig:
    """What ``quantize_model`` did, and the ``quantization_config.json`` of a saved checkpoint.

    ``layers`` maps each quantized module name to its ``shape`` ``[N, K]``, its ``group_size`` (int4: the one
    actually used, see the module docstring; else None) and whether it has a ``bias``. ``kept`` names the
    linear and embedding layers left in full precision. ``calibration`` describes the data a calibrated method saw."""

    format: str
    group_size: int | None
    symmetric: bool
    method: str = "rtn"
    layers: dict[str, dict[str, Any]] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    calibration: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": "minifer", **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantizationConfig:
        names = {"format", "group_size", "symmetric", "method", "layers", "kept", "calibration"}
        missing = sorted({"format", "group_size", "symmetric", "method", "layers"} - d.keys())
        if missing:
            raise ValueError(f"quantization_config is missing {', '.join(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})

    def summary(self) -> str:
        groups = sorted({v["group_size"] for v in self.layers.values()} - {None})
        g = f" g{'/'.join(map(str, groups))} {'sym' if self.symmetric else 'asym'}" if groups else ""
        return f"{self.format}{g} ({self.method}): {len(self.layers)} linear layers quantized, kept {self.kept}"


def decoder_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The decoder layers' projections by module name (``model.layers.3.mlp.down_proj``)."""
    return {f"model.layers.{i}.{n}": layer.get_submodule(n)
            for i, layer in enumerate(model.model.layers) for n in LINEAR_NAMES}


MIN_FALLBACK_GROUP = 32


def _group_for(name: str, k: int, group_size: int) -> int:
    if k % 2:
        raise ValueError(f"int4 packs two codes per byte, so K must be even: {name} has K={k}; quantize it "
                         f"with int8 or fp8, or keep it in full precision")
    if k % group_size == 0:
        return group_size
    fallback = math.gcd(k, group_size)
    if group_size & (group_size - 1) == 0 and fallback >= MIN_FALLBACK_GROUP:
        return fallback
    if group_size & (group_size - 1) == 0:
        raise ValueError(f"int4 group_size={group_size} does not divide K={k} of {name}, and the largest power of "
                         f"two that does ({fallback}) is below {MIN_FALLBACK_GROUP}: its scales would cost more "
                         f"than the 4-bit codes save; use a group size that divides K, or int8 / fp8")
    raise ValueError(f"int4 group_size={group_size} does not divide K={k} of {name}; use a group size that "
                     f"divides every layer's K, or a power of two (a layer it does not divide then uses the "
                     f"largest power of two that does, down to {MIN_FALLBACK_GROUP})")


def check_quantization(method: str, group_size: int = 128, calibration: str | None = None) -> None:
    """Raise ``ValueError`` for an unknown format or calibration, or a group size that cannot work."""
    if method not in FORMATS:
        raise ValueError(f"unknown quantization {method!r}: use one of {', '.join(FORMATS)}")
    if calibration not in (None, *CALIBRATIONS):
        raise ValueError(f"unknown calibration {calibration!r}: use None (round-to-nearest) or 'gptq'")
    if method == "int4" and (not isinstance(group_size, int) or group_size < 2 or group_size % 2):
        raise ValueError(f"int4 group_size must be a positive even integer, got {group_size!r}")


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str = "int8", group_size: int = 128, symmetric: bool = True,
                   calibration: str | None = None, calib_data: torch.Tensor | None = None,
                   **gptq_kw) -> QuantizationConfig:
    """Replace every decoder-layer ``nn.Linear`` of ``model`` (a ``LlamaForCausalLM``) by a ``QuantLinear``.

    Args:
        method: the weight format, ``"int8"``, ``"int4"`` or ``"fp8"`` (``formats.py``).
        group_size, symmetric: int4 only (see the module docstring for K that ``group_size`` does not divide).
        calibration: None or ``"rtn"`` (round-to-nearest, no data) or ``"gptq"`` (``gptq.py``), which needs
            ``calib_data``: token ids ``[num_sequences, seq_len]`` (``gptq.calibration_data`` makes them from
            the training split); ``gptq_kw`` go to ``gptq.gptq_quantize_model``.

    The model is changed in place; the returned ``QuantizationConfig`` lists what was quantized and how (it
    is also stored as ``model.quantization_config``).
    """
    check_quantization(method, group_size, calibration)
    if gptq_kw and calibration != "gptq":
        raise ValueError(f"{sorted(gptq_kw)} apply to calibration='gptq' only")
    if hasattr(model, "quantization_config"):
        raise ValueError(f"model is already quantized ({model.quantization_config.summary()})")
    targets = decoder_linears(model)
    wrong = {n: type(m).__name__ for n, m in targets.items() if not isinstance(m, nn.Linear)}
    if wrong:
        raise ValueError(f"expected nn.Linear layers, found {wrong}")
    groups = {n: _group_for(n, m.in_features, group_size) if method == "int4" else None for n, m in targets.items()}
    cfg = QuantizationConfig(method, group_size if method == "int4" else None, symmetric if method == "int4" else True,
                             calibration or "rtn")
    if calibration == "gptq":
        from minifer.quant.gptq import gptq_quantize_model

        if calib_data is None:
            raise ValueError("calibration='gptq' needs calib_data: token ids [num_sequences, seq_len] "
                             "(see minifer.quant.gptq.calibration_data)")
        cfg.calibration = gptq_quantize_model(model, method, groups, cfg.symmetric, calib_data, **gptq_kw)
    else:
        for name, lin in targets.items():
            set_module(model, name, QuantLinear.from_linear(lin, method, groups[name] or group_size, symmetric))
    cfg.layers = {n: {"shape": [m.out_features, m.in_features], "group_size": groups[n], "bias": m.bias is not None}
                  for n, m in targets.items()}
    cfg.kept = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    model.quantization_config = cfg
    return cfg


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the weights the model actually stores, in three parts (a tensor shared by two modules, as
    tied embeddings are, counts once; RoPE tables and the KV cache are not weights and do not count):

    - ``decoder_linears``: the decoder layers' projection matrices — for a ``QuantLinear`` its codes, scales
      and zero points (``QuantizedWeight.nbytes``), for an ``nn.Linear`` its weight; biases excluded;
    - ``embed_lm_head``: ``embed_tokens`` and ``lm_head`` (kept in the model's dtype);
    - ``other``: norm weights and biases.

    ``*_params`` count the parameters each part stands for (``N x K`` for a quantized matrix), so the bytes
    of any other format are ``params x bytes per parameter`` (bf16: 2).
    """
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
