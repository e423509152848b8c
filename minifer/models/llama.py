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

from minifer.attention.layer import AttentionBackend
from minifer.config import ModelConfig
from minifer.layers.layernorm import RMSNorm
from minifer.layers.rotary_embedding import RotaryEmbedding, apply_rotary


class Attention(nn.Module):
    apply_rotary = staticmethod(apply_rotary)  # RoPE's rotation of q and k; a subclass may rotate with another

    def __init__(self, cfg: ModelConfig, layer_idx: int, norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_bias and cfg.family != "qwen2")
        self.q_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.apply_rotary(q, cos, sin), self.apply_rotary(k, cos, sin)
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
    def __init__(self, cfg: ModelConfig, layer_idx: int, norm_cls: type[nn.Module] = RMSNorm,
                 attention_cls: type[nn.Module] = Attention) -> None:
        super().__init__()
        self.input_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention_cls(cfg, layer_idx, norm_cls)
        self.post_attention_layernorm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """``layer_type`` (vLLM's name), ``attention_cls``, ``norm_cls``, ``rotary_cls``: the classes it is built from."""

    def __init__(self, cfg: ModelConfig, max_positions: int, layer_type: type[nn.Module] = DecoderLayer,
                 attention_cls: type[nn.Module] = Attention, norm_cls: type[nn.Module] = RMSNorm,
                 rotary_cls: type[nn.Module] = RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_type(cfg, i, norm_cls, attention_cls) for i in range(cfg.num_hidden_layers))
        self.norm = norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary_cls(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        # vLLM's ``aux_hidden_state_layers``: an EAGLE-3 head reads these layers' inputs; empty unless a head asks,
        # then every forward leaves them, in order, in ``aux_hidden_states`` (the runner returns one hidden state)
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_hidden_states: list[torch.Tensor] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        aux = self.aux_hidden_state_layers
        if aux:
            self.aux_hidden_states = []
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            if aux and i in aux:
                self.aux_hidden_states.append(x)
            x = layer(x, cos, sin, attn)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """``forward`` maps packed tokens ``[N]`` (with their positions) to final hidden states ``[N, hidden]``;
    ``compute_logits`` projects only the rows that need a next token (usually one per sequence), saving a
    ``vocab x hidden`` matmul per prompt token.

    The classes it is built from are class attributes: a model of other layers (the course builds one from a
    learner's RMSNorm, RoPE and decoder layer) is a subclass naming its own, which the engine builds in place of
    this one as vLLM builds an out-of-tree model (``Components.model_registry``)."""

    layer_type: type[nn.Module] = DecoderLayer
    attention_cls: type[nn.Module] = Attention
    norm_cls: type[nn.Module] = RMSNorm
    rotary_cls: type[nn.Module] = RotaryEmbedding

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings, self.layer_type,
                                self.attention_cls, self.norm_cls, self.rotary_cls)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.compiled = None  # a CompiledDecoder (compilation/compiled_decoder.py) once compilation_config asks for one

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        if self.compiled is not None and self.compiled.applies() and not self.model.aux_hidden_state_layers:
            return self.compiled(input_ids, positions, attn)
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
