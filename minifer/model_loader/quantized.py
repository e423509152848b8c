"""Saving and loading a quantized model: quantize once (GPTQ takes a while), serve many times.

A quantized checkpoint is a folder::

    config.json, generation_config.json,      copied unchanged from the model's own folder, so the
    tokenizer.json, tokenizer_config.json ...  architecture and the tokenizer load exactly as before
    quantization_config.json                   QuantizationConfig.to_dict(): "quant_method": "minifer",
                                               format, group_size, symmetric, method (rtn | gptq),
                                               layers {name: {shape [N, K], group_size, bias}}, kept,
                                               calibration
    model.safetensors                          every tensor under minifer's module names:
        model.layers.{i}.self_attn.qkv_proj.qweight   int8 [N, K] | uint8 [N, K/2] | float8_e4m3fn [N, K]
        model.layers.{i}.self_attn.qkv_proj.scales    float32 [N] | [N, K/g]
        model.layers.{i}.self_attn.qkv_proj.zeros     uint8 [N, K/g] (asymmetric int4 only)
        model.layers.{i}.self_attn.qkv_proj.bias      (when the layer has one)
        ... the same for o_proj, gate_up_proj, down_proj of every layer ...
        model.embed_tokens.weight, model.layers.{i}.*norm.weight, model.norm.weight,
        lm_head.weight (absent when tied)           in the model's dtype

The projections stay fused, as minifer runs them, so this is not a transformers checkpoint, and
``quantization_config`` has its own file, where transformers will not try to interpret it. For a folder vLLM and
transformers read, write int4 models in the GPTQ layout (``minifer.compress.save_gptq``, offline).

``LLM(folder)`` loads such a folder, or a GPTQ checkpoint (``load_model``). Loading trusts nothing: every layer
must exist in the architecture with the recorded shape and its tensors must agree (``QuantizedWeight.validate``);
a mismatch raises ``ModelLoadError`` naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from minifer.model_loader import ModelLoadError, build_model, read_checkpoint
from minifer.model_loader.quant_fill import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    copy_checkpoint_files,
    fill_quantized,
    unwrap_llm,
)
from minifer.models.llama import LlamaForCausalLM
from minifer.quantization.linear import QuantKernel, set_quant_kernel
from minifer.quantization.model import QuantizationConfig, check_quantization, kernel_for, quantize_model


def is_quantized_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def save_quantized(model, path: str | Path, source: str | Path | None = None) -> Path:
    """Write a quantized model (an ``LLM`` or a quantized ``LlamaForCausalLM``) as the folder drawn above.
    ``source``: the folder whose config and tokenizer files are copied (by default an ``LLM``'s ``model_path``)."""
    model, source = unwrap_llm(model, source)
    qcfg: QuantizationConfig | None = getattr(model, "quantization_config", None)
    if qcfg is None:
        raise ValueError("model is not quantized: call quantize_model first")
    path = copy_checkpoint_files(source, path)
    from safetensors.torch import save_file

    tied = model.config.tie_word_embeddings
    tensors = {k: t.detach().contiguous().cpu() for k, t in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt", "quantization": qcfg.format})
    (path / CONFIG_FILE).write_text(json.dumps(qcfg.to_dict(), indent=1) + "\n")
    return path


def load_quantized(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   max_positions: int | None = None) -> nn.Module:
    """Build the architecture of ``config.json`` with dummy weights (``build_model``: the same construction, RoPE
    tables and tying as a normal load), then fill it from a folder written by ``save_quantized``."""
    path = Path(path)
    try:
        qcfg = QuantizationConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
        check_quantization(qcfg.format, qcfg.group_size or 128, None if qcfg.method == "rtn" else qcfg.method)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{path / CONFIG_FILE}: {e}") from e
    device = torch.device(device)
    model = build_model(path, load_format="dummy", dtype=dtype, device=device, max_positions=max_positions)
    return fill_quantized(model, qcfg, read_checkpoint(path), path)


def is_gptq_checkpoint(path: str | Path) -> bool:
    """A checkpoint folder whose config.json says ``"quant_method": "gptq"``."""
    cfg = Path(path) / "config.json"
    if not (Path(path).is_dir() and cfg.is_file()):
        return False
    try:
        qc = json.loads(cfg.read_text()).get("quantization_config") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == "gptq"


def load_model(path: Path, quantization: str | None = None, *, load_format: str = "auto",
               quant_kernel: QuantKernel | None = None, **build_kw) -> nn.Module:
    """What ``LLM`` calls: a folder written by ``save_quantized``, or a GPTQ checkpoint (``gptq_checkpoint``),
    loads as saved (``quantization``, if given, must name its format); any other checkpoint loads with
    ``build_model`` and, when ``quantization`` is given, is quantized by round-to-nearest (``quantize_model``).
    Quantized layers multiply through ``quant_kernel`` (a weight-only ``QuantKernel``, under the activations'
    rounding for ``"w8a8"``, ``quant.model.kernel_for``; the PyTorch reference when None). ``build_kw`` goes to
    ``build_model`` (a ``model_cls`` builds a plain checkpoint only: a saved layout fixes its own modules)."""
    if quantization is not None:
        check_quantization(quantization)
    saved_layout = load_quantized if is_quantized_checkpoint(path) else None
    if saved_layout is None and is_gptq_checkpoint(path):
        from minifer.model_loader.gptq import load_gptq  # imported only for a GPTQ checkpoint

        saved_layout = load_gptq
    if load_format != "dummy" and saved_layout is not None:
        if build_kw.get("model_cls", LlamaForCausalLM) is not LlamaForCausalLM:
            raise ValueError(f"{path} is a quantized checkpoint, loaded into minifer's own modules: another model "
                             "class builds a plain checkpoint only")
        model = saved_layout(path, dtype=build_kw["dtype"], device=build_kw["device"],
                             max_positions=build_kw.get("max_positions"))
        saved = model.quantization_config.format
        if quantization not in (None, saved):
            raise ValueError(f"quantization={quantization!r}, but {path} holds a {saved} checkpoint")
        if quant_kernel is not None:
            set_quant_kernel(model, kernel_for(saved, quant_kernel))
        return model
    model = build_model(path, load_format=load_format, **build_kw)
    if quantization is not None:
        quantize_model(model, quantization, kernel=quant_kernel)
    return model
