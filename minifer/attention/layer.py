"""Attention over a KV cache, behind a small interface the model calls once per layer.

The model never knows how keys and values are stored: each forward receives an ``AttentionBackend`` argument
(no global context, unlike nano-vllm). Tokens travel *packed*, ``[N, heads, head_dim]`` for the N new tokens of
the whole batch, so the same model code serves chapter 00's padded static batches and the engine's paged, ragged
ones (``paged_attention.py``).

``ContiguousKVCache`` is the textbook layout: one ``[batch, kv_heads, max_len, head_dim]`` slab per layer,
reserved for the longest possible sequence; chapter 02 measures how much of it is wasted.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write layer ``layer``'s new keys and values into the cache and return each new query's attention over
        its sequence's keys up to its own position. ``q``: ``[N, Hq, D]``; ``k``, ``v``: ``[N, Hkv, D]``; returns
        ``[N, Hq, D]``."""
        ...


class ContiguousKVCache:
    """A max-length KV reservation per sequence of a padded batch (the static-batching baseline).

    Rows are *left*-padded so every row's newest token sits in the same slot: a step writes slots
    ``[start, start + T)`` for all rows at once, and causality is simply "key slot <= query slot".
    ``key_valid[b, s]`` is False for padding slots, which no real token may attend to.
    """

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch, self.max_len = batch, max_len
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.start = self.num_tokens = 0
        self._mask: torch.Tensor | None = None

    def begin_step(self, start: int, num_tokens: int, valid: torch.Tensor) -> None:
        """Declare that this step fills slots ``[start, start+num_tokens)``; ``valid`` ``[B, num_tokens]``."""
        if start + num_tokens > self.max_len:
            raise ValueError(f"KV cache overflow: slot {start + num_tokens} > max_len {self.max_len}")
        self.start, self.num_tokens = start, num_tokens
        self.key_valid[:, start : start + num_tokens] = valid
        end = start + num_tokens
        q_slot = torch.arange(start, end, device=valid.device)
        k_slot = torch.arange(end, device=valid.device)
        causal = k_slot[None, :] <= q_slot[:, None]  # [T, S]
        # A padding query attends to itself only, so its (ignored) output stays finite: a row with every
        # key masked would give NaN, and NaN values would poison real rows through 0 * NaN in the next layer.
        self_key = k_slot[None, :] == q_slot[:, None]
        mask = (self.key_valid[:, None, :end] & causal[None]) | self_key[None]
        self._mask = mask[:, None]  # [B, 1, T, S]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, s0 = self.batch, self.num_tokens, self.start
        hq, d = q.shape[1], q.shape[2]
        self.k[layer, :, :, s0 : s0 + t] = k.view(b, t, -1, d).transpose(1, 2)
        self.v[layer, :, :, s0 : s0 + t] = v.view(b, t, -1, d).transpose(1, 2)
        keys = self.k[layer, :, :, : s0 + t]
        values = self.v[layer, :, :, : s0 + t]
        qb = q.view(b, t, hq, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=self._mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * t, hq, d)


def causal_backend(model: torch.nn.Module, batch: int, seq_len: int) -> tuple[ContiguousKVCache, torch.Tensor]:
    """An attention backend for ``batch`` full sequences of ``seq_len`` tokens (plain causal attention) and
    the positions ``[batch * seq_len]`` of their packed tokens."""
    cfg, w = model.config, model.lm_head.weight
    cache = ContiguousKVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, seq_len, cfg.head_dim,
                              w.dtype, w.device)
    cache.begin_step(0, seq_len, torch.ones(batch, seq_len, dtype=torch.bool, device=w.device))
    return cache, torch.arange(seq_len, device=w.device).repeat(batch)
