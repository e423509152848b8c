"""``save_gptq``: an int4 model as a GPTQ checkpoint, the folder vLLM's ``LLM(path)`` and transformers'
``AutoModelForCausalLM.from_pretrained(path)`` (with GPTQModel installed) read. Offline, like GPTQ's calibration
(``minifer.compress``): a server only reads such folders (``minifer.model_loader.gptq``), and
``save_quantized`` (``minifer.model_loader.quantized``) writes minifer's own layout, which only minifer reads::

    config.json          the source's, plus "quantization_config": {"quant_method": "gptq", "bits": 4,
                         "group_size", "desc_act": false, "sym", "checkpoint_format": "gptq" | "gptq_v2", ...}
    model.safetensors    transformers' module names, the fused projections split back into
                         q_proj/k_proj/v_proj and gate_proj/up_proj, each quantized linear as
                         qweight, qzeros, scales, g_idx (minifer.quantization.gptq_layout draws them) [+ bias];
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
from minifer.model_loader.quant_fill import WEIGHTS_FILE, copy_checkpoint_files, unwrap_llm
from minifer.quantization.formats import QuantizedWeight, unpack_int4
from minifer.quantization.gptq_layout import CHECKPOINT_FORMATS, PACK, SHIFTS, check_gptq_shape
from minifer.quantization.linear import LINEAR_NAMES
from minifer.quantization.model import QuantizationConfig


def _pack_words(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit codes (ints 0..15) along ``dim`` -> one int32 word, the first code in the low nibble."""
    c = codes.to(torch.int64).movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // PACK, PACK)
    words = (c << SHIFTS.to(torch.int64)).sum(-1)  # disjoint bit fields: the sum is the bitwise or
    words = torch.where(words >= 2**31, words - 2**32, words)  # bits 28..31 set: the word's int32 value is negative
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def to_gptq(qw: QuantizedWeight, group_size: int | None = None, checkpoint_format: str = "gptq",
            name: str = "weight") -> dict[str, torch.Tensor]:
    """``qweight``, ``qzeros``, ``scales`` and ``g_idx`` of an int4 ``QuantizedWeight`` in the GPTQ layout.

    ``group_size`` (default the weight's own) may be any divisor of the weight's group: a g128 group is then
    written as two g64 groups with the same scale and zero point, which is exact. A checkpoint has one
    group size for every layer, and ``quantize_model`` falls back to a smaller group where 128 does not
    divide K. Scales are rounded to float16 (the layout's dtype); one that float16 cannot hold is refused."""
    if qw.fmt != "int4":
        raise ValueError(f"{name}: only int4 weights have a GPTQ layout here, got {qw.fmt}")
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    qw.validate(check_values=False)
    n, k = qw.shape
    g = qw.group_size if group_size is None else group_size
    if qw.group_size % g:
        raise ValueError(f"{name}: group_size {g} does not divide the weight's own group of {qw.group_size}")
    check_gptq_shape(name, n, k, g)
    repeat = qw.group_size // g
    zeros = torch.full_like(qw.scales, 8.0) if qw.zeros is None else qw.zeros.float()
    zeros = zeros.repeat_interleave(repeat, dim=1).to(torch.int64).T  # [K / g, N]
    if checkpoint_format == "gptq":
        if int(zeros.min()) == 0:
            raise ValueError(f"{name}: a group has zero point 0, which checkpoint_format='gptq' (zero points "
                             f"stored minus one) cannot hold; save with checkpoint_format='gptq_v2'")
        zeros = zeros - 1
    scales = qw.scales.repeat_interleave(repeat, dim=1).T.to(torch.float16)
    if not bool(torch.isfinite(scales).all() & (scales > 0).all()):
        raise ValueError(f"{name}: a scale is outside float16's range (the GPTQ layout stores float16 scales): "
                         f"smallest {float(qw.scales.min()):.3g}, largest {float(qw.scales.max()):.3g}")
    return {"qweight": _pack_words(unpack_int4(qw.qweight).T, dim=0),
            "qzeros": _pack_words(zeros, dim=1),
            "scales": scales.contiguous(),
            "g_idx": torch.arange(k, dtype=torch.int32) // g}


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


