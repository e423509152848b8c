"""int4 checkpoints in the GPTQ layout, the way in from vLLM's and transformers' world: ``load_gptq``.

A GPTQ checkpoint made elsewhere loads (``LLM(folder)``, through ``load_model``) if it fits minifer's int4: 4 bits,
``g_idx == k // group_size`` (no act-order permutation), an architecture minifer builds. Decoder linears it left
unquantized load as ordinary linears. Writing one is offline work (``minifer.compress.gptq_export.save_gptq``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minifer.model_loader import ModelLoadError, build_model, fuse_checkpoint, read_checkpoint
from minifer.model_loader.quant_fill import fill_quantized
from minifer.quantization.gptq_layout import CHECKPOINT_FORMATS, from_gptq
from minifer.quantization.linear import decoder_linears
from minifer.quantization.model import QuantizationConfig

GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


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
    """Build the architecture of config.json and fill it from a GPTQ checkpoint: each quantized linear unpacked
    into minifer's int4 (``from_gptq``), then fused (``fuse_checkpoint``) and filled as ``load_quantized`` does."""
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
