"""Column-major linear weights (``compilation_config={"column_major_weights": True}``, ``features.weight_layout``), the
batch-1 layout of issue 28, against the eager model a learner reads: the same values, the same greedy float32 tokens
alone and combined with the other CPU switches (speed is measured by ``python -m minifer.bench cpu_peer``, never
here); and the two bounds ``minifer_course.experiments.cpu_bounds`` adds to that benchmark, on a few requests."""

from __future__ import annotations

import pytest
import torch

import minifer
from minifer import SamplingParams
from minifer.compilation.weight_layout import column_major_linears, is_column_major


def _greedy(llm, prompts, n=24):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _prompts(k=6):
    return [{"prompt_token_ids": [(11 * i + 5 * j) % 90 + 1 for j in range(4 + 5 * i)]} for i in range(k)]


def test_column_major_keeps_values_shapes_and_ties():
    torch.manual_seed(0)
    emb, head, body = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False), torch.nn.Linear(16, 24)
    head.weight = emb.weight  # tied, as a model with tie_word_embeddings
    model = torch.nn.ModuleDict({"emb": emb, "head": head, "body": body})
    x = torch.randn(3, 16)
    before = (head(x), body(x), emb.weight.detach().clone())
    assert column_major_linears(model) == 2  # the tied matrix once
    assert is_column_major(head.weight) and is_column_major(body.weight) and not body.weight.is_contiguous()
    assert head.weight is emb.weight and head.weight.shape == (50, 16)
    assert torch.equal(emb.weight, before[2])
    assert torch.allclose(head(x), before[0], atol=1e-6) and torch.allclose(body(x), before[1], atol=1e-6)
    assert column_major_linears(model) == 2 and is_column_major(body.weight)  # idempotent


def test_column_major_weights_give_the_eager_tokens(target_llm):
    prompts = _prompts()
    ref = _greedy(target_llm, prompts)
    for config in ({"column_major_weights": True}, {"column_major_weights": True, "pack_weights": True}):
        llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", compilation_config=config)
        assert is_column_major(llm.model.lm_head.weight) and is_column_major(llm.model.model.layers[0].mlp.down_proj.weight)
        assert llm.compilation_config == config
        assert _greedy(llm, prompts) == ref
        assert _greedy(llm, prompts[:1]) == ref[:1]  # batch 1: the single-row products the layout is for


def test_compiled_decoder_over_column_major_weights_gives_the_eager_tokens(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3")[1]
    eager = minifer.LLM(folder, dtype="float32", device="cpu", max_num_seqs=4)
    fused = minifer.LLM(folder, dtype="float32", device="cpu", max_num_seqs=4,
                        compilation_config={"level": 3, "column_major_weights": True})
    prompts = _prompts()
    assert _greedy(fused, prompts) == _greedy(eager, prompts)
    assert _greedy(fused, prompts[:1]) == _greedy(eager, prompts[:1])


def test_small_model_step_overhead_is_reported_from_both_engines():
    from minifer_course.experiments.cpu_bounds import SMALL_QWEN3, step_overhead

    r = step_overhead(num_requests=12, slots=4, repeats=1, log=lambda _: None)
    assert r["model"]["hidden_size"] == SMALL_QWEN3["hidden_size"] == 128 and r["model"]["num_hidden_layers"] == 2
    assert r["static_ms_per_step"] > 0 and r["step_bound"] >= 1
    for name in ("continuous", "continuous-without-fast_greedy"):
        c = r[name]
        assert c["overhead_ms"] == pytest.approx(c["ms_per_step"] - r["static_ms_per_step"])
        assert c["fraction_of_bound"] == pytest.approx(c["over_static"] / r["step_bound"])
    assert set(r["levers_ms_saved"]) == {"fast_greedy"}


def test_decode_bytes_count_each_weight_once_and_the_context(tmp_path):
    from minifer_course.experiments.cpu_bounds import _decode_bytes, small_model_dir

    llm = minifer.LLM(str(small_model_dir(tmp_path)), load_format="dummy", dtype="float32", device="cpu")
    cfg = llm.model_config
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i
    weights = 4 * (layers * per_layer + cfg.vocab_size * h)  # float32; the tied lm_head/embedding once
    kv_per_token = 4 * 2 * layers * cfg.num_key_value_heads * cfg.head_dim
    assert _decode_bytes(llm.model, 10) == weights + 11 * kv_per_token
