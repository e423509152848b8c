"""The CPU fast path of issue 28, each switch against the eager engine a learner reads: greedy float32 tokens
must be identical (speed is measured by ``python -m minifer.bench cpu_peer``, never here)."""

from __future__ import annotations

import pytest
import torch

import minifer
from minifer import SamplingParams
from minifer.eval import heldout_prompts
from minifer.compilation.packed_linear import PackedLinear, pack_linears


def greedy(llm, prompts, n=48, **kw):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts(target_llm):
    return [{"prompt_token_ids": p.tolist()} for p in heldout_prompts(target_llm.tokenizer, n=12, length=12)]


@pytest.fixture(scope="module")
def eager_tokens(target_llm, prompts):
    return greedy(target_llm, prompts)


def test_packed_weights_give_the_eager_tokens(prompts, eager_tokens):
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", compilation_config={"pack_weights": True})
    packed = [m for m in llm.model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * llm.model_config.num_hidden_layers + 1  # the decoder's projections and lm_head
    assert greedy(llm, prompts) == eager_tokens
    assert llm.compilation_config == {"pack_weights": True}


def test_packed_linear_matches_linear_at_every_row_count():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    model = torch.nn.Sequential(lin)
    assert pack_linears(model) == 1 and isinstance(model[0], PackedLinear)
    for rows in (0, 1, 2, 7, 33):
        x = torch.randn(rows, 64)
        assert torch.allclose(model(x), lin(x), atol=1e-5)
    assert model(torch.randn(2, 3, 64)).shape == (2, 3, 48)


def test_compilation_config_is_checked(target_llm):
    with pytest.raises(ValueError, match="unknown key"):
        minifer.LLM("tinystories-draft", device="cpu", compilation_config={"backend": "inductor"})
    # the bucketed decode attention measured no gain and left the package: asking for it names the keys there are
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['decode_attention'\]; minifer reads \['pack_weights'"):
        minifer.LLM("tinystories-draft", device="cpu", compilation_config={"decode_attention": "bucketed"})
    with pytest.raises(ValueError, match="must match"):
        minifer.LLM("tinystories-target", dtype="float32", device="cpu", share_weights_with=target_llm,
                    compilation_config={"pack_weights": True})


def test_two_replicas_give_the_eager_tokens_in_prompt_order(prompts, eager_tokens):
    from minifer.engine.data_parallel import balance

    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", data_parallel_size=2)
    try:
        assert greedy(llm, prompts) == eager_tokens
        assert greedy(llm, prompts[:1]) == eager_tokens[:1]  # one replica idle
    finally:
        llm.replicas.close()
    assert balance([5, 1, 4, 2, 3], 2) == [[0, 3, 1], [2, 4]]  # loads 8 and 7


def test_data_parallel_size_is_checked(target_llm):
    with pytest.raises(ValueError, match="positive integer"):
        minifer.LLM("tinystories-draft", device="cpu", data_parallel_size=0)
    with pytest.raises(ValueError, match="batching='continuous'"):
        minifer.LLM("tinystories-draft", device="cpu", batching="static", data_parallel_size=2)


def test_fast_options_merge_compilation_config_across_levers(monkeypatch):
    from minifer.bench import cpu_peer

    levers = {"a": ({"compilation_config": {"pack_weights": True}}, dict),
              "b": ({"compilation_config": {"level": 3}, "max_num_seqs": 8}, dict),
              "c": ({"compilation_config": {"level": 0}}, dict)}
    monkeypatch.setattr(cpu_peer, "LEVERS", levers)
    monkeypatch.setattr(cpu_peer, "REJECTED", {"c"})
    assert cpu_peer.fast_options() == ({"compilation_config": {"pack_weights": True, "level": 3}, "max_num_seqs": 8},
                                       {})
