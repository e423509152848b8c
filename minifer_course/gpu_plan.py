"""The GPU track's memory plan: what each chapter holds in GPU memory at its peak, by arithmetic alone.

The GPU track (``MINIFER_TRACK=gpu``, ``minifer_course.common.choose_models``) runs the chapters on Qwen3-1.7B
with Qwen3-0.6B as draft. A learner's GPU is often a 16 GB T4 (15 GiB visible to CUDA), so every chapter
must fit in that, and how much each takes is a sum we can do without the GPU: weights (parameters times
bytes per parameter, or the quantized layout's bytes), KV caches (blocks times bytes per block, as
``PagedKVCache`` allocates them), and headroom for activations.

Two rules make the sums fit:

- The KV caches are sized after the models: ``ModelPair.load`` gives each engine a chapter starts an equal
  share of what the GPU has left once *every* model the chapter loads is counted (``kv_share``), not the
  engine's default of 90% of free memory less 2 GiB, which let the first engine a chapter loads take the
  memory every later one needs. A 16 GB GPU then gets caches of 1-5 GiB per engine, a larger GPU larger
  ones; a GPU too small for a chapter's models plus ``MIN_KV_BLOCKS`` per engine is refused before anything
  is loaded, with the numbers.
- The parity checks (``compare_with_transformers``, ``compare_beam_search_with_transformers``) run on the GPU
  in the model's own dtype: transformers' copy is a second 16-bit model, not a float32 one (6.9 GB for
  Qwen3-1.7B), and minifer's engine is compared as it is, without a float32 copy.

Chapter 06 builds ten engines (``minifer_course.stacking``); on a GPU they are built one at a time beside the
weights they share, and the share is the memory budget its cell passes (``ModelPair.kv_budget``).

``CHAPTERS`` lists what each chapter keeps alive at its peak, read from its cells; ``chapter_plan`` prices
it for a pair of configs, a dtype and a GPU size, and ``tests/repo/test_install_gpu_track.py`` checks every
chapter against 15 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from minifer.config import ModelConfig

GiB = 2**30
GPU_KV_CACHE_BYTES = 1 * GiB  # per engine when no chapter is named: 585 blocks of 16 tokens of Qwen3-1.7B in 16 bits
MIN_KV_BLOCKS = 256  # the least an engine may get: the fewest a chapter cell asks for (05's), bar 03's 12-block demo
ACTIVATION_HEADROOM_BYTES = 1 * GiB  # logits, attention scratch, the allocator's slack
T4_VISIBLE_BYTES = 15 * GiB  # a 16 GB T4 as CUDA reports it (15.1 GiB), the smallest GPU the track plans for


def kv_block_bytes(cfg: ModelConfig, dtype_bytes: int, block_size: int = 16, kv_cache_dtype: str = "auto") -> int:
    """One KV block's bytes as ``PagedKVCache`` allocates it (keys and values, every layer; 8-bit caches add
    their scales)."""
    import torch

    from minifer.attention.backends.paged import PagedKVCache

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
    format (``minifer_course.weight_bytes.quantized_linear_bytes``) and the rest (embeddings, norms) in 16 bits."""
    total = cfg.num_parameters() * dtype_bytes
    if quantization is None:
        return total
    from minifer.quantization.model import group_for
    from minifer_course.weight_bytes import decoder_linear_shapes, quantized_linear_bytes

    shapes = decoder_linear_shapes(cfg)
    linears = cfg.num_hidden_layers * sum(n * k for n, k in shapes.values())
    # int4's group is 128, or quantize_model's fallback where 128 does not divide K (the bundled target's 704)
    quantized = cfg.num_hidden_layers * sum(quantized_linear_bytes(n, k, quantization, group_for(name, k, 128))
                                            for name, (n, k) in shapes.items())
    return total - linears * dtype_bytes + quantized


@dataclass(frozen=True)
class Resident:
    """One thing a chapter holds in GPU memory at its peak."""

    what: str
    model: str  # "target" or "draft"
    weights: str = "model"  # "model" (the track's dtype), "float32", "int8", "int4", "shared" (another engine's)
    kv_cache: bool = True  # an engine with its own KV cache (an equal share of what the models leave)
    with_draft: bool = False  # a speculating engine: each of its KV blocks also holds the draft's keys and values
    stacking: bool = False  # chapter 06's engines (minifer_course.stacking), built one at a time on a GPU: the share is
    # their memory budget ``kv_memory``; an int8-weights one's cache also gets the bytes int8 saves, a speculating
    # one's loses the draft's weights


# What each chapter keeps alive at once, at its peak (read from its cells). The parity checks compare with
# transformers' model in the track's dtype, loaded beside the chapter's engine.
CHAPTERS: dict[str, list[Resident]] = {
    "00": [Resident("the target", "target"),
           Resident("transformers' reference (parity check, same dtype)", "target", kv_cache=False)],
    "01": [Resident("the target", "target"),
           # load_real_shape: Qwen3-0.6B's shape with dummy weights (the GPU pair's draft config), a 16-block cache
           Resident("the Qwen3-0.6B-shaped model (section 5)", "draft", kv_cache=False)],
    "02": [Resident("the target", "target"),
           Resident("transformers' reference (beam search check, same dtype)", "target", kv_cache=False)],
    "03": [Resident("the target", "target"), Resident("the 'tight' engine (12 blocks)", "target")],
    "04": [Resident("plain decoding", "target"), Resident("draft-model speculation (k = 4)", "target", with_draft=True),
           Resident("its draft", "draft", kv_cache=False),
           Resident("adaptive speculation", "target", "shared", with_draft=True),
           Resident("n-gram speculation", "target", "shared"), Resident("n-gram, grounded", "target", "shared")],
    "05": [Resident("the reference", "target"), Resident("int8 weights", "target", "int8"),
           Resident("int4 weights", "target", "int4"), Resident("int4 reloaded from its checkpoint", "target", "int4"),
           Resident("the KV-cache formats' engine (kv_cache_runs, one at a time)", "target")],
    "06": [Resident("the 16-bit holder", "target", kv_cache=False), Resident("its draft", "draft", kv_cache=False),
           Resident("the int8 holder", "target", "int8", kv_cache=False),
           Resident("the int8 holder's draft", "draft", kv_cache=False),  # every configuration shares these weights
           Resident("the configuration being measured (one at a time)", "target", "shared", stacking=True)],
}


def _weight_rows(chapter: str, target: ModelConfig, draft: ModelConfig, dtype_bytes: int) -> list[tuple[str, int]]:
    if chapter not in CHAPTERS:
        raise ValueError(f"unknown chapter {chapter!r}: one of {', '.join(CHAPTERS)}")
    rows = []
    for r in CHAPTERS[chapter]:
        if r.weights == "shared":
            continue
        cfg = target if r.model == "target" else draft
        size = (cfg.num_parameters() * 4 if r.weights == "float32" else
                weight_bytes(cfg, dtype_bytes, r.weights if r.weights in ("int8", "int4") else None))
        rows.append((f"{r.what}: weights", size))
    return rows


def _int8_savings(r: Resident, target: ModelConfig, dtype_bytes: int) -> int:
    """What a stacking engine's cache gains beyond the share when its configuration has int8 weights."""
    return weight_bytes(target, dtype_bytes) - weight_bytes(target, dtype_bytes, "int8") if r.stacking else 0


def min_kv_share(chapter: str, target: ModelConfig, draft: ModelConfig, dtype_bytes: int = 2) -> int:
    """The KV bytes per engine that give every engine of ``chapter`` at least ``MIN_KV_BLOCKS`` blocks (a stacking
    budget must also hold the draft's weights, which a speculating configuration takes from it)."""
    least = []
    for r in CHAPTERS[chapter]:
        if r.kv_cache:
            spec = r.with_draft or r.stacking
            per_block = kv_block_bytes(target, dtype_bytes) + (kv_block_bytes(draft, dtype_bytes) if spec else 0)
            least.append(MIN_KV_BLOCKS * per_block + (weight_bytes(draft, dtype_bytes) if r.stacking else 0))
    return max(least)


def kv_share(chapter: str, target: ModelConfig, draft: ModelConfig, dtype_bytes: int, device_bytes: int) -> int:
    """KV bytes each engine of ``chapter`` gets on a GPU of ``device_bytes``: what is left after every model the
    chapter loads and the headroom, in equal shares. Raises ``ValueError`` when a share would be below
    ``min_kv_share``, saying how much the chapter needs."""
    weights = sum(b for _, b in _weight_rows(chapter, target, draft, dtype_bytes))
    weights += sum(_int8_savings(r, target, dtype_bytes) for r in CHAPTERS[chapter])
    engines = sum(r.kv_cache for r in CHAPTERS[chapter])
    share = (device_bytes - weights - ACTIVATION_HEADROOM_BYTES) // engines
    least = min_kv_share(chapter, target, draft, dtype_bytes)
    if share < least:
        need = weights + ACTIVATION_HEADROOM_BYTES + engines * least
        raise ValueError(f"chapter {chapter} on the GPU track needs {need / GiB:.1f} GiB of GPU memory (its models "
                         f"{weights / GiB:.1f} GiB, {engines} KV cache(s) of at least {MIN_KV_BLOCKS} blocks, "
                         f"{ACTIVATION_HEADROOM_BYTES / GiB:.0f} GiB of headroom); this GPU has "
                         f"{device_bytes / GiB:.1f} GiB available: use the CPU track, or MINIFER_TARGET / "
                         f"MINIFER_DRAFT for smaller models")
    return share


def chapter_plan(chapter: str, target: ModelConfig, draft: ModelConfig, dtype_bytes: int = 2,
                 device_bytes: int | None = None) -> list[tuple[str, int]]:
    """``(what, bytes)`` of everything ``chapter`` holds at its peak, headroom included: on a GPU of
    ``device_bytes`` (its KV caches fill what the models leave), or, with None, the chapter's least (the equal
    share that gives every engine ``MIN_KV_BLOCKS``)."""
    rows = _weight_rows(chapter, target, draft, dtype_bytes)
    share = (min_kv_share(chapter, target, draft, dtype_bytes) if device_bytes is None
             else kv_share(chapter, target, draft, dtype_bytes, device_bytes))
    for r in CHAPTERS[chapter]:
        if r.kv_cache:
            cfg = target if r.model == "target" else draft
            per_block = kv_block_bytes(cfg, dtype_bytes) + (kv_block_bytes(draft, dtype_bytes) if r.with_draft else 0)
            blocks = (share + _int8_savings(r, target, dtype_bytes)) // per_block  # stacking: its largest cache
            rows.append((f"{r.what}: KV cache ({blocks} blocks)", blocks * per_block))
    rows.append(("activations and allocator headroom", ACTIVATION_HEADROOM_BYTES))
    return rows


def gpu_track_needs(dtype_bytes: int = 2) -> dict[str, int]:
    """Each chapter's least GPU memory for the GPU pair (Qwen3-1.7B + Qwen3-0.6B, shipped configs): its models,
    ``MIN_KV_BLOCKS`` per KV cache and the headroom. On a GPU the caches grow into whatever is beyond."""
    from minifer.model_loader import SHIPPED_CONFIGS

    target = ModelConfig.from_file(SHIPPED_CONFIGS["Qwen/Qwen3-1.7B"])
    draft = ModelConfig.from_file(SHIPPED_CONFIGS["Qwen/Qwen3-0.6B"])
    return {ch: sum(b for _, b in chapter_plan(ch, target, draft, dtype_bytes)) for ch in CHAPTERS}


def _largest() -> int:
    try:
        return max(gpu_track_needs().values())
    except Exception:  # noqa: BLE001 - a broken asset must not stop `import minifer_course.doctor`
        return T4_VISIBLE_BYTES


GPU_TRACK_NEEDS_BYTES = _largest()
