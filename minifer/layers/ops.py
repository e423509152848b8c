"""The per-token functions a decoder layer calls, as one value handed to the model's ``forward``.

``LayerOps`` lets another RMSNorm or RoPE (a learner's, chapter 00) run inside the real model without
monkey-patching a module: the engine passes it with every forward, as it passes the attention backend, so two
engines sharing one set of weights can use different functions at once. The defaults are minifer's references.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minifer.layers.layernorm import rms_norm
from minifer.layers.rotary_embedding import apply_rotary


@dataclass(frozen=True)
class LayerOps:
    """``rms_norm(x, weight, eps)`` as ``minifer.layers.layernorm.rms_norm``; ``apply_rotary(x, cos, sin)`` as
    ``minifer.layers.rotary_embedding.apply_rotary`` (``x`` ``[tokens, heads, head_dim]``, ``cos``/``sin`` ``[tokens,
    head_dim]``); ``decoder_layer(layer, x, cos, sin, attn, ops)``: a whole decoder layer's forward over that layer's
    modules and weights, in place of ``DecoderLayer.forward`` (None: the model's own); ``rope_inv_freq(head_dim,
    theta)``: RoPE's frequencies as ``minifer.layers.rotary_embedding.rope_inv_freq`` (None: the table the model precomputed)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm
    apply_rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rotary
    decoder_layer: Callable[..., torch.Tensor] | None = None
    rope_inv_freq: Callable[[int, float], torch.Tensor] | None = None


REFERENCE_OPS = LayerOps()
