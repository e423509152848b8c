"""The GPU track's code path in CI, on the CPU: every chapter's GPU-track calls on the Qwen3 pair's real widths with
dummy weights and 2 layers, in the T4's float16 (``scripts/gpu_track_dummy.py``; its ``--all-layers`` is the
full-size manual run). Random weights: the test checks that each chapter's path runs and keeps its invariants
(shapes, counts, a reloaded checkpoint's tokens), not any number a chapter reports."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_track_dummy", ROOT / "scripts" / "gpu_track_dummy.py")
gtd = importlib.util.module_from_spec(_spec)
sys.modules["gpu_track_dummy"] = gtd  # (its dataclass looks its module up there)
_spec.loader.exec_module(gtd)


def test_the_dummy_pair_has_the_gpu_pairs_width_and_two_layers(tmp_path):
    from minifer.model_loader import load_config
    from minifer_course.common import GPU_PAIR

    pair = gtd.dummy_pair(tmp_path, layers=2)
    target, draft = (load_config(Path(p)) for p in (pair.target, pair.draft))
    assert (target.hidden_size, target.num_attention_heads, target.num_key_value_heads, target.head_dim) == \
        (2048, 16, 8, 128)
    assert (draft.hidden_size, draft.vocab_size, target.vocab_size) == (1024, 151936, 151936)
    assert target.num_hidden_layers == draft.num_hidden_layers == 2 and target.tie_word_embeddings
    assert GPU_PAIR == ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-0.6B")


@pytest.mark.slow
def test_every_chapters_gpu_track_runs_on_dummy_weights(tmp_path):
    results = gtd.run(layers=2, max_tokens=3, folder=tmp_path)
    assert set(results) == set(gtd.CHAPTERS) == {"00", "01", "02", "03", "04", "05"}
    r = results["00"]
    assert (r["layers"], r["hidden_size"], r["vocab"], r["dtype"], r["tokens"]) == (2, 2048, 151936, "torch.float16", 3)
    assert r["params_agree"]
    assert results["01"]["step_seconds"] and results["01"]["floor_seconds"]
    assert results["02"]["tokens"] == 2 * 3 and results["02"]["kv_blocks"] == 32
    assert results["03"]["preemptions"] > 0  # 3 blocks cannot hold four 20-token requests at once
    assert results["04"]["step"] and results["04"]["proposed"] > 0
    assert set(results["04"]["same_tokens"]) == {"plain", "draft", "adaptive", "ngram"}  # (16-bit near-ties of
    # random weights may part a speculating engine from plain decoding: reported, not asserted)
    assert results["05"]["reload_same"] and results["05"]["kv_formats"] == ["auto", "int8", "fp8"]
