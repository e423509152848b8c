"""vLLM's ``SamplingParams(prompt_logprobs=k)``: each prompt token's log-probability given the tokens before it,
with its rank and the top k candidates, against transformers' log-softmax over the same prompt. Prompts with it
take no prefix-cache hits (a cached token's logits are never computed) but still publish their blocks; the
entries survive chunked prefill, preemption, parallel sampling and speculation without gaps or repeats."""

from __future__ import annotations

import pytest
import torch

import minifer
from minifer import SamplingParams
from minifer.sample.sampler import sample

STORIES = ["Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.",
           "Tom had a red ball and a blue car. He liked to play with them every day after school.",
           "The cat sat on the mat."]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_matches_hf(output, hf, k: int) -> None:
    ids, entries = output.prompt_token_ids, output.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) and entries[0] is None
    ref = hf_logprobs(hf, ids)
    for i in range(1, len(ids)):
        row, entry = ref[i - 1], entries[i]
        assert entry[ids[i]].logprob == pytest.approx(float(row[ids[i]]), abs=1e-4), f"position {i}"
        assert entry[ids[i]].rank == int((row > row[ids[i]]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= k + 1
        assert all(entry[t].decoded_token is not None for t in entry)


@pytest.mark.parametrize("budget,block_size", [(2048, 16), (16, 4), (7, 3)])  # whole, and chunked prefills
def test_prompt_logprobs_match_hf(hf_target, budget, block_size):
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=block_size,
                      max_num_batched_tokens=budget)
    outs = llm.generate(STORIES, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3), use_tqdm=False)
    for o in outs:
        assert_matches_hf(o, hf_target, 3)
    plain = llm.generate(STORIES[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_prefix_cache_is_bypassed_but_still_filled(hf_target):
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(STORIES[:1], greedy, use_tqdm=False)  # caches the story's blocks
    hits = llm.engine.kv_cache_manager.prefix_cache_stats.hits
    out = llm.generate(STORIES[:1], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    assert llm.engine.kv_cache_manager.prefix_cache_stats.hits == hits  # computed every position, no hit
    assert_matches_hf(out, hf_target, 0)
    llm.generate(STORIES[:1], greedy, use_tqdm=False)
    assert llm.engine.kv_cache_manager.prefix_cache_stats.hits > hits  # and a plain request still hits the cache


def test_preemption_parallel_sampling_and_speculation(hf_target):
    # a cache of 12 blocks of 4 for 3 requests of ~25 tokens: preemptions, with recomputed prompts
    tight = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4, num_kv_blocks=12,
                        max_num_batched_tokens=8)
    outs = tight.generate(STORIES, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1),
                          use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0, "nothing was preempted: the case tests nothing"
    for o in outs:
        assert_matches_hf(o, hf_target, 1)
    group = tight.generate(STORIES[2:], SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=4, prompt_logprobs=2),
                           use_tqdm=False)[0]
    assert len(group.outputs) == 3
    assert_matches_hf(group, hf_target, 2)
    prompt = [{"prompt_token_ids": list(range(40, 73))}]  # 33 tokens in chunks of 16: the last chunk is one token
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    spec = minifer.LLM("tinystories-target", dtype="float32", device="cpu", max_num_batched_tokens=16,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
                                           "prompt_lookup_min": 1})
    plain = minifer.LLM("tinystories-target", dtype="float32", device="cpu", max_num_batched_tokens=16,
                        share_weights_with=spec)
    got, want = spec.generate(prompt, params, use_tqdm=False)[0], plain.generate(prompt, params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert_matches_hf(got, hf_target, 2)


def test_refused_where_it_cannot_work():
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs must be None or an integer >= 0"):
        SamplingParams(prompt_logprobs=-1)
    static = minifer.LLM("tinystories-target", dtype="float32", device="cpu", batching="static")
    with pytest.raises(ValueError, match="prompt_logprobs needs batching='continuous'"):
        static.generate(["x"], SamplingParams(prompt_logprobs=1), use_tqdm=False)


def test_engine_perplexity_equals_the_harness():
    """minifer.eval's perplexity, through the serving engine's prompt_logprobs (as harnesses score a served model),
    in chunked prefills and with int8 weights, equals the harness's own forward over the same windows."""
    import minifer.eval as ev

    # int8 is weight-only (not "w8a8", whose rounding of the activations would turn the float rounding differences
    # of chunked vs whole prefills into code flips; tests/quant/test_int8_cpu.py bounds that kernel on its own)
    for kw in ({}, {"quantization": "int8", "max_num_batched_tokens": 100}):
        llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", **kw)
        windows = ev.heldout_windows(llm.get_tokenizer(), max_len=128, max_tokens=1024)
        assert ev.engine_perplexity(llm, windows) == pytest.approx(ev.perplexity(llm, windows), rel=1e-5)


def test_served_perplexity_over_http_equals_the_harness():
    """The same windows scored over the OpenAI API (echo, max_tokens=0, as a harness reaching a server does),
    against minifer's own server with int8 weights and chunked prefills."""
    import minifer.eval as ev
    from minifer.entrypoints.openai.serve import start_server

    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", quantization="int8",
                      max_num_batched_tokens=100)  # weight-only, as above
    windows = ev.heldout_windows(llm.get_tokenizer(), max_len=128, max_tokens=512)
    want = ev.perplexity(llm, windows)
    with start_server(llm, port=0, model_name="q") as srv:
        assert ev.served_perplexity(srv.url, "q", windows) == pytest.approx(want, rel=1e-5)


def test_limits_and_cache_statistics():
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", block_size=4)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"prompt 0: {name}=21 is more than max_logprobs=20"):
            llm.generate(["x"], SamplingParams(**{name: 21}), use_tqdm=False)
    wide = minifer.LLM("tinystories-target", dtype="float32", device="cpu", max_logprobs=50, share_weights_with=llm)
    assert len(wide.generate(["Once upon"], SamplingParams(max_tokens=1, prompt_logprobs=30),
                             use_tqdm=False)[0].prompt_logprobs[2]) >= 30
    bm = llm.engine.kv_cache_manager
    llm.generate(STORIES[:1], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert bm.prefix_cache_stats.queries == 0  # it bypassed the cache: no lookup was made, none is counted


def test_greedy_speculation_takes_the_biased_argmax_in_float32():
    """In bf16, adding a bias and rounding back can tie two tokens that float32 tells apart; the argmax that
    speculative drafts and verification take must be what plain sampling (float32) picks."""
    from minifer.sample.sampler import greedy_argmax

    logits = torch.tensor([[10.0, 9.9375] + [0.0] * 8], dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, logit_bias={1: 0.07})
    rounded = (logits.float() + torch.tensor([0, 0.07] + [0.0] * 8)).to(torch.bfloat16)
    assert int(rounded.argmax()) == 0  # the trap: rounded back to bf16, the bias ties and the lower id wins
    assert sample(logits, [params], [None]).token_ids == [1]
    assert greedy_argmax(logits, params).tolist() == [1]
    assert greedy_argmax(logits, SamplingParams(temperature=0)).tolist() == [0]


def test_engine_perplexity_names_a_window_too_long_for_the_context():
    import minifer.eval as ev

    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", max_model_len=128)
    windows = ev.heldout_windows(llm.get_tokenizer(), max_len=127, max_tokens=254)
    with pytest.raises(ValueError, match="needs max_len \\+ 2 <= max_model_len=128"):
        ev.engine_perplexity(llm, windows)
