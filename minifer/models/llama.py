"""The Llama / Qwen2 / Qwen3 decoder, small enough to read in one sitting.

Each layer: ``x + Attention(RMSNorm(x))`` then ``x + MLP(RMSNorm(x))``. Attention projects to q, k, v in one
fused matmul (fewer, larger matrix products run faster), optionally normalises q and k per head (Qwen3), rotates
them (RoPE) and hands them to the ``AttentionBackend`` that owns the KV cache. The MLP is SwiGLU, gate and up fused.

Parameter names follow transformers', so a checkpoint's tensors map onto this model one to one once
``loader.fuse_checkpoint`` has concatenated the separately stored q/k/v and gate/up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minifer.config import ModelConfig
from minifer.attention.layer import AttentionBackend
from minifer.layers.layernorm import RMSNorm
from minifer.layers.ops import REFERENCE_OPS, LayerOps
from minifer.layers.rotary_embedding import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_bias and cfg.family != "qwen2")
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                ops: LayerOps = REFERENCE_OPS) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q, ops.rms_norm), self.k_norm(k, ops.rms_norm)
        q, k = ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)
        out = attn.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                ops: LayerOps = REFERENCE_OPS) -> torch.Tensor:
        if ops.decoder_layer is not None:  # another forward of this layer over its weights (a learner's, chapter 00)
            return ops.decoder_layer(self, x, cos, sin, attn, ops)
        x = x + self.self_attn(self.input_layernorm(x, ops.rms_norm), cos, sin, attn, ops)
        return x + self.mlp(self.post_attention_layernorm(x, ops.rms_norm))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # vLLM's ``aux_hidden_state_layers``: an EAGLE-3 head reads these layers' inputs; empty unless a head asks,
        # then every forward leaves them, in order, in ``aux_hidden_states`` (the runner returns one hidden state)
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                ops: LayerOps = REFERENCE_OPS) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        aux = self.aux_hidden_state_layers
        if aux:
            self.aux_hidden_states = []
        if ops.rope_inv_freq is None:
            cos, sin = self.rotary(positions, x.dtype)
        else:
            cos, sin = self.rotary.from_frequencies(positions, x.dtype, ops.rope_inv_freq)
        for i, layer in enumerate(self.layers):
            if aux and i in aux:
                self.aux_hidden_states.append(x)
            x = layer(x, cos, sin, attn, ops)
        return self.norm(x, ops.rms_norm)


class LlamaForCausalLM(nn.Module):
    """``forward`` maps packed tokens ``[N]`` (with their positions) to final hidden states ``[N, hidden]``;
    ``compute_logits`` projects only the rows that need a next token (usually one per sequence), saving a
    ``vocab x hidden`` matmul per prompt token. ``ops`` (``LayerOps``): the RMSNorm and RoPE functions the layers
    call, minifer's unless the engine was given others (``LLM(components=)``)."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.compiled = None  # a CompiledDecoder (compilation/compiled_decoder.py) once compilation_config asks for one

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                ops: LayerOps = REFERENCE_OPS) -> torch.Tensor:
        if self.compiled is not None and self.compiled.applies(ops) and not self.model.aux_hidden_state_layers:
            return self.compiled(input_ids, positions, attn)
        return self.model(input_ids, positions, attn, ops)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
