"""What both quantized checkpoint layouts share: the files copied from the source folder, and filling a model's
quantized layers from tensors in minifer's int4/int8/fp8 layout (``quantized.py`` reads its own layout straight
into it, ``model_loader/gptq.py`` converts the GPTQ layout first)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from minifer.model_loader import ModelLoadError
from minifer.quantization.formats import QuantizedWeight
from minifer.quantization.linear import QuantLinear, set_module
from minifer.quantization.model import QuantizationConfig, kernel_for, weight_format

CONFIG_FILE = "quantization_config.json"
WEIGHTS_FILE = "model.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def unwrap_llm(model, source: str | Path | None) -> tuple[nn.Module, str | Path | None]:
    """``(module, source folder)`` of an ``LLM`` (its ``model`` and ``model_path``) or of a bare module."""
    if not isinstance(model, nn.Module):
        return model.model, model.model_path if source is None else source
    return model, source


def copy_checkpoint_files(source: str | Path | None, path: str | Path) -> Path:
    """Create ``path`` and copy into it every file of ``source`` but its weights and quantization config:
    config.json, generation_config.json and the tokenizer's files, so the copy loads as the source did."""
    if source is None or not (Path(source) / "config.json").is_file():
        raise ValueError(f"source must be the model's checkpoint folder (with config.json), got {source!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(source).iterdir()):
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name != CONFIG_FILE:
            shutil.copy2(f, path / f.name)
    return path


def fill_quantized(model: nn.Module, qcfg: QuantizationConfig, tensors: dict[str, torch.Tensor],
                   path: Path) -> nn.Module:
    """Replace every layer of ``qcfg.layers`` by a ``QuantLinear`` of its tensors (minifer's names and layout),
    checked against the architecture, and copy the rest; the model keeps its device and dtype."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
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
        qw = QuantizedWeight(weight_format(qcfg.format), tensors.pop(f"{name}.qweight"), tensors.pop(f"{name}.scales"),
                             tensors.pop(f"{name}.zeros", None), spec["group_size"], shape)
        try:
            qw.validate()
        except ValueError as e:
            raise ModelLoadError(f"{path}: tensors of {name} do not match its quantization_config entry: {e}") from e
        bias = tensors.pop(f"{name}.bias", None)
        try:
            set_module(model, name, QuantLinear(qw.to(device), None if bias is None else bias.to(device, dtype),
                                                kernel_for(qcfg.format, None)))
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
