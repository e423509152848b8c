"""``quantize_model``: quantization of a loaded decoder's linear layers, in place, by round-to-nearest.

The methods (``QUANTIZATION_METHODS``) are the weight formats of ``formats.py`` (``"int8"``, ``"int4"``, ``"fp8"``:
weight-only, the activations stay in the model's dtype) and ``"w8a8"``: int8 weights whose layers also round each
token's activations to int8 (``linear.w8a8_linear``; the module docstring of ``linear.py`` says why it is a choice
of its own). A method means the same numerics on every device.

A calibrated method (GPTQ) is an offline step before serving, as vLLM leaves it to llm-compressor and GPTQModel:
it lives in ``minifer.compress``, which hands its per-layer quantizer in through ``calibrate``; the engine core never
imports it.

int4 groups must divide K. A power-of-two ``group_size`` that does not divide a layer's K falls back, for that
layer only, to the largest power of two that does: the bundled target's ``down_proj`` has K = 704 = 11 x 64, so
"int4 g128" runs it at g64 (the ``QuantizationConfig`` lists every layer's group). The fallback stops at
``MIN_FALLBACK_GROUP`` (32): smaller groups spend too much on scales (group 2 costs 2.5 bytes a weight, more than
bf16) and the GPU's ``tl.dot`` kernels need whole 32-code K-steps. Any other group size that does not divide K,
and an odd K, raise ``ValueError`` naming the layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from minifer.quantization.formats import FORMATS
from minifer.quantization.linear import (
    QuantKernel,
    QuantLinear,
    decoder_linears,
    set_module,
    set_quant_kernel,
    w8a8_kernel,
)

QUANTIZATION_METHODS = (*FORMATS, "w8a8")  # what ``LLM(quantization=...)`` accepts
CALIBRATIONS = ("rtn", "gptq")  # the methods a saved checkpoint may name; rtn: round-to-nearest, no data


@dataclass
class QuantizationConfig:
    """What ``quantize_model`` did, and the ``quantization_config.json`` of a saved checkpoint.

    ``format`` is the quantization method (``QUANTIZATION_METHODS``; ``weight_format`` gives the weights' format, int8
    for ``"w8a8"``, so a W8A8 checkpoint reloads as W8A8). ``layers`` maps each quantized module name to its ``shape`` ``[N, K]``, its ``group_size`` (int4: the one
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


MIN_FALLBACK_GROUP = 32


def group_for(name: str, k: int, group_size: int) -> int:
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


def weight_format(method: str) -> str:
    """The format ``method``'s weights are stored in (``formats.py``): ``"w8a8"`` stores int8."""
    return "int8" if method == "w8a8" else method


def kernel_for(method: str, kernel: QuantKernel | None) -> QuantKernel | None:
    """What ``method``'s layers multiply through, given the weight-only ``kernel`` chosen for the device (None: the
    reference): W8A8 rounds the activations before it (``w8a8_kernel``), the weight-only methods use it as is."""
    return w8a8_kernel(kernel) if method == "w8a8" else kernel


def check_quantization(method: str, group_size: int = 128, calibration: str | None = None) -> None:
    """Raise ``ValueError`` for an unknown method or calibration, or a group size that cannot work."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}: use one of {', '.join(map(repr, QUANTIZATION_METHODS))} "
                         f"('int8', 'int4', 'fp8': weight-only; 'w8a8': int8 weights and per-token int8 activations)")
    if calibration not in (None, *CALIBRATIONS):
        raise ValueError(f"unknown calibration {calibration!r}: use None (round-to-nearest) or 'gptq'")
    if method == "int4" and (not isinstance(group_size, int) or group_size < 2 or group_size % 2):
        raise ValueError(f"int4 group_size must be a positive even integer, got {group_size!r}")


@torch.no_grad()
def quantize_model(model: nn.Module, method: str = "int8", group_size: int = 128, symmetric: bool = True, *,
                   kernel: QuantKernel | None = None,
                   calibrate: Callable[[nn.Module, str, dict[str, int | None], bool], dict[str, Any]] | None = None
                   ) -> QuantizationConfig:
    """Replace every decoder-layer ``nn.Linear`` of ``model`` (a ``LlamaForCausalLM``) by a ``QuantLinear``.

    Args:
        method: ``"int8"``, ``"int4"`` or ``"fp8"`` (weight-only, ``formats.py``), or ``"w8a8"`` (int8 weights,
            int8 activations per token).
        group_size, symmetric: int4 only (see the module docstring for K that ``group_size`` does not divide).
        kernel: the weight-only ``QuantKernel`` the new layers multiply through (the reference by default);
            with ``"w8a8"`` it multiplies the rounded activations (``kernel_for``).
        calibrate: a calibrated method in place of round-to-nearest, ``calibrate(model, method, groups,
            symmetric)`` (``groups``: module name -> int4 group size): it replaces the linears itself and returns
            what it saw, with its ``"method"`` (``minifer.compress.gptq_quantize_model`` passes GPTQ's).

    Returns the ``QuantizationConfig`` of what was quantized and how, also stored as ``model.quantization_config``.
    """
    check_quantization(method, group_size)
    if hasattr(model, "quantization_config"):
        raise ValueError(f"model is already quantized ({model.quantization_config.summary()})")
    targets = decoder_linears(model)
    wrong = {n: type(m).__name__ for n, m in targets.items() if not isinstance(m, nn.Linear)}
    if wrong:
        raise ValueError(f"expected nn.Linear layers, found {wrong}")
    fmt, kernel = weight_format(method), kernel_for(method, kernel)
    groups = {n: group_for(n, m.in_features, group_size) if fmt == "int4" else None for n, m in targets.items()}
    cfg = QuantizationConfig(method, group_size if fmt == "int4" else None, symmetric if fmt == "int4" else True)
    if calibrate is not None:
        cfg.calibration = calibrate(model, fmt, groups, cfg.symmetric)
        cfg.method = cfg.calibration["method"]
        if kernel is not None:
            set_quant_kernel(model, kernel)
    else:
        for name, lin in targets.items():
            set_module(model, name, QuantLinear.from_linear(lin, fmt, groups[name] or group_size, symmetric, kernel))
    cfg.layers = {n: {"shape": [m.out_features, m.in_features], "group_size": groups[n], "bias": m.bias is not None}
                  for n, m in targets.items()}
    cfg.kept = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    model.quantization_config = cfg
    return cfg
