"""The GPU track is opt-in, says what it downloads, and every chapter's plan fits a 16 GB GPU.

No GPU here: CUDA's presence and capability are monkeypatched, and the memory is arithmetic
(``minifer_course.gpu_plan``), not allocations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import minifer
from minifer_course import common as notebook, gpu_plan
from minifer.config import ModelConfig
from minifer.model_loader import SHIPPED_CONFIGS
from minifer_course.common import BUNDLED_PAIR, GPU_PAIR, ModelPair, choose_models

ROOT = Path(__file__).resolve().parents[2]
TARGET = ModelConfig.from_file(SHIPPED_CONFIGS["Qwen/Qwen3-1.7B"])
DRAFT = ModelConfig.from_file(SHIPPED_CONFIGS["Qwen/Qwen3-0.6B"])


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA machine (a T4: compute capability 7.5) whose Hub answers and whose cache is empty."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(notebook, "hub_reachable", lambda timeout=2.0: True)
    monkeypatch.setattr(notebook, "_in_hf_cache", lambda repo: False)


def test_a_gpu_machine_stays_on_the_cpu_track_unless_asked(fake_cuda):
    pair = choose_models({})
    assert (pair.target, pair.draft, pair.device) == (*BUNDLED_PAIR, "cpu")
    assert "MINIFER_TRACK=gpu" in pair.reason and "Qwen/Qwen3-1.7B (~3.4 GB)" in pair.reason, pair.reason


def test_the_gpu_track_says_what_it_downloads(fake_cuda):
    pair = choose_models({"MINIFER_TRACK": "gpu"})
    assert (pair.target, pair.draft, pair.device) == (*GPU_PAIR, "cuda")
    assert "downloads Qwen/Qwen3-1.7B (~3.4 GB), Qwen/Qwen3-0.6B (~1.2 GB)" in str(pair), str(pair)
    assert str(choose_models({"MINIFER_TRACK": "gpu"}, chapter="04")).endswith(
        "chapter 04 needs 12.9 GiB of GPU memory, and its KV caches take what its models leave)")
    assert str(choose_models({}, chapter="04")) == str(choose_models({}))  # the CPU track prints what it did


def test_the_gpu_track_without_hub_or_gpu_falls_back_and_says_why(fake_cuda, monkeypatch):
    monkeypatch.setattr(notebook, "hub_reachable", lambda timeout=2.0: False)
    pair = choose_models({"MINIFER_TRACK": "GPU"})
    assert (pair.target, pair.device) == (BUNDLED_PAIR[0], "cuda") and "no Hub access" in pair.reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pair = choose_models({"MINIFER_TRACK": "gpu"})
    assert pair.device == "cpu" and pair.reason.startswith("MINIFER_TRACK=gpu, but no CUDA GPU")


def test_cached_models_are_not_counted_as_downloads(fake_cuda, monkeypatch):
    monkeypatch.setattr(notebook, "_in_hf_cache", lambda repo: repo == "Qwen/Qwen3-1.7B")
    assert notebook.gpu_track_download_note() == "downloads Qwen/Qwen3-1.7B (cached), Qwen/Qwen3-0.6B (~1.2 GB)"


def test_every_chapter_is_planned():
    chapters = {p.name[:2] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert chapters == set(gpu_plan.CHAPTERS), "a chapter was added or removed: plan its GPU memory in gpu_plan.CHAPTERS"


@pytest.mark.parametrize("chapter", sorted(gpu_plan.CHAPTERS))
def test_every_chapter_fits_a_16_gb_gpu(chapter):
    """The GPU pair in float16 (what dtype='auto' picks on a T4), the parity references in the same dtype, and
    the KV caches sized after the models: on the 15 GiB a T4 shows CUDA, every chapter's peak fits, every
    engine gets at least MIN_KV_BLOCKS blocks (a speculating one's hold its draft's part too), and the least
    the chapter needs leaves room to spare."""
    t4 = gpu_plan.T4_VISIBLE_BYTES
    rows = gpu_plan.chapter_plan(chapter, TARGET, DRAFT, dtype_bytes=2, device_bytes=t4)
    assert sum(b for _, b in rows) <= t4, [(w, round(b / 2**30, 2)) for w, b in rows]
    assert all(b > 0 for _, b in rows)
    blocks = [int(w.rsplit("(", 1)[1].split()[0]) for w, _ in rows if ": KV cache (" in w]
    assert len(blocks) == sum(r.kv_cache for r in gpu_plan.CHAPTERS[chapter]) and min(blocks) >= gpu_plan.MIN_KV_BLOCKS
    least = sum(b for _, b in gpu_plan.chapter_plan(chapter, TARGET, DRAFT, dtype_bytes=2))
    assert least == gpu_plan.gpu_track_needs()[chapter] <= t4
    # the caches take what the models leave: all but less than a block per engine of the 15 GiB is planned
    assert t4 - sum(b for _, b in rows) < len(blocks) * 2 * gpu_plan.kv_block_bytes(TARGET, 2)


def test_a_gpu_too_small_for_a_chapter_is_refused_with_the_numbers():
    assert gpu_plan.kv_share("01", TARGET, DRAFT, 2, 8 * 2**30) > 0  # 01 holds one 16-bit model: 8 GiB is enough
    with pytest.raises(ValueError, match=r"chapter 05 on the GPU track needs 14\.0 GiB .* this GPU has 8\.0 GiB"):
        gpu_plan.kv_share("05", TARGET, DRAFT, 2, 8 * 2**30)


def test_a_larger_gpu_gets_larger_caches():
    """An 80 GB GPU: the same models, so every byte beyond 15 GiB goes to the KV caches."""
    small = gpu_plan.kv_share("04", TARGET, DRAFT, 2, gpu_plan.T4_VISIBLE_BYTES)
    large = gpu_plan.kv_share("04", TARGET, DRAFT, 2, 80 * 2**30)
    assert large - small == (80 * 2**30 - gpu_plan.T4_VISIBLE_BYTES) // 5  # chapter 04 runs five engines


def test_the_old_policy_did_not_fit():
    """The control: chapter 00 as it was, the engine taking 0.9 x free memory - 2 GiB for its KV cache and then
    minifer's float32 copy and transformers' float32 model both resident: far over 15 GiB. Now the same GPU
    holds the engine, transformers' 16-bit reference and a 7.7 GiB KV cache."""
    weights = gpu_plan.weight_bytes(TARGET, 2)
    old_kv = int(0.9 * (gpu_plan.T4_VISIBLE_BYTES - weights)) - 2 * 2**30
    old = weights + old_kv + 2 * TARGET.num_parameters() * 4
    assert old > gpu_plan.T4_VISIBLE_BYTES + 5 * 2**30
    rows = dict(gpu_plan.chapter_plan("00", TARGET, DRAFT, device_bytes=gpu_plan.T4_VISIBLE_BYTES))
    assert sum(rows.values()) <= gpu_plan.T4_VISIBLE_BYTES
    assert rows["the target: KV cache (4441 blocks)"] > 7.5 * 2**30


def test_plan_arithmetic_matches_the_engine():
    """The plan's block bytes are the cache's own (Qwen3-1.7B: 28 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
    x 16 tokens), quantized weights are smaller than 16-bit ones, and a draft's part shrinks the block count."""
    assert gpu_plan.kv_block_bytes(TARGET, 2) == 28 * 8 * 128 * 2 * 2 * 16
    assert gpu_plan.kv_blocks_within(TARGET, 2**30, 2) == 2**30 // (28 * 8 * 128 * 2 * 2 * 16) == 585
    assert gpu_plan.kv_blocks_within(TARGET, 2**30, 2, requested=12) == 12
    assert gpu_plan.kv_blocks_within(TARGET, 2**30, 2, draft=DRAFT) == 292
    w16, w8, w4 = (gpu_plan.weight_bytes(TARGET, 2, q) for q in (None, "int8", "int4"))
    assert w16 == TARGET.num_parameters() * 2 and w4 < w8 < w16
    with pytest.raises(ValueError, match="unknown chapter '07'"):
        gpu_plan.chapter_plan("07", TARGET, DRAFT)


def test_pair_load_holds_each_gpu_engine_to_the_budget(fake_cuda, monkeypatch):
    """On the GPU a chapter's num_kv_blocks=4096 (sized for the bundled model's small blocks) becomes what the
    budget holds for Qwen3-1.7B; on the CPU the chapter's own number passes through untouched."""
    seen = []
    monkeypatch.setattr(minifer, "LLM", lambda name, **kw: seen.append((name, kw)))
    ModelPair(*GPU_PAIR, "cuda", "test").load("target", num_kv_blocks=4096)
    ModelPair(*GPU_PAIR, "cuda", "test").load("target", speculative_config={"method": "draft_model",
                                                                           "model": GPU_PAIR[1]})
    ModelPair(*BUNDLED_PAIR, "cpu", "test").load("target", num_kv_blocks=4096)
    assert [kw.get("num_kv_blocks") for _, kw in seen] == [585, 292, 4096]


def test_pair_load_sizes_the_cache_after_the_chapters_models(fake_cuda, monkeypatch):
    """With a chapter named (as every notebook's choose_models(chapter=...) does), a T4's 15 GiB less chapter
    04's models and headroom, in five equal shares: 758 blocks for a plain engine, 379 for a speculating one
    (its blocks hold the draft's part), at most what a cell asks for; the same call on an 80 GB GPU gets more."""
    seen = []
    monkeypatch.setattr(minifer, "LLM", lambda name, **kw: seen.append(kw.get("num_kv_blocks")))
    monkeypatch.setattr(notebook, "gpu_available_bytes", lambda device="cuda": gpu_plan.T4_VISIBLE_BYTES)
    pair = choose_models({"MINIFER_TRACK": "gpu"}, chapter="04")
    assert pair.chapter == "04"
    pair.load("target", num_kv_blocks=4096)
    pair.load("target", speculative_config={"method": "draft_model", "model": GPU_PAIR[1]})
    pair.load("target", num_kv_blocks=256)
    monkeypatch.setattr(notebook, "gpu_available_bytes", lambda device="cuda": 80 * 2**30)
    pair.load("target")
    assert seen[:3] == [758, 379, 256] and seen[3] > 4 * 758


def test_chapter_06_builds_one_engine_at_a_time_within_the_budget(fake_cuda, monkeypatch):
    """Chapter 06's ten configurations would hold ten caches at once; on a GPU they are built one at a time
    (minifer_course.stacking), so a T4 holds the two weight sets, two drafts and the largest one cache: the memory
    budget its cell passes (pair.kv_budget()) is what the models leave, and a speculating configuration, whose
    budget also pays for the draft's weights, still gets its MIN_KV_BLOCKS."""
    monkeypatch.setattr(notebook, "gpu_available_bytes", lambda device="cuda": gpu_plan.T4_VISIBLE_BYTES)
    pair = choose_models({"MINIFER_TRACK": "gpu"}, chapter="06")
    kv_memory = pair.kv_budget()
    assert kv_memory == gpu_plan.kv_share("06", TARGET, DRAFT, 2, gpu_plan.T4_VISIBLE_BYTES)
    spec_blocks = (kv_memory - gpu_plan.weight_bytes(DRAFT, 2)) // (2 * gpu_plan.kv_block_bytes(TARGET, 2))
    assert spec_blocks >= gpu_plan.MIN_KV_BLOCKS
    assert gpu_plan.kv_block_bytes(TARGET, 2) == gpu_plan.kv_block_bytes(DRAFT, 2)  # (why the 2 above)


def test_the_parity_check_compares_in_the_models_dtype_on_a_gpu():
    """On a GPU the engine is compared as it runs (no float32 copy: chapter 00's plan holds no 6.9 GB copies);
    on the CPU a 16-bit engine is still compared through a float32 copy, and a float32 one as it is."""
    from types import SimpleNamespace

    from minifer_course.ch00_generation import _reference_copy

    gpu_llm = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda"))
    with _reference_copy(gpu_llm) as ref:
        assert ref is gpu_llm
    cpu16 = minifer.LLM("tinystories-draft", dtype="bfloat16", device="cpu", batching="static")
    with _reference_copy(cpu16) as ref:
        assert ref is not cpu16 and ref.dtype == torch.float32
    cpu32 = minifer.LLM("tinystories-draft", dtype="float32", device="cpu", batching="static")
    with _reference_copy(cpu32) as ref:
        assert ref is cpu32


def test_the_plan_prices_the_bundled_pair_too(target_llm):
    """MINIFER_TRACK=gpu without Hub access runs the bundled pair on the GPU, and its chapters are planned the same
    way: the int4 arithmetic follows quantize_model's group fallback (the target's down_proj, K = 704, at g64) and
    equals the bytes a quantized copy really holds."""
    import copy

    from minifer.model_loader import load_config, resolve_model
    from minifer.quantization.linear import weight_bytes
    from minifer.quantization.model import quantize_model

    target, draft = (load_config(resolve_model(m)) for m in BUNDLED_PAIR)
    model = copy.deepcopy(target_llm.model).to(torch.bfloat16)
    quantize_model(model, "int4")
    assert gpu_plan.weight_bytes(target, 2, "int4") == weight_bytes(model)["total"]
    assert all(gpu_plan.kv_share(ch, target, draft, 2, gpu_plan.T4_VISIBLE_BYTES) > 2**30 for ch in gpu_plan.CHAPTERS)
