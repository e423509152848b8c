"""The GPU track's memory plan: what each chapter holds in GPU memory at its peak, by arithmetic alone.

The GPU track (``MINIFER_TRACK=gpu``, ``minifer.course.common.choose_models``) runs the chapters on Qwen3-1.7B
with Qwen3-0.6B as draft. A learner's GPU is often a 16 GB T4 (15 GiB visible to CUDA), so every chapter
must fit in that, and how much each takes is a sum we can do without the GPU: weights (parameters times
bytes per parameter, or the quantized layout's bytes), KV caches (blocks times bytes per block, as
``PagedKVCache`` allocates them), a float32 reference where a chapter compares with transformers, and
headroom for activations.

Two rules make the sums small enough:

- On the GPU, ``ModelPair.load`` gives each engine at most ``GPU_KV_CACHE_BYTES`` of KV cache
  (``kv_blocks_within``) instead of the engine's default of 90% of free memory less 2 GiB, which let the
  first engine a chapter loads take the memory every later one needs.
- The parity checks (``compare_with_transformers``, ``compare_beam_search_with_transformers``) hold one
  float32 model at a time: minifer's copy runs and is freed before transformers' is loaded.

``CHAPTERS`` lists what each chapter keeps alive at its peak, read from its cells; ``chapter_plan`` prices
it for a pair of configs and a dtype, and ``tests/course/test_install_gpu_track.py`` checks every chapter against 15 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from minifer.config import ModelConfig

GiB = 2**30
GPU_KV_CACHE_BYTES = 1 * GiB  # per engine on the GPU track: 585 blocks of 16 tokens of Qwen3-1.7B in 16 bits
ACTIVATION_HEADROOM_BYTES = 1 * GiB  # logits, attention scratch, the allocator's slack
T4_VISIBLE_BYTES = 15 * GiB  # a 16 GB T4 as CUDA reports it (15.1 GiB), the smallest GPU the track plans for


def kv_block_bytes(cfg: ModelConfig, dtype_bytes: int, block_size: int = 16, kv_cache_dtype: str = "auto") -> int:
    """One KV block's bytes as ``PagedKVCache`` allocates it (keys and values, every layer; 8-bit caches add
    their scales)."""
    import torch

    from minifer.layers.paged_attention import PagedKVCache

    dtype = {2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    return PagedKVCache.bytes_per_block(cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, cfg.head_dim,
                                        dtype, kv_cache_dtype)


def kv_blocks_within(cfg: ModelConfig, budget: int, dtype_bytes: int, block_size: int = 16,
                     kv_cache_dtype: str = "auto", requested: int | None = None,
                     draft: ModelConfig | None = None) -> int:
    """KV blocks an engine of ``cfg`` gets from ``budget`` bytes (at most ``requested`` when a chapter asks
    for a number: on the CPU track chapters ask for thousands of the bundled model's small blocks). With a
    draft model, each block also holds the draft's keys and values (``LLMEngine`` gives its cache as many
    blocks), so the same budget buys fewer."""
    per_block = kv_block_bytes(cfg, dtype_bytes, block_size, kv_cache_dtype)
    if draft is not None:
        per_block += kv_block_bytes(draft, dtype_bytes, block_size)
    n = max(1, budget // per_block)
    return n if requested is None else min(n, requested)


def weight_bytes(cfg: ModelConfig, dtype_bytes: int, quantization: str | None = None) -> int:
    """Resident weight bytes: every parameter in ``dtype_bytes``, or, quantized, the decoder linears in their
    format (``minifer.course.weight_bytes.quantized_linear_bytes``) and the rest (embeddings, norms) in 16 bits."""
    total = cfg.num_parameters() * dtype_bytes
    if quantization is None:
        return total
    from minifer.course.weight_bytes import decoder_linear_shapes, quantized_linear_bytes

    shapes = decoder_linear_shapes(cfg).values()
    linears = cfg.num_hidden_layers * sum(n * k for n, k in shapes)
    quantized = cfg.num_hidden_layers * sum(quantized_linear_bytes(n, k, quantization) for n, k in shapes)
    return total - linears * dtype_bytes + quantized


@dataclass(frozen=True)
class Resident:
    """One thing a chapter holds in GPU memory at its peak."""

    what: str
    model: str  # "target" or "draft"
    weights: str = "model"  # "model" (the track's dtype), "float32", "int8", "int4", "shared" (another engine's)
    kv_cache: bool = True  # an engine with its own KV cache (GPU_KV_CACHE_BYTES at most, a draft's included)


# What each chapter keeps alive at once, at its peak (read from its cells). The parity checks hold one
# float32 model at a time, so the larger of the two (transformers' own) is the one listed.
CHAPTERS: dict[str, list[Resident]] = {
    "00": [Resident("the target", "target"),
           Resident("transformers' float32 reference (parity check)", "target", "float32", kv_cache=False)],
    "01": [Resident("the target", "target")],
    "02": [Resident("the target", "target"),
           Resident("transformers' float32 reference (beam search check)", "target", "float32", kv_cache=False)],
    "03": [Resident("the target", "target"), Resident("the 'tight' engine (12 blocks)", "target")],
    "04": [Resident("plain decoding", "target"), Resident("draft-model speculation (k = 4)", "target"),
           Resident("its draft", "draft", kv_cache=False), Resident("adaptive speculation", "target", "shared"),
           Resident("n-gram speculation", "target", "shared"), Resident("n-gram, grounded", "target", "shared")],
    "05": [Resident("the reference", "target"), Resident("int8 weights", "target", "int8"),
           Resident("int4 weights", "target", "int4"), Resident("int4 reloaded from its checkpoint", "target", "int4")],
    "06": [Resident("the 16-bit holder", "target"), Resident("its draft", "draft", kv_cache=False),
           Resident("the int8 holder", "target", "int8", kv_cache=False),
           Resident("the int8 holder's draft", "draft", kv_cache=False)],  # the levers' engines share these
}


def chapter_plan(chapter: str, target: ModelConfig, draft: ModelConfig, dtype_bytes: int = 2,
                 kv_budget: int = GPU_KV_CACHE_BYTES) -> list[tuple[str, int]]:
    """``(what, bytes)`` of everything ``chapter`` holds at its peak, headroom included."""
    if chapter not in CHAPTERS:
        raise ValueError(f"unknown chapter {chapter!r}: one of {', '.join(CHAPTERS)}")
    rows = []
    for r in CHAPTERS[chapter]:
        cfg = target if r.model == "target" else draft
        if r.weights != "shared":
            size = weight_bytes(cfg, 4 if r.weights == "float32" else dtype_bytes,
                                r.weights if r.weights in ("int8", "int4") else None)
            if r.weights == "float32":
                size = cfg.num_parameters() * 4
            rows.append((f"{r.what}: weights", size))
        if r.kv_cache:
            blocks = kv_blocks_within(cfg, kv_budget, dtype_bytes)
            rows.append((f"{r.what}: KV cache ({blocks} blocks)", blocks * kv_block_bytes(cfg, dtype_bytes)))
            # (a speculating engine's blocks also hold its draft's part: fewer blocks, the same budget)
    rows.append(("activations and allocator headroom", ACTIVATION_HEADROOM_BYTES))
    return rows


def gpu_track_needs(dtype_bytes: int = 2) -> dict[str, int]:
    """Each chapter's peak bytes for the GPU pair (Qwen3-1.7B + Qwen3-0.6B, shipped configs)."""
    from minifer.loader import SHIPPED_CONFIGS

    target = ModelConfig.from_file(SHIPPED_CONFIGS["Qwen/Qwen3-1.7B"])
    draft = ModelConfig.from_file(SHIPPED_CONFIGS["Qwen/Qwen3-0.6B"])
    return {ch: sum(b for _, b in chapter_plan(ch, target, draft, dtype_bytes)) for ch in CHAPTERS}


def _largest() -> int:
    try:
        return max(gpu_track_needs().values())
    except Exception:  # noqa: BLE001 - a broken asset must not stop `import minifer.doctor`
        return T4_VISIBLE_BYTES


GPU_TRACK_NEEDS_BYTES = _largest()
