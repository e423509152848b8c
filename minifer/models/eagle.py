"""An EAGLE-style draft head: one decoder layer that drafts from the target's own features (chapter 04).

A separate draft model sees only tokens and must rebuild, in its own small width, what the target already
knows. EAGLE (Li et al. 2024) drafts at the *feature* level instead: the target's last hidden state at
position ``t`` (the vector its LM head turns into the next-token distribution) is already a rich summary of
the text, so one layer is enough to extrapolate it one step. The head reads ``[f_t, embed(x_{t+1})]`` (the
feature of position ``t`` and the token sampled from it: the feature alone does not say which token the
sampling picked), fuses them with one linear map, runs one Llama decoder layer over its own KV cache and
returns a predicted ``f_{t+1}``; the *target's* LM head turns it into the draft distribution of ``x_{t+2}``.

To draft ``k`` tokens the head feeds itself: the predicted feature and the token drawn from it go back in.
The target's embedding and LM head are shared and frozen (the head stores only the fusion map, the layer and
a final norm), so the head costs a twelfth of the target's layers plus the LM head per drafted token.

The head's attention goes through the same ``AttentionBackend`` as the target's layers: the engine hands it
a paged cache (``minifer.engine.proposers.EagleProposer``), training a contiguous causal one.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from minifer.config import ModelConfig
from minifer.layers.attention import AttentionBackend
from minifer.layers.norm import RMSNorm
from minifer.layers.rotary import RotaryEmbedding
from minifer.models.llama import DecoderLayer, LlamaForCausalLM

HEAD_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's layer has the target's shapes (its features are the target's width), one layer deep."""
    return replace(target, num_hidden_layers=1)


class EagleHead(nn.Module):
    """``forward(features, input_ids, positions, attn)``: packed ``[N, hidden]`` features of positions ``t`` and
    the tokens ``x_{t+1}`` ``[N]`` -> predicted features of positions ``t + 1`` ``[N, hidden]``. ``logits`` applies
    the target's (shared) LM head."""

    def __init__(self, target: LlamaForCausalLM, max_positions: int | None = None) -> None:
        super().__init__()
        cfg = head_config(target.config)
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(cfg, 0)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)  # the target's features are post-norm: predict in that space
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        # shared with the target, not registered as parameters: neither trained nor saved with the head
        self._shared = (target.model.embed_tokens, target.lm_head)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        embed, _ = self._shared
        x = self.fc(torch.cat([features, embed(input_ids).to(features.dtype)], dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        return self.norm(self.layer(x, cos, sin, attn))

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's token embedding (shared, frozen): what a forward written outside the class reads."""
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Linear:
        """The target's (the engine sizes the head's KV blocks from its dtype, as for a draft model)."""
        return self._shared[1]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self._shared[1](features)

    def save(self, dest: str | Path, info: dict) -> None:
        """The head's own weights (bf16 safetensors) and a config naming the target it reads."""
        from safetensors.torch import save_file

        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()},
                  str(dest / HEAD_FILE))
        (dest / CONFIG_FILE).write_text(json.dumps({"architectures": ["EagleHead"], **info}, indent=2) + "\n")


def load_eagle_head(path: str | Path, target: LlamaForCausalLM, dtype: torch.dtype,
                    max_positions: int | None = None) -> EagleHead:
    """A trained head from ``path`` (a folder with ``config.json`` and ``model.safetensors``), bound to ``target``
    (whose hidden size it must share), on the target's device."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / CONFIG_FILE).read_text())
    if cfg.get("architectures") != ["EagleHead"]:
        raise ValueError(f"{path} is not an EAGLE head (architectures {cfg.get('architectures')})")
    if cfg.get("hidden_size") != target.config.hidden_size:
        raise ValueError(f"the head reads {cfg.get('hidden_size')}-wide features but the target's are "
                         f"{target.config.hidden_size} wide: a head is trained for one target")
    head = EagleHead(target, max_positions)
    head.load_state_dict({k: v for k, v in load_file(str(path / HEAD_FILE)).items()}, strict=True)
    device = target.lm_head.weight.device
    return head.to(device=device, dtype=dtype).eval()
