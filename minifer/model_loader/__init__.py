"""Finding and loading checkpoints: bundled names, local HF folders, hub ids, and dummy weights.

``resolve_model`` turns what the user wrote into a local folder: a bundled name (``"tinystories-target"``) ->
``minifer/assets/models/NAME``; an existing local HF checkpoint directory; otherwise a Hugging Face hub id
(``"Qwen/Qwen3-0.6B"``), downloaded with ``huggingface_hub``, with a clear message when the hub cannot be reached.

``load_format="dummy"`` (vLLM's name) builds the real architecture with random weights: real model *shapes* for
benchmarks, with no download. A few real models' configs ship in ``minifer/assets/configs``, so
``LLM("Qwen/Qwen3-0.6B", load_format="dummy")`` works offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minifer.config import ModelConfig, UnsupportedModelError
from minifer.models.llama import LlamaForCausalLM

ASSETS = Path(__file__).resolve().parents[1] / "assets"
BUNDLED_MODELS = {"tinystories-target": ASSETS / "models" / "tinystories-target",
                  "tinystories-draft": ASSETS / "models" / "tinystories-draft",
                  "tinystories-target-eagle": ASSETS / "models" / "tinystories-target-eagle",
                  "tinystories-target-eagle3": ASSETS / "models" / "tinystories-target-eagle3"}
SHIPPED_CONFIGS = {p.stem.replace("--", "/"): p for p in sorted((ASSETS / "configs").glob("*.json"))}


class ModelLoadError(RuntimeError):
    """The model could not be found, downloaded or read; the message says which and why."""


def resolve_model(model: str | Path, *, need_weights: bool = True) -> Path:
    """Return a local folder (or, for dummy loads of a shipped config, that config's path)."""
    name = str(model)
    if name in BUNDLED_MODELS:
        return BUNDLED_MODELS[name]
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory but holds no config.json: not a Hugging Face checkpoint")
        return path
    if path.suffix == ".json" and path.is_file():
        return path
    if not need_weights and name in SHIPPED_CONFIGS:
        return SHIPPED_CONFIGS[name]
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ModelLoadError(
            f"model {name!r} not found: give a bundled name ({', '.join(BUNDLED_MODELS)}), a local Hugging Face "
            f"checkpoint directory, or a hub id such as 'Qwen/Qwen3-0.6B'")
    return _download(name, need_weights)


def _download(repo_id: str, need_weights: bool) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub comes with transformers
        raise ModelLoadError("huggingface_hub is not installed, so hub ids cannot be downloaded") from e
    patterns = ["*.json", "tokenizer*", "*.model"] + (["*.safetensors"] if need_weights else [])
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # the hub raises many types (offline, 404, gated, timeouts)
        hint = (f" Shipped configs for load_format='dummy': {', '.join(SHIPPED_CONFIGS)}." if SHIPPED_CONFIGS else "")
        raise ModelLoadError(
            f"could not download {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {str(e)[:200]}). "
            f"If this machine is offline, pass a local checkpoint directory or a bundled model "
            f"({', '.join(BUNDLED_MODELS)}).{hint}") from None


def load_config(path: Path) -> ModelConfig:
    cfg_file = path if path.suffix == ".json" else path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path}: no config.json")
    return ModelConfig.from_file(cfg_file)


def _safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: corrupt shard index ({e})") from e
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shards listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (only safetensors checkpoints are supported)")
    return files


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, by their transformers names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(path):
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors file ({e})") from e
    return tensors


def fuse_checkpoint(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map transformers' parameter names onto minifer's fused q/k/v and gate/up projections."""
    out: dict[str, torch.Tensor] = {}
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
             "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if name.startswith("model.") and ".rotary_emb." in name:
            continue
        pieces = name.split(".")
        if len(pieces) >= 2 and pieces[-2] in fused:
            key = ".".join(pieces[:-2] + [fused[pieces[-2]], pieces[-1]])
            parts.setdefault(key, {})[pieces[-2]] = t
        else:
            out[name] = t
    order = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for key, group in parts.items():
        want = order[key.split(".")[-2]]
        missing = [w for w in want if w not in group]
        if missing:
            raise ModelLoadError(f"checkpoint is missing {', '.join(key.replace(key.split('.')[-2], m) for m in missing)}")
        out[key] = torch.cat([group[w] for w in want], dim=0)
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def build_model(path: Path, *, load_format: str, dtype: torch.dtype, device: torch.device,
                max_positions: int | None = None, seed: int = 0,
                model_cls: type[LlamaForCausalLM] = LlamaForCausalLM) -> LlamaForCausalLM:
    """Instantiate the architecture from ``config.json`` and fill its weights (or random ones for dummy).
    ``model_cls``: the class to build (a subclass with other layer classes: ``Components.model_registry``)."""
    cfg = load_config(path)
    with torch.device("meta"):
        model = model_cls(cfg, max_positions)
    model = model.to_empty(device=device)
    # The RoPE tables are buffers computed at init; recompute them on the real device.
    model.model.rotary.__init__(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                                cfg.rope_scaling)
    model.model.rotary.to(device)
    if load_format == "dummy":
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)  # in place, on the target device
    elif load_format in ("auto", "safetensors"):
        if path.suffix == ".json":
            raise ModelLoadError(f"{path} is a config only: use load_format='dummy' for random weights")
        state = fuse_checkpoint(read_checkpoint(path), cfg)
        expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
        if missing or unexpected:
            raise ModelLoadError(f"{path}: checkpoint does not match a {cfg.architecture} with this config.json "
                                 f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in state.items():
                if params[name].shape != t.shape:
                    raise ModelLoadError(f"{path}: {name} has shape {tuple(t.shape)}, config.json implies "
                                         f"{tuple(params[name].shape)}")
                params[name].copy_(t)
    else:
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(dtype).eval()


def load_tokenizer(path: Path):
    """transformers' AutoTokenizer of the folder (None when a dummy config has no tokenizer)."""
    if path.suffix == ".json" or not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model",
                                                                        "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # corrupt or incompatible tokenizer files
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from e


def chat_token_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt of a conversation: the chat template with the assistant's turn opened (transformers 4.x returns
    a list of ids, 5.x a ``BatchEncoding``)."""
    from collections.abc import Mapping

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
