"""OpenAI's presence and frequency penalties and vLLM's ``min_tokens``, against oracles: the formula on
transformers' logits for the penalties (token by token, greedy), transformers' own ``min_new_tokens`` for
``min_tokens``; the same tokens in continuous and static batching, with speculation (such requests decode without
it), and over the HTTP server; a chi-square check that sampling draws from the penalised distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import minifer
from minifer import SamplingParams
from minifer.sample.sampler import apply_frequency_presence, history_tensors, process_logits, sample


def test_formula_on_output_counts():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    counts = torch.zeros(3, 10)
    counts[0, 2], counts[0, 5], counts[1, 5] = 3, 1, 2
    out = apply_frequency_presence(logits, counts, torch.tensor([0.5, -1.0, 0.0]), torch.tensor([0.25, 0.0, 2.0]))
    want = logits.clone()
    want[0, 2] -= 0.5 * 3 + 0.25
    want[0, 5] -= 0.5 * 1 + 0.25
    want[1, 5] -= -1.0 * 2
    torch.testing.assert_close(out, want)


def test_history_counts_output_only_and_bans_stop_tokens_before_min_tokens():
    from minifer.request import Request

    params = [SamplingParams(frequency_penalty=1.0), SamplingParams(min_tokens=2, stop_token_ids=[8]),
              SamplingParams(min_tokens=1)]
    seqs = [Request(str(i), None, prompt, p, 16, frozenset({9})) for i, (prompt, p) in
            enumerate(zip([[1, 2], [4, 5], [6]], params))]
    seqs[0].output_token_ids, seqs[2].output_token_ids = [3, 3], [7]
    seen, counts, banned = history_tensors(seqs, 10, torch.device("cpu"))
    assert seen is None  # no repetition penalty: not built
    assert counts[0].tolist() == [0, 0, 0, 2, 0, 0, 0, 0, 0, 0] and not counts[1].any()  # prompt tokens don't count
    assert banned[1].nonzero().flatten().tolist() == [8, 9] and not banned[0].any()
    assert not banned[2].any()  # one output already: min_tokens=1 is met
    logits = torch.zeros(3, 10)
    assert process_logits(logits, params, seen, counts, banned)[1, 8] == float("-inf")
    plain = [Request("p", None, [1], SamplingParams(), 16, frozenset({9}))]
    assert history_tensors(plain, 10, torch.device("cpu")) == (None, None, None)  # nothing built for plain rows


def test_sampling_draws_from_the_penalised_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, frequency_penalty=0.4, presence_penalty=0.3)
    n = 6000
    gen = torch.Generator().manual_seed(7)
    tokens = sample(logits.expand(n, -1), [params] * n, [gen] * n, None, counts.expand(n, -1)).token_ids
    observed = torch.bincount(torch.tensor(tokens), minlength=5).tolist()
    want = (logits[0] - 0.4 * counts[0] - 0.3 * (counts[0] > 0)).double().softmax(-1)
    assert chisquare(observed, (want * n).tolist()).pvalue > 0.01
    plain = logits[0].double().softmax(-1)  # the test has power: the unpenalised distribution is rejected
    assert chisquare(observed, (plain * n).tolist()).pvalue < 1e-3


def penalised_greedy_oracle(hf, prompt: list[int], n: int, frequency: float, presence: float) -> list[int]:
    """Greedy decoding by hand: transformers' logits for the whole sequence, the formula, argmax."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
        token = int((logits - frequency * counts - presence * (counts > 0).float()).argmax())
        ids.append(token)
        out.append(token)
    return out


@pytest.fixture(scope="module")
def prompts(heldout_stories):
    tok = minifer.LLM("tinystories-draft").get_tokenizer()
    return [tok(s)["input_ids"][:n] for s, n in zip(heldout_stories, (3, 9, 17))]


@pytest.mark.parametrize("frequency,presence", [(0.8, 0.0), (0.0, 1.5), (0.5, 0.5), (-0.5, 0.0)])
def test_greedy_with_penalties_matches_the_oracle(target_llm, hf_target, prompts, frequency, presence):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=frequency,
                            presence_penalty=presence)
    outs = target_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    plain = target_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == penalised_greedy_oracle(hf_target, p, 24, frequency, presence)
    assert any(o.outputs[0].token_ids != q.outputs[0].token_ids for o, q in zip(outs, plain)), \
        "the penalty changed nothing: the case tests nothing"


def test_static_batching_and_speculation_give_the_same_tokens(target_llm, prompts):
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.7),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=24, min_tokens=20)]
    batch = [{"prompt_token_ids": p} for p in prompts]
    want = [o.outputs[0].token_ids for o in target_llm.generate(batch, params, use_tqdm=False)]
    static = minifer.LLM("tinystories-target", dtype="float32", device="cpu", batching="static",
                         share_weights_with=target_llm)
    assert [o.outputs[0].token_ids for o in static.generate(batch, params, use_tqdm=False)] == want
    spec = minifer.LLM("tinystories-target", dtype="float32", device="cpu", share_weights_with=target_llm,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    assert [o.outputs[0].token_ids for o in spec.generate(batch, params, use_tqdm=False)] == want


def test_penalised_rows_beside_speculating_ones_decode_as_plain(target_llm):
    """In a batch where plain requests speculate, the penalised and min_tokens ones (never drafted) must still get
    their own processed distribution: greedy and seeded sampled rows equal the non-speculative engine's."""
    loop = "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat. The cat"
    prompts = [loop, loop, "Once upon a time", "Lily and Tom played all day. They were very happy. The end.",
               "Tom had a red ball"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, frequency_penalty=1.5),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, presence_penalty=2.0),
              SamplingParams(temperature=0, max_tokens=60, min_tokens=40),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True, presence_penalty=1.0)]
    want = [o.outputs[0].token_ids for o in target_llm.generate(prompts, params, use_tqdm=False)]
    for adaptive in (False, True):
        spec = minifer.LLM("tinystories-target", dtype="float32", device="cpu", share_weights_with=target_llm,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": adaptive,
                                               "prompt_lookup_min": 2})
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        assert got == want, f"adaptive={adaptive}"
        if not adaptive:
            assert spec.stats()["spec_num_proposed"] > 0, "nothing speculated: the case tests nothing"


def test_min_tokens_beyond_the_context_stops_at_the_context():
    for batching in ("continuous", "static"):
        llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", max_model_len=32, batching=batching)
        out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=None, min_tokens=100),
                           use_tqdm=False)[0]
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 32, batching
        assert out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="prompt 0: stop_token_ids has 50000, out of the vocabulary"):
        llm.generate(["x"], SamplingParams(stop_token_ids=[50000], min_tokens=2), use_tqdm=False)


def test_min_tokens_matches_hf_min_new_tokens(target_llm, hf_target):
    """The bundled stories end with EOS; min_tokens pushes it past what greedy would do, as HF's min_new_tokens."""
    tok = target_llm.get_tokenizer()
    eos = tok.eos_token_id
    prompt = tok("Lily and Tom played all day. They were very happy. The end.")["input_ids"]
    free = target_llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=80),
                               use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and len(free.token_ids) < 30, "greedy should end early here"
    floor = len(free.token_ids) + 10
    out = target_llm.generate([{"prompt_token_ids": prompt}],
                              SamplingParams(temperature=0, max_tokens=80, min_tokens=floor), use_tqdm=False)[0]
    x = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf_target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=80,
                                 min_new_tokens=floor, eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
    if eos in ref:
        ref = ref[: ref.index(eos) + 1]
    assert out.outputs[0].token_ids == ref and len(ref) >= floor
    assert eos not in out.outputs[0].token_ids[:floor]


def test_stop_strings_and_tokens_wait_for_min_tokens(target_llm):
    free = target_llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    first = free.token_ids[2]
    stopped = target_llm.generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[first]), use_tqdm=False)[0].outputs[0]
    assert len(stopped.token_ids) <= 3 and stopped.finish_reason == "stop"
    late = target_llm.generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[first], min_tokens=12), use_tqdm=False)[0]
    assert len(late.outputs[0].token_ids) >= 12 and first not in late.outputs[0].token_ids[:12]
    word = free.text.split()[1]
    text = target_llm.generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=[word], min_tokens=30), use_tqdm=False)[0].outputs[0]
    assert text.finish_reason == "length" and len(text.token_ids) == 30
    # a stop string that comes again after min_tokens still stops the request there, and is cut from the text
    first = free.text.index(" a ")
    second = free.text.index(" a ", first + 1)
    assert len(tokenizer_text(target_llm, free.token_ids[:8])) > first + 3  # the first " a " is before 8 tokens
    stop = target_llm.generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=[" a "], min_tokens=8), use_tqdm=False)[0].outputs[0]
    assert stop.finish_reason == "stop" and stop.stop_reason == " a " and stop.text == free.text[:second]


def tokenizer_text(llm, ids):
    return llm.get_tokenizer().decode(ids, skip_special_tokens=True)


def test_bad_values_are_refused():
    for kw, words in (({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
                      ({"frequency_penalty": "high"}, "frequency_penalty must be a number"),
                      ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
                      ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be at most max_tokens=10")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            SamplingParams(**kw)


def test_logit_bias_matches_the_oracle_with_and_without_speculation(target_llm, hf_target, prompts):
    """A bias of -100 bans a token, +5 promotes one: greedy tokens equal argmax(transformers' logits + bias) token
    by token, and greedy speculation (whose verification takes the target's argmax) applies the bias too."""
    plain = target_llm.generate([{"prompt_token_ids": prompts[1]}],
                                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    first = plain[0].outputs[0].token_ids[0]
    bias = {first: -100.0, 42: 5.0}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias=bias)
    batch = [{"prompt_token_ids": p} for p in prompts]
    want = []
    for p in prompts:
        ids, out = list(p), []
        for _ in range(16):
            with torch.no_grad():
                logits = hf_target(torch.tensor([ids])).logits[0, -1].float()
            logits[first] -= 100
            logits[42] += 5
            out.append(int(logits.argmax()))
            ids.append(out[-1])
        want.append(out)
    got = [o.outputs[0].token_ids for o in target_llm.generate(batch, params, use_tqdm=False)]
    assert got == want and first not in got[1]
    spec = minifer.LLM("tinystories-target", dtype="float32", device="cpu", share_weights_with=target_llm,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False,
                                           "prompt_lookup_min": 1})
    assert [o.outputs[0].token_ids for o in spec.generate(batch, params, use_tqdm=False)] == want
    static = minifer.LLM("tinystories-target", dtype="float32", device="cpu", batching="static",
                         share_weights_with=target_llm)
    assert [o.outputs[0].token_ids for o in static.generate(batch, params, use_tqdm=False)] == want
    with pytest.raises(ValueError, match="logit_bias names token id 99999"):
        target_llm.generate(["x"], SamplingParams(logit_bias={99999: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams.logit_bias must map token ids"):
        SamplingParams(logit_bias={1: 101})
