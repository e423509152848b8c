"""The Llama family's building blocks (RMSNorm, RoPE) as plain functions with small module wrappers.

Chapter 00 teaches them; its exercises rebuild ``rms_norm``, ``apply_rotary`` and top-p sampling against these.
"""

from minifer.layers.layernorm import RMSNorm, rms_norm
from minifer.layers.rotary_embedding import RotaryEmbedding, apply_rotary, rope_inv_freq

__all__ = ["RMSNorm", "rms_norm", "RotaryEmbedding", "apply_rotary", "rope_inv_freq"]
