"""int4 checkpoints in the GPTQ layout: the way out to vLLM and transformers, and the way back in.

``save_quantized`` (``quantized.py``) writes minifer's own layout, fused projections and all, which only minifer
reads. ``save_gptq`` writes an int4 model as the folder vLLM's ``LLM(path)`` and transformers'
``AutoModelForCausalLM.from_pretrained(path)`` (with GPTQModel installed) expect from a GPTQ checkpoint::

    config.json          the source's, plus "quantization_config": {"quant_method": "gptq", "bits": 4,
                         "group_size", "desc_act": false, "sym", "checkpoint_format": "gptq" | "gptq_v2", ...}
    model.safetensors    transformers' module names, the fused projections split back into
                         q_proj/k_proj/v_proj and gate_proj/up_proj, each quantized linear as
                         qweight, qzeros, scales, g_idx (minifer.quant.gptq_layout draws them) [+ bias];
                         embeddings, norms and lm_head as the model holds them
    tokenizer files, generation_config.json   copied from the source

Splitting is exact: minifer's int4 groups run along K (the inputs), and q, k and v share their input, so the
fused ``qkv_proj``'s rows split into three weights with the same groups. What changes on the way out:

- scales are rounded to float16, the layout's dtype (a relative change below 2^-11, far inside the int4
  rounding; the tests check the greedy tokens do not move on the bundled model);
- one ``group_size`` for the whole checkpoint, the smallest any layer uses: ``quantize_model`` falls back
  to g64 where 128 does not divide K (the bundled target's ``down_proj``), and a g128 group is written as
  two g64 groups with equal scales, which is exact;
- the layout packs by eights, so every layer's K and N (each of q, k, v) must be multiples of 8.

``LLM(folder)`` reads such a folder back (``load_model`` routes it to ``load_gptq``), and also a GPTQ
checkpoint made elsewhere if it fits minifer's int4: 4 bits, ``g_idx == k // group_size`` (no act-order
permutation), a Llama/Qwen architecture minifer builds. Decoder linears a checkpoint left unquantized load
as ordinary linears.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minifer.config import ModelConfig
from minifer.loader import ModelLoadError, build_model, fuse_checkpoint, read_checkpoint
from minifer.loader.quant_fill import (
    WEIGHTS_FILE,
    copy_checkpoint_files,
    fill_quantized,
    unwrap_llm,
)
from minifer.quant.formats import QuantizedWeight
from minifer.quant.gptq_layout import CHECKPOINT_FORMATS, from_gptq, to_gptq
from minifer.quant.linear import LINEAR_NAMES, decoder_linears
from minifer.quant.model import QuantizationConfig

GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


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


def split_sizes(cfg: ModelConfig) -> dict[str, tuple[tuple[str, int], ...]]:
    """How a fused projection's rows split into transformers' modules (the inverse of ``fuse_checkpoint``)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    i = cfg.intermediate_size
    return {"self_attn.qkv_proj": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
            "self_attn.o_proj": (("self_attn.o_proj", cfg.hidden_size),),
            "mlp.gate_up_proj": (("mlp.gate_proj", i), ("mlp.up_proj", i)),
            "mlp.down_proj": (("mlp.down_proj", cfg.hidden_size),)}


def _rows(qw: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Output rows ``start:stop`` of a weight: its codes, scales and zero points are all row-major in N."""
    cut = lambda t: None if t is None else t[start:stop].contiguous()
    return QuantizedWeight(qw.fmt, cut(qw.qweight), cut(qw.scales), cut(qw.zeros), qw.group_size,
                           (stop - start, qw.shape[1]))


def gptq_tensors(model: nn.Module, group_size: int, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """Every quantized decoder linear of ``model`` in the GPTQ layout, under transformers' module names."""
    sizes = split_sizes(model.config)
    out: dict[str, torch.Tensor] = {}
    for (i, layer), kind in itertools.product(enumerate(model.model.layers), LINEAR_NAMES):
        mod = layer.get_submodule(kind)
        qw = mod.quantized_weight.to("cpu")
        start = 0
        for part, rows in sizes[kind]:
            full = f"model.layers.{i}.{part}"
            for t, v in to_gptq(_rows(qw, start, start + rows), group_size, checkpoint_format, full).items():
                out[f"{full}.{t}"] = v
            if mod.bias is not None:
                out[f"{full}.bias"] = mod.bias[start : start + rows].detach().cpu().contiguous()
            start += rows
    return out


def gptq_config(qcfg: QuantizationConfig, group_size: int, checkpoint_format: str) -> dict[str, Any]:
    """The ``quantization_config`` of config.json. ``desc_act`` is false because the layout has no permutation
    (minifer's act-order keeps static groups); the GPTQ run's settings are recorded when there was one, and
    ``meta`` says what minifer did, for a reader of the file."""
    from minifer import __version__

    out: dict[str, Any] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
                           "sym": qcfg.symmetric, "checkpoint_format": checkpoint_format, "lm_head": False}
    cal = qcfg.calibration or {}
    if qcfg.method == "gptq":
        out.update(damp_percent=cal.get("damp"), true_sequential=cal.get("true_sequential"),
                   static_groups=cal.get("act_order"))
    out["meta"] = {"quantizer": [f"minifer:{__version__}"], "minifer_method": qcfg.method,
                   "minifer_act_order": bool(cal.get("act_order", False))}
    return out


def save_gptq(model, path: str | Path, source: str | Path | None = None, checkpoint_format: str = "gptq") -> Path:
    """Write an int4-quantized model (an ``LLM`` or a quantized ``LlamaForCausalLM``) as a GPTQ checkpoint
    folder (drawn in the module docstring); ``source`` as in ``save_quantized``. ``checkpoint_format="gptq"``
    (v1, read everywhere) refuses asymmetric weights with a zero point of 0; ``"gptq_v2"`` stores those."""
    model, source = unwrap_llm(model, source)
    qcfg: QuantizationConfig | None = getattr(model, "quantization_config", None)
    if qcfg is None or qcfg.format != "int4":
        raise ValueError(f"save_gptq writes int4 models; this one is "
                         f"{'not quantized' if qcfg is None else qcfg.format}: quantize_model(model, 'int4') first")
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    groups = {spec["group_size"] for spec in qcfg.layers.values()}
    group = math.gcd(*groups)
    quantized = gptq_tensors(model, group, checkpoint_format)  # raises before anything is written
    path = copy_checkpoint_files(source, path)
    skip = tuple(f"{n}." for n in qcfg.layers)
    tied = model.config.tie_word_embeddings
    rest = {k: t.detach().contiguous().cpu() for k, t in model.state_dict().items()
            if not k.startswith(skip) and not (tied and k == "lm_head.weight")}
    from safetensors.torch import save_file

    save_file({**rest, **quantized}, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = gptq_config(qcfg, group, checkpoint_format)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def _read_gptq_config(path: Path) -> dict[str, Any]:
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    fmt = qc.get("checkpoint_format", "gptq")
    problems = []
    if qc.get("bits") != 4:
        problems.append(f"bits={qc.get('bits')!r} (minifer reads 4-bit GPTQ only)")
    if not isinstance(qc.get("group_size"), int) or qc["group_size"] == 0 or qc["group_size"] < -1:
        problems.append(f"group_size={qc.get('group_size')!r}")
    if fmt not in CHECKPOINT_FORMATS:
        problems.append(f"checkpoint_format={fmt!r} (minifer reads {', '.join(CHECKPOINT_FORMATS)})")
    if problems:
        raise ModelLoadError(f"{path}/config.json: a GPTQ quantization_config minifer cannot load: "
                             f"{'; '.join(problems)}")
    return {"group_size": qc["group_size"], "sym": bool(qc.get("sym", True)), "checkpoint_format": fmt,
            "method": (qc.get("meta") or {}).get("minifer_method", "gptq")}


def load_gptq(path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
              max_positions: int | None = None) -> nn.Module:
    """Build the architecture of config.json and fill it from a GPTQ checkpoint: each quantized linear is
    unpacked into minifer's int4 (``from_gptq``), q/k/v and gate/up are fused as for any checkpoint
    (``fuse_checkpoint``), and the model is filled as ``load_quantized`` fills its own layout."""
    path = Path(path)
    qc = _read_gptq_config(path)
    model = build_model(path, load_format="dummy", dtype=dtype, device=torch.device(device),
                        max_positions=max_positions)
    raw = read_checkpoint(path)
    groups: dict[str, int] = {}  # transformers' module name -> its group size
    for prefix in sorted(k[: -len(".qweight")] for k in raw if k.endswith(".qweight")):
        parts = {t: raw.pop(f"{prefix}.{t}") for t in GPTQ_TENSORS if f"{prefix}.{t}" in raw}
        k = parts["qweight"].shape[0] * 8
        groups[prefix] = qc["group_size"] if qc["group_size"] > 0 else k  # -1: one group per row
        try:
            qw = from_gptq(parts, groups[prefix], qc["sym"], qc["checkpoint_format"], prefix)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from e
        raw.update({f"{prefix}.qweight": qw.qweight, f"{prefix}.scales": qw.scales})
        if qw.zeros is not None:
            raw[f"{prefix}.zeros"] = qw.zeros
    tensors = fuse_checkpoint(raw, model.config)
    qcfg = QuantizationConfig("int4", qc["group_size"], qc["sym"], qc["method"])
    for name, linear in decoder_linears(model).items():
        if f"{name}.qweight" not in tensors:
            continue  # left in full precision by the checkpoint: loads as an ordinary linear
        group = _fused_group(name, groups, path)
        qcfg.layers[name] = {"shape": [linear.out_features, linear.in_features], "group_size": group,
                             "bias": linear.bias is not None}
    model = fill_quantized(model, qcfg, tensors, path)
    qcfg.kept = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    return model


def _fused_group(name: str, groups: dict[str, int], path: Path) -> int:
    """The group size of a fused layer: its parts' (q, k and v must agree to be fused)."""
    parent, _, fused = name.rpartition(".")
    members = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    found = {groups[f"{parent}.{m}"] for m in members.get(fused, (fused,)) if f"{parent}.{m}" in groups}
    if len(found) != 1:
        raise ModelLoadError(f"{path}: the parts of {name} are not all quantized with one group size ({found})")
    return found.pop()
