"""Model configuration read straight from a checkpoint's ``config.json``.

minifer runs the Llama family: ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` (and
``MistralForCausalLM`` without sliding windows, the same graph). They differ in a few switches, named here so
that the model code reads as one architecture: Qwen2 adds q/k/v biases; Qwen3 RMSNorms q and k per head before
RoPE, and its ``head_dim`` need not be ``hidden_size / num_attention_heads``; Llama 3.1+ rescales RoPE
(``llama3`` scaling); small models tie the embedding and output matrices. RoPE settings are read from
``rope_theta`` / ``rope_scaling`` or from transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The checkpoint is not a model minifer can run; the message names what is unsupported."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count from the shapes alone (used by dummy loads and the roofline chapter)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size + (h if self.family != "qwen2" else 0)  # Qwen2's o_proj has none
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        layer = attn + mlp + 2 * h
        return self.num_hidden_layers * layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = _architecture(cfg)
        family = SUPPORTED_ARCHITECTURES[arch]
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise UnsupportedModelError(f"config.json: {key!r} must be a positive integer, got {cfg.get(key)!r}")
        if cfg.get("use_sliding_window") or (family == "llama" and cfg.get("sliding_window")):
            raise UnsupportedModelError("sliding-window attention is not supported (use_sliding_window/sliding_window)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu / SwiGLU)")
        theta, scaling = _rope(cfg)
        if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (its code ignores attention_bias); Llama and Qwen3 read the key.
            attention_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=dict(cfg),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{path}: not valid JSON ({e})") from e


def auto_dtype(device: Any) -> Any:
    """What ``dtype="auto"`` means on ``device``: float32 on the CPU (bfloat16 matmuls there are slow and round
    differently from a GPU's); bfloat16 from compute capability 8.0 (Ampere and later), the dtype the checkpoints
    are published in; float16 below (T4, V100: no bfloat16 hardware). ``torch.cuda.is_bf16_supported()``
    is not the test: it says True on a T4, where torch emulates bfloat16."""
    import torch

    if device.type != "cuda":
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def resolve_device(device: Any) -> Any:
    """``LLM(device=...)``: None or ``"auto"`` is the GPU when there is one, else the CPU."""
    import torch

    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA GPU is available")
    return device


_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16", "half": "float16"}


def resolve_dtype(dtype: Any, device: Any) -> Any:
    """``LLM(dtype=...)``: a ``torch.dtype``, one of its names, or ``"auto"`` (``auto_dtype``)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}: use 'auto', {', '.join(_DTYPE_NAMES)}")
    return getattr(torch, _DTYPE_NAMES[dtype])


def _architecture(cfg: dict[str, Any]) -> str:
    """The supported architecture a config.json names (``architectures``, else its ``model_type``)."""
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None:
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM"}.get(cfg.get("model_type", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported architecture {arch or cfg.get('model_type')!r}: minifer runs "
                                    f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    return arch


def _rope(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """RoPE's base and its scaling (None: plain RoPE), from the old keys or transformers 5's ``rope_parameters``."""
    rope = dict(cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is None:
        return theta, None
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")
    return theta, (None if kind == "default" else scaling)
