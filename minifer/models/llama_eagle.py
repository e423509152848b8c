"""An EAGLE-style draft head: one decoder layer that drafts from the target's own features (chapter 04).

A separate draft model sees only tokens and must rebuild, in its own small width, what the target already knows.
EAGLE (Li et al. 2024) drafts at the *feature* level instead: the target's last hidden state at position ``t`` is
already a rich summary of the text, so one layer is enough to extrapolate it one step. The head reads
``[f_t, embed(x_{t+1})]`` (the feature alone does not say which token the sampling picked), fuses them with one
linear map, runs one Llama decoder layer over its own KV cache and returns a predicted ``f_{t+1}``; an LM head turns
it into the draft distribution of ``x_{t+2}``. To draft ``k`` tokens the head feeds itself: the predicted feature
and the token drawn from it go back in.

The target's embedding is shared and frozen; the head stores the fusion map, the layer, a final norm and its own LM
head over a **draft vocabulary** (EAGLE-3's ``draft_vocab_size``): the target tokens the target itself predicts most
often on the training data. ``d2t`` maps a draft id to its target id as EAGLE-3's checkpoints and vLLM do
(``target = draft + d2t[draft]``); ``t2d`` marks the target ids it covers. ``logits`` gives every id outside the
draft vocabulary ``-inf``, so it is never proposed: that costs acceptance where the target picks such a token, never
correctness (the target verifies every draft). The head's MLP may be narrower than the target's: a drafting forward
streams every weight of the head, so its weight bytes set its price.

EAGLE-3 (Li et al. 2025) feeds the head the target's low, middle and high features (vLLM's
``eagle_aux_hidden_state_layer_ids``), fused by one linear map (``combine``, ``3 * hidden -> hidden``) into the
feature read in place of ``f_t``: the last layer is tuned to the next token only, earlier ones still carry what the
tokens after it need. A fused head is method ``"eagle3"`` (shipped as ``tinystories-target-eagle3``);
``minifer.bench.eagle`` measures whether the fusion pays.

The head's attention goes through the same ``AttentionBackend`` as the target's layers: the engine hands it a paged
cache (``minifer.spec_decode.eagle.EagleProposer``), training a contiguous causal one.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from minifer.attention.layer import AttentionBackend
from minifer.config import ModelConfig
from minifer.layers.layernorm import RMSNorm
from minifer.layers.rotary_embedding import RotaryEmbedding
from minifer.models.llama import DecoderLayer, LlamaForCausalLM

HEAD_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
AUX_KEY = "eagle_aux_hidden_state_layer_ids"  # vLLM's config key for the target layers an EAGLE-3 head reads


def eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default low, middle and high layers (vLLM's ``get_eagle3_aux_hidden_state_layers``): the inputs of
    layers 2, ``L // 2`` and ``L - 3``; (2, 6, 9) on the bundled 12-layer target."""
    return check_aux_layers((2, num_layers // 2, num_layers - 3), num_layers)


def check_aux_layers(ids, num_layers: int) -> tuple[int, ...]:
    """The layer ids as a sorted tuple (the order the target's forward meets them, which is the order of the
    concatenation ``combine`` reads), or a clear error: distinct layers of the target, at least one."""
    ids = tuple(sorted(int(i) for i in ids))
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < num_layers for i in ids):
        raise ValueError(f"{AUX_KEY} must name distinct layers of the {num_layers}-layer target, "
                         f"in [0, {num_layers}), got {list(ids)}")
    return ids


def head_config(target: ModelConfig, intermediate_size: int | None = None) -> ModelConfig:
    """The head's layer has the target's shapes (its features are the target's width), one layer deep; its MLP
    may be narrower (``intermediate_size``): at one layer against the target's twelve, the MLP is most of the
    head's weight bytes, which a decode step reads in full."""
    if intermediate_size is not None and intermediate_size <= 0:
        raise ValueError(f"the head's intermediate_size must be positive, got {intermediate_size}")
    return replace(target, num_hidden_layers=1, intermediate_size=intermediate_size or target.intermediate_size)


def draft_to_target_offsets(draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """EAGLE-3's ``d2t`` for a draft vocabulary (its target ids): ``d2t[i] = draft_vocab[i] - i``. The ids must be
    distinct target ids, in the order of the head's LM head rows (EAGLE-3 sorts them, which makes every offset
    non-negative; any order maps back correctly)."""
    ids = torch.as_tensor(draft_vocab, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise ValueError("the draft vocabulary is empty: it must hold at least one target token id")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must be target ids in [0, {vocab_size}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    if len(ids.unique()) != len(ids):
        raise ValueError("the draft vocabulary repeats a target id: each draft id must map to its own target token")
    return ids - torch.arange(len(ids))


class EagleHead(nn.Module):
    """``forward(features, input_ids, positions, attn)``: packed ``[N, hidden]`` features of positions ``t`` and
    the tokens ``x_{t+1}`` ``[N]`` -> predicted features of positions ``t + 1`` ``[N, hidden]``. ``draft_logits``
    applies the head's LM head (``[N, draft_vocab_size]``); ``logits`` puts those in the target's vocabulary.

    ``draft_vocab``: the target ids the head can propose (default: all of them); its LM head starts as the
    target's rows for them. ``intermediate_size``: its MLP's (default: the target's).

    ``aux_layers`` (EAGLE-3's fusion, vLLM's ``eagle_aux_hidden_state_layer_ids``): the head reads the inputs of these
    target layers instead of the last hidden state, and ``combine_hidden_states`` fuses their concatenation
    (``[N, len(aux_layers) * hidden]``) into one feature with one linear map before ``forward``, as vLLM's EAGLE-3
    proposer does; self-fed steps read the head's own output, already ``hidden`` wide."""

    def __init__(self, target: LlamaForCausalLM, max_positions: int | None = None,
                 draft_vocab: torch.Tensor | None = None, intermediate_size: int | None = None,
                 aux_layers: tuple[int, ...] | None = None) -> None:
        super().__init__()
        cfg = head_config(target.config, intermediate_size)
        self.config = cfg
        h = cfg.hidden_size
        self.aux_layers = None if aux_layers is None else check_aux_layers(aux_layers, target.config.num_hidden_layers)
        self.combine = None if aux_layers is None else nn.Linear(len(self.aux_layers) * h, h, bias=False)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(cfg, 0)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)  # the target's features are post-norm: predict in that space
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling)
        vocab = target.lm_head.weight.shape[0]
        d2t = draft_to_target_offsets(torch.arange(vocab) if draft_vocab is None else draft_vocab, vocab)
        ids = d2t + torch.arange(len(d2t))
        self.register_buffer("d2t", d2t)  # EAGLE-3's names and layout: what vLLM loads
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True))
        self.register_buffer("draft_ids", ids, persistent=False)  # draft id -> target id, precomputed
        self._whole_vocab = len(ids) == vocab and bool((d2t == 0).all())  # draft ids are target ids: no scatter
        self.lm_head = nn.Linear(h, len(ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(target.lm_head.weight[ids.to(target.lm_head.weight.device)].to(torch.float32))
        # shared with the target, not registered as a parameter: neither trained nor saved with the head
        self._shared = (target.model.embed_tokens,)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        embed = self._shared[0]
        x = self.fc(torch.cat([features, embed(input_ids).to(features.dtype)], dim=-1))
        cos, sin = self.rotary(positions, x.dtype)
        return self.norm(self.layer(x, cos, sin, attn))

    @property
    def feature_size(self) -> int:
        """The width of the target features the head reads: ``hidden`` (the last hidden state), or the fused
        head's concatenated low, middle and high ones."""
        return self.combine.in_features if self.combine is not None else self.fc.in_features // 2

    def combine_hidden_states(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as ``forward`` reads them: the fused head's one linear map over the concatenated
        layers (vLLM's name); the last hidden state as it is otherwise."""
        return features if self.combine is None else self.combine(features)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The target's token embedding (shared, frozen): what a forward written outside the class reads."""
        return self._shared[0]

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[N, draft_vocab_size]``: what training scores (a full-vocabulary softmax would spend most of the
        LM head's work on tokens the head never proposes)."""
        return self.lm_head(features)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of draft ids (``draft + d2t[draft]``)."""
        return draft_ids + self.d2t[draft_ids]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[N, vocab_size]``: the draft logits at their target ids, ``-inf`` at every id outside the draft
        vocabulary (probability 0: never proposed), as vLLM's EAGLE-3 ``compute_logits`` does."""
        draft = self.draft_logits(features)
        if self._whole_vocab:
            return draft
        out = draft.new_full((draft.shape[0], len(self.t2d)), float("-inf"))
        return out.index_copy_(1, self.draft_ids, draft)

    def save(self, dest: str | Path, info: dict) -> None:
        """The head's own weights (bf16 safetensors) and a config naming the target it reads."""
        from safetensors.torch import save_file

        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        save_file({k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
                   for k, v in self.state_dict().items()}, str(dest / HEAD_FILE))
        aux = {AUX_KEY: list(self.aux_layers)} if self.aux_layers else {}
        (dest / CONFIG_FILE).write_text(json.dumps({"architectures": ["EagleHead"], **info, **aux}, indent=2) + "\n")


def load_eagle_head(path: str | Path, target: LlamaForCausalLM, dtype: torch.dtype,
                    max_positions: int | None = None, fused: bool | None = None,
                    head_cls: type[EagleHead] | None = None) -> EagleHead:
    """A trained head from ``path`` (a folder with ``config.json`` and ``model.safetensors``), bound to ``target``
    (whose hidden size and vocabulary it must share), on the target's device. A head saved without its own LM head
    and ``d2t`` gets the target's, over the whole vocabulary.
    ``fused``: the method asked for an EAGLE-3 head (True, ``"eagle3"``) or an EAGLE one (False, ``"eagle"``): the
    two read different target features, so a head of the other kind is an error, not a silent swap.
    ``head_cls``: the class to build (an ``EagleHead`` subclass with another ``forward``: ``Components.model_registry``)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / CONFIG_FILE).read_text())
    if cfg.get("architectures") != ["EagleHead"]:
        raise ValueError(f"{path} is not an EAGLE head (architectures {cfg.get('architectures')})")
    if cfg.get("hidden_size") != target.config.hidden_size:
        raise ValueError(f"the head reads {cfg.get('hidden_size')}-wide features but the target's are "
                         f"{target.config.hidden_size} wide: a head is trained for one target")
    state = load_file(str(path / HEAD_FILE))
    cls = head_cls or EagleHead
    vocab = target.lm_head.weight.shape[0]
    if cfg.get("vocab_size", vocab) != vocab:
        raise ValueError(f"the head drafts over a {cfg['vocab_size']}-token vocabulary but the target's has {vocab}")
    width, aux = cfg.get("intermediate_size"), cfg.get(AUX_KEY)
    if fused is not None and fused != (aux is not None):
        kind = f"EAGLE-3 head fusing target layers {aux}" if aux else "EAGLE head reading the last hidden state"
        raise ValueError(f"{path} is an {kind}: load it with speculative_config method "
                         f"{'eagle3' if aux else 'eagle'!r}")
    if "d2t" in state:
        d2t = state["d2t"].long()
        head = cls(target, max_positions, d2t + torch.arange(len(d2t)), width, aux)
    else:
        head = cls(target, max_positions, intermediate_size=width, aux_layers=aux)
        state = {**state, **{k: v for k, v in head.state_dict().items() if k in ("d2t", "t2d", "lm_head.weight")}}
    head.load_state_dict(state, strict=True)
    if int(head.t2d.sum()) != head.draft_vocab_size or not bool(head.t2d[head.draft_ids].all()):
        raise ValueError(f"{path}: t2d does not mark exactly the target ids that d2t maps the draft ids to")
    device = target.lm_head.weight.device
    return head.to(device=device, dtype=dtype).eval()
