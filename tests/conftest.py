"""Shared fixtures: the bundled TinyStories pair (loaded once per session) and tiny random HF checkpoints.

Tiny checkpoints are built with transformers itself (the oracle), their weights re-drawn so that every
tensor matters: transformers initialises biases to zero and norm weights to one, which would hide a
dropped bias or a misapplied norm, and its 0.02 init makes logits nearly flat (greedy ties). Each spec is
saved once per session with ``save_pretrained(safe_serialization=True)`` and shared by the tests.
"""

from __future__ import annotations

import math
import os
import random
import zlib
from pathlib import Path

import pytest
import torch

import minifer

# The models here are tiny: extra intra-op threads only add synchronisation, and on a shared, busy CPU an
# OpenMP team of 2+ threads spin-waiting on each other made the suite 10-50x slower. Override with
# MINIFER_TEST_THREADS=N.
torch.set_num_threads(int(os.environ.get("MINIFER_TEST_THREADS", "1")))



@pytest.fixture(autouse=True)
def _seed_global_generators(request):
    """Each test draws from torch's (and ``random``'s) global generator as if it ran alone: seeded from its
    own id, not left in whatever state the tests before it on the same worker left it. xdist splits the
    tests differently from run to run, so without this a test that forgets its own generator could pass
    here and fail in CI on a different draw; with it, every verdict is the same on every run and machine."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO / "minifer" / "assets" / "models"
HELDOUT = REPO / "data" / "tinystories" / "heldout.txt"
EOT = "<|endoftext|>"

TINY_VOCAB = 97

# kind -> (config class name, model class name, config kwargs). Small but with every switch exercised.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
TINY_SPECS = {
    # GQA 3:1, head_dim 16, a non-default theta and llama3 scaling: with theta=1000 and head_dim 16 the
    # wavelengths are 6.3, 15, 35, 84, ... so the table has kept (<8), smoothed (8..32) and divided (>32)
    # frequencies, and positions up to 64 > original_max_position_embeddings=32.
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                   num_key_value_heads=2, max_position_embeddings=64, rope_theta=1000.0,
                   rope_scaling=dict(LLAMA3_ROPE))),
    # Qwen2: q/k/v biases (no o_proj bias), tied embeddings.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                   num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)),
    # Qwen3: per-head q/k RMSNorm, head_dim 32 while hidden/heads = 16.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=64)),
}


def hf_classes(kind: str):
    import transformers

    cfg_name, model_name, _ = TINY_SPECS[kind]
    return getattr(transformers, cfg_name), getattr(transformers, model_name)


def hf_config(kind: str, **overrides):
    """A transformers config of a tiny spec (no BOS/EOS/pad so generation never stops early)."""
    cfg_cls, _ = hf_classes(kind)
    kwargs = dict(vocab_size=TINY_VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                  rms_norm_eps=1e-6)
    kwargs.update(TINY_SPECS[kind][2])
    kwargs.update(overrides)
    return cfg_cls(**kwargs)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter: unit-variance activations, non-trivial norms and biases, peaked logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                scale = 3.0 if "lm_head" in name else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


def build_hf_model(kind: str, seed: int = 0, **overrides):
    _, model_cls = hf_classes(kind)
    torch.manual_seed(seed)
    model = model_cls(hf_config(kind, **overrides)).eval()
    randomize_(model, seed)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``make(kind, seed=0, **config_overrides) -> (hf_model, folder)``; each distinct spec is saved once."""
    cache: dict[tuple, tuple] = {}

    def make(kind: str, seed: int = 0, **overrides):
        key = (kind, seed, repr(sorted(overrides.items())))
        if key not in cache:
            model = build_hf_model(kind, seed, **overrides)
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(folder, safe_serialization=True)
            cache[key] = (model, folder)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def target_llm():
    return minifer.LLM("tinystories-target", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def draft_llm():
    return minifer.LLM("tinystories-draft", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def hf_target():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(MODELS_DIR / "tinystories-target"), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the oracle generates exactly max_new_tokens
    return model


@pytest.fixture(scope="session")
def heldout_stories() -> list[str]:
    text = HELDOUT.read_text(encoding="ascii")
    return [s.strip() for s in text.split(EOT) if s.strip()]


def minifer_forward(llm, ids: list[int]) -> torch.Tensor:
    """Logits ``[T, vocab]`` of one sequence through minifer's model with a ``ContiguousKVCache`` prefill."""
    from minifer.attention.layer import ContiguousKVCache

    cfg = llm.model_config
    n = len(ids)
    dtype = llm.model.lm_head.weight.dtype
    cache = ContiguousKVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, n, cfg.head_dim, dtype, "cpu")
    cache.begin_step(0, n, torch.ones(1, n, dtype=torch.bool))
    with torch.inference_mode():
        hidden = llm.model(torch.tensor(ids), torch.arange(n), cache)
        return llm.model.compute_logits(hidden).float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())
