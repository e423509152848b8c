"""Rotary position embeddings (RoPE), with the ``linear`` and ``llama3`` frequency scalings.

RoPE rotates each pair of query/key features by an angle proportional to the token's position, so the
dot product of a query and a key depends only on their *distance*. Llama, Qwen2 and Qwen3 use the
"rotate half" layout: feature ``i`` is paired with feature ``i + head_dim/2``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """The ``head_dim/2`` rotation frequencies ``theta ** (-2i / head_dim)``, rescaled if asked.

    ``llama3`` scaling (Llama 3.1/3.2) keeps high frequencies, divides low ones by ``factor`` and
    interpolates smoothly between ``low_freq_factor`` and ``high_freq_factor``; this is what lets a model
    trained on 8k tokens read 128k.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (minifer supports default, linear and llama3)")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[tokens, heads, head_dim]`` by per-token ``cos``/``sin`` ``[tokens, head_dim]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class RotaryEmbedding(nn.Module):
    """Precomputes ``cos``/``sin`` for every position up to ``max_positions`` once, then indexes them."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        inv_freq = self._compute_inv_freq()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def _compute_inv_freq(self) -> torch.Tensor:
        """The frequencies the table is built from (vLLM's name): a subclass that computes them otherwise builds its
        table with the same arithmetic, so equal frequencies give equal tokens."""
        return rope_inv_freq(self.head_dim, self.theta, self.scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
