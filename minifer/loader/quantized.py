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

The projections stay fused (``qkv_proj``, ``gate_up_proj``), as minifer runs them; so the folder is not a
transformers checkpoint (transformers would look for ``q_proj``), and ``quantization_config`` lives in its
own file rather than in ``config.json``, where transformers would try to interpret it.

``LLM(folder)`` loads such a folder transparently (``load_model``). Loading trusts nothing: every layer of
``quantization_config.json`` must exist in the architecture with the recorded shape, and its tensors must
match each other (``QuantizedWeight.validate``); a mismatch raises ``ModelLoadError`` naming the tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from torch import nn

from minifer.loader import ModelLoadError, build_model, read_checkpoint
from minifer.quant.formats import QuantizedWeight
from minifer.quant.linear import QuantKernel, QuantLinear, set_module, set_quant_kernel
from minifer.quant.model import QuantizationConfig, check_quantization, quantize_model

CONFIG_FILE = "quantization_config.json"
WEIGHTS_FILE = "model.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def is_quantized_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / CONFIG_FILE).is_file()


def save_quantized(model, path: str | Path, source: str | Path | None = None) -> Path:
    """Write a quantized model (an ``LLM`` or a quantized ``LlamaForCausalLM``) as the folder drawn above.

    ``source`` is the checkpoint folder the model came from (its config.json and tokenizer files are
    copied); an ``LLM``'s own ``model_path`` by default."""
    if not isinstance(model, nn.Module):
        source = model.model_path if source is None else source
        model = model.model
    qcfg: QuantizationConfig | None = getattr(model, "quantization_config", None)
    if qcfg is None:
        raise ValueError("model is not quantized: call quantize_model first")
    if source is None or not (Path(source) / "config.json").is_file():
        raise ValueError(f"source must be the model's checkpoint folder (with config.json), got {source!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(source).iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name != CONFIG_FILE:
            shutil.copy2(f, path / f.name)
    from safetensors.torch import save_file

    tied = model.config.tie_word_embeddings
    tensors = {k: t.detach().contiguous().cpu() for k, t in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt", "quantization": qcfg.format})
    (path / CONFIG_FILE).write_text(json.dumps(qcfg.to_dict(), indent=1) + "\n")
    return path


def load_quantized(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   max_positions: int | None = None) -> nn.Module:
    """Build the architecture of ``config.json`` and fill it from a folder written by ``save_quantized``.

    The model is first built with dummy weights (``build_model``: the same construction, RoPE tables and
    tying as a normal load), then every quantized layer is replaced and every other tensor overwritten."""
    path = Path(path)
    try:
        qcfg = QuantizationConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
        check_quantization(qcfg.format, qcfg.group_size or 128, None if qcfg.method == "rtn" else qcfg.method)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{path / CONFIG_FILE}: {e}") from e
    device = torch.device(device)
    model = build_model(path, load_format="dummy", dtype=dtype, device=device, max_positions=max_positions)
    tensors = read_checkpoint(path)
    for name, spec in qcfg.layers.items():
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise ModelLoadError(f"{path}: quantized layer {name} does not exist in this architecture") from None
        if not isinstance(linear, nn.Linear):
            raise ModelLoadError(f"{path}: quantized layer {name} is a {type(linear).__name__} in this architecture, "
                                 f"not a linear layer")
        if not isinstance(spec, dict) or not {"shape", "group_size", "bias"} <= spec.keys():
            raise ModelLoadError(f"{path}: the quantization_config entry of {name} must give its shape, group_size "
                                 f"and bias, got {spec!r}")
        shape = (linear.out_features, linear.in_features)
        if list(shape) != list(spec["shape"]):
            raise ModelLoadError(f"{path}: {name} is recorded with shape {spec['shape']}, the architecture has "
                                 f"{list(shape)}")
        if bool(spec["bias"]) != (linear.bias is not None):  # Qwen2's q/k/v have biases, Llama's do not
            raise ModelLoadError(f"{path}: {name} is recorded {'with' if spec['bias'] else 'without'} a bias, but "
                                 f"the architecture's layer has {'one' if linear.bias is not None else 'none'}")
        missing = [f"{name}.{t}" for t in ("qweight", "scales") + (("zeros",) if not qcfg.symmetric else ())
                   + (("bias",) if spec["bias"] else ()) if f"{name}.{t}" not in tensors]
        if missing:
            raise ModelLoadError(f"{path}: missing tensors {missing}")
        if qcfg.symmetric and f"{name}.zeros" in tensors:
            raise ModelLoadError(f"{path}: {name}.zeros is present but quantization_config says symmetric")
        qw = QuantizedWeight(qcfg.format, tensors.pop(f"{name}.qweight"), tensors.pop(f"{name}.scales"),
                             tensors.pop(f"{name}.zeros", None), spec["group_size"], shape)
        try:
            qw.validate()
        except ValueError as e:
            raise ModelLoadError(f"{path}: tensors of {name} do not match its quantization_config entry: {e}") from e
        bias = tensors.pop(f"{name}.bias", None)
        try:
            set_module(model, name, QuantLinear(qw.to(device), None if bias is None else bias.to(device, dtype)))
        except ValueError as e:
            raise ModelLoadError(f"{path}: {name}.bias: {e}") from e
    _load_rest(model, tensors, path)
    model.quantization_config = qcfg
    return model.eval()


def _load_rest(model: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Copy the tensors that stayed in full precision, checking that they are exactly the model's parameters.
    With tied embeddings ``lm_head.weight`` is the embedding itself: a stray copy in the file is ignored, as
    the plain loader does, instead of overwriting the embedding through the tie."""
    if model.config.tie_word_embeddings:
        tensors = {k: t for k, t in tensors.items() if k != "lm_head.weight"}
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # a shape mismatch, named by torch
        raise ModelLoadError(f"{path}: {e}") from None
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [k for k in missing if k in params and not (model.config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"{path}: {WEIGHTS_FILE} does not match the model (missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]})")


def load_model(path: Path, quantization: str | None = None, *, load_format: str = "auto",
               quant_kernel: QuantKernel | None = None, **build_kw) -> nn.Module:
    """What ``LLM`` calls: a folder written by ``save_quantized`` loads as saved (``quantization``, if given,
    must name its format); any other checkpoint loads with ``build_model`` and, when ``quantization`` is
    given, is quantized by round-to-nearest (``quantize_model``). Quantized layers multiply through
    ``quant_kernel`` (``QuantKernel``; the PyTorch reference when None)."""
    if quantization is not None:
        check_quantization(quantization)
    if load_format != "dummy" and is_quantized_checkpoint(path):
        model = load_quantized(path, dtype=build_kw["dtype"], device=build_kw["device"],
                               max_positions=build_kw.get("max_positions"))
        saved = model.quantization_config.format
        if quantization not in (None, saved):
            raise ValueError(f"quantization={quantization!r}, but {path} holds a {saved} checkpoint")
        if quant_kernel is not None:
            set_quant_kernel(model, quant_kernel)
        return model
    model = build_model(path, load_format=load_format, **build_kw)
    if quantization is not None:
        quantize_model(model, quantization, kernel=quant_kernel)
    return model
