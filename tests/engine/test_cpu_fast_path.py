"""The CPU fast path of issue 28, each switch against the eager engine a learner reads: greedy float32 tokens
must be identical (speed is measured by ``python -m minifer.bench cpu_peer``, never here)."""

from __future__ import annotations

import pytest
import torch

import minifer
from minifer import SamplingParams
from minifer.eval import heldout_prompts
from minifer.features.packed_linear import PackedLinear, pack_linears


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
    with pytest.raises(ValueError, match="must match"):
        minifer.LLM("tinystories-target", dtype="float32", device="cpu", share_weights_with=target_llm,
                    compilation_config={"pack_weights": True})


def test_two_replicas_give_the_eager_tokens_in_prompt_order(prompts, eager_tokens):
    from minifer.features.data_parallel import balance

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


def test_step_gather_attention_gives_the_eager_tokens(prompts, eager_tokens):
    from minifer.bench.cpu_attention import StepGatherKVCache

    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", attention_backend=StepGatherKVCache,
                      max_num_seqs=5)  # fewer slots than prompts: decode steps and mixed prefill steps alternate
    assert greedy(llm, prompts) == eager_tokens
    assert isinstance(llm.engine.kv_cache, StepGatherKVCache) and llm.engine.kv_cache._step is not None


def test_bucketed_decode_attention_gives_the_eager_tokens(target_llm):
    from minifer.bench.bucketed_attention import BucketedKVCache, bucketed_metadata

    # one long prompt beside short ones: decode steps whose contexts differ by hundreds of tokens split in buckets
    prompts = [{"prompt_token_ids": [(7 * i + j) % 2000 + 1 for j in range(n)]} for i, n in
               enumerate([300, 12, 20, 9, 40, 15, 150, 11])]
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", attention_backend=BucketedKVCache,
                      max_num_seqs=8)
    seen = []
    real = bucketed_metadata

    def spy(meta, block_size):
        out = real(meta, block_size)
        seen.append(len(out.groups))
        return out

    import minifer.bench.bucketed_attention as mod
    mod.bucketed_metadata, saved = spy, mod.bucketed_metadata
    try:
        assert greedy(llm, prompts, n=24) == greedy(target_llm, prompts, n=24)
    finally:
        mod.bucketed_metadata = saved
    assert max(seen) >= 2  # the lever did split the decode steps: the identity above is not the reference's alone


def test_decode_buckets_pad_each_group_to_its_own_longest():
    from minifer.bench.bucketed_attention import decode_buckets

    assert decode_buckets([300, 12, 20, 9, 40]) == [[0, 4, 2, 1, 3]]  # one group pads 1,100 keys: cheaper than two
    assert decode_buckets([300, 40] + [12] * 8) == [[0, 1], list(range(2, 10))]  # 8 x 288 padded keys: two groups
    assert decode_buckets([300, 12, 20, 9, 40], group_cost=10) == [[0], [4], [2], [1, 3]]
    assert decode_buckets([5, 5, 5]) == [[0, 1, 2]]
    assert sorted(sum(decode_buckets([3, 900, 64, 65, 7, 1]), [])) == list(range(6))  # every row, once


def test_fast_options_merge_compilation_config_across_levers(monkeypatch):
    from minifer.bench import cpu_peer

    levers = {"a": ({"compilation_config": {"pack_weights": True}}, dict),
              "b": ({"compilation_config": {"level": 3}, "max_num_seqs": 8}, dict),
              "c": ({"compilation_config": {"level": 0}}, dict)}
    monkeypatch.setattr(cpu_peer, "LEVERS", levers)
    monkeypatch.setattr(cpu_peer, "REJECTED", {"c"})
    assert cpu_peer.fast_options() == ({"compilation_config": {"pack_weights": True, "level": 3}, "max_num_seqs": 8},
                                       {})
