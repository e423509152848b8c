"""The roofline chapter's counting functions on configs whose numbers can be checked by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from minifer import ModelConfig
from minifer_course import roofline as rl
from minifer.model_loader import BUNDLED_MODELS, load_config

# A toy Llama: every number below can be recomputed on paper.
TOY = ModelConfig.from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 8, "intermediate_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
    "tie_word_embeddings": False})


def test_layer_matmul_params_by_hand() -> None:
    # q 8x8, k 8x4, v 8x4, o 8x8, gate/up/down 3 x 8x16
    assert rl.layer_matmul_params(TOY) == 64 + 32 + 32 + 64 + 3 * 128


def test_weight_and_kv_bytes() -> None:
    params = TOY.num_parameters()
    assert params == 2 * (576 + 16) + 2 * 800 + 8  # layers (+2 norms each), embedding + lm_head, final norm
    # The untied embedding table is not read whole by a step: only the rows of its tokens.
    assert rl.weight_bytes(TOY, 2) == (params - 800) * 2
    assert rl.kv_bytes_per_token(TOY, 2) == 2 * 2 * 4 * 2  # k and v, 2 layers, 1 kv head x 4, bf16


def test_decode_cost_by_hand() -> None:
    c = rl.decode_cost(TOY, batch=1, context=3, dtype_bytes=2)
    assert c.tokens == 1
    assert c.flops_matmul == 2 * 2 * 576 + 2 * 100 * 8  # 2 layers, then one lm_head row
    # 4 causal (query, key) pairs: the new token sees 3 cached keys and itself; QK and PV over 2 heads x 4
    assert c.flops_attention == 4 * 2 * 2 * 4 * 4
    assert c.weight_bytes == (TOY.num_parameters() - 800) * 2 + 8 * 2
    assert c.kv_read_bytes == 4 * 32
    assert c.kv_write_bytes == 32
    assert c.bytes == c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes + c.activation_bytes
    assert c.intensity == pytest.approx(c.flops / c.bytes)
    assert c.intensity < c.intensity_weights_kv


def test_prefill_counts_causal_pairs_and_one_logit_row_per_sequence() -> None:
    c = rl.prefill_cost(TOY, batch=3, prompt_len=5, dtype_bytes=4)
    assert c.tokens == 15
    assert c.flops_matmul == 2 * 15 * 2 * 576 + 2 * 3 * 100 * 8
    assert c.flops_attention == 3 * 4 * 2 * 2 * 4 * (5 * 6 / 2)
    assert c.kv_write_bytes == c.kv_read_bytes == 15 * rl.kv_bytes_per_token(TOY, 4)


def test_step_cost_validates() -> None:
    with pytest.raises(ValueError):
        rl.step_cost(TOY, batch=0, new_tokens=1, context=0)


@pytest.fixture(scope="module")
def target_cfg() -> ModelConfig:
    return load_config(BUNDLED_MODELS["tinystories-target"])


def test_bundled_target_decode_is_memory_bound_and_batching_helps(target_cfg: ModelConfig) -> None:
    d1 = rl.decode_cost(target_cfg, 1, 128, 4)
    assert d1.intensity < 1  # float32: one multiply-add (2 FLOPs) per 4-byte weight read
    assert d1.weight_bytes / d1.bytes > 0.9
    assert d1.flops == pytest.approx(2 * target_cfg.num_parameters(), rel=0.1)
    by_batch = [rl.decode_cost(target_cfg, b, 128, 4).intensity for b in (1, 2, 4, 8, 16, 32, 64)]
    assert by_batch == sorted(by_batch)
    assert rl.prefill_cost(target_cfg, 1, 512, 4).intensity > 20 * d1.intensity


def test_bf16_decode_intensity_is_about_the_batch() -> None:
    cfg = rl.reference_configs()["meta-llama/Llama-3.1-8B"]
    for b in (1, 8, 64):
        assert rl.decode_cost(cfg, b, 0, 2).intensity_weights_kv == pytest.approx(b, rel=0.05)


def test_reference_configs_match_published_sizes() -> None:
    cfgs = rl.reference_configs()
    sizes = {name: cfg.num_parameters() / 1e9 for name, cfg in cfgs.items()}
    assert sizes["Qwen/Qwen3-0.6B"] == pytest.approx(0.596, abs=0.001)
    assert sizes["Qwen/Qwen3-1.7B"] == pytest.approx(1.72, abs=0.01)
    assert sizes["meta-llama/Llama-3.2-1B"] == pytest.approx(1.24, abs=0.01)
    assert sizes["meta-llama/Llama-3.1-8B"] == pytest.approx(8.03, abs=0.01)
    assert sizes["meta-llama/Llama-2-7b-hf"] == pytest.approx(6.74, abs=0.01)


def test_h200_bound_reproduces_the_literature() -> None:
    # literature.md: Llama-2-7B in bf16 (13.2 GB) is bounded near 326 tok/s on an H200 at 4.3 TB/s.
    cfg = rl.reference_configs()["meta-llama/Llama-2-7b-hf"]
    bound = rl.decode_tokens_per_second_bound(cfg, rl.H200_MEASURED)
    assert 300 < bound < 335
    assert rl.H200_MEASURED.ridge == pytest.approx(184, abs=1)  # "about 200 FLOP per byte"


def test_long_context_caps_decode_intensity_below_the_ridge() -> None:
    cfg = rl.reference_configs()["meta-llama/Llama-3.1-8B"]
    assert 180 <= rl.ridge_batch(cfg, rl.H200_MEASURED, context=0) <= 190  # intensity ~ batch in bf16
    assert rl.ridge_batch(cfg, rl.H200_MEASURED, context=32768, max_batch=512) is None


def test_roofline_helpers() -> None:
    assert rl.ridge_point(100.0, 10.0) == 10.0
    assert rl.attainable_flops(1.0, 100.0, 10.0) == 10.0
    assert rl.attainable_flops(50.0, 100.0, 10.0) == 100.0
    c = rl.decode_cost(TOY, 1, 0, 2)
    assert rl.step_time_bound(c, 1e12, 1e9) == pytest.approx(c.bytes / 1e9)


def test_bound_table_rows() -> None:
    rows = rl.bound_table()
    assert [r["params"] for r in rows] == sorted(r["params"] for r in rows)
    assert all(math.isfinite(r["batch1_tokens_per_s"]) for r in rows)


def test_timing_a_tiny_model_and_json(tmp_path) -> None:
    """The measuring functions run end to end on a dummy 1-layer model in well under a second."""
    from minifer.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(TOY, max_positions=64).eval()
    p = rl.time_prefill(model, batch=2, prompt_len=8, repeats=1, warmup=0)
    d = rl.time_decode(model, batch=2, context=8, steps=2, repeats=1, warmup=0)
    assert p.phase == "prefill" and p.tokens == 16 and p.seconds > 0
    assert d.phase == "decode" and d.tokens == 2 and d.cost.context == 9
    json.dumps([p.to_dict(), d.to_dict()])  # plain numbers only
