"""Sampling: the logits processors against plain per-row loops, seeded reproducibility, the distribution
that ``sample`` draws from (chi-squared), stop conditions and logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from minifer import SamplingParams
from minifer.sample.sampler import apply_min_p, apply_repetition_penalty, apply_top_k, apply_top_p, sample

pytestmark = pytest.mark.core  # the fast tier (tests/README.md)

NEG_INF = float("-inf")
BORDER = 1e-5  # float32 cumulative sums may land on either side of a threshold this close


# --- per-row reference implementations (float64 Python loops) ---------------------------------------


def softmax64(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(x - m) if x != NEG_INF else 0.0 for x in row]
    s = sum(e)
    return [x / s for x in e]


def ref_top_k(row: list[float], k: int) -> list[bool]:
    """Keep token i iff fewer than k tokens are strictly larger (ties with the k-th are kept)."""
    if k <= 0:
        return [True] * len(row)
    return [sum(1 for y in row if y > x) < k for x in row]


def ref_top_p(row: list[float], p: float) -> tuple[list[bool], bool]:
    """Walk tokens from most to least likely, keeping each while the mass already kept is below p.

    Returns the kept mask and whether the cut is within BORDER of p (then float32 may differ)."""
    probs = softmax64(row)
    order = sorted(range(len(row)), key=lambda i: -row[i])
    keep, mass, borderline = [False] * len(row), 0.0, False
    for i in order:
        if abs(mass - p) < BORDER and mass > 0:
            borderline = True
        if mass < p or i == order[0]:
            keep[i] = True
        mass += probs[i]
    return keep, borderline


def ref_min_p(row: list[float], m: float) -> tuple[list[bool], bool]:
    probs = softmax64(row)
    thr = m * max(probs)
    return [q >= thr for q in probs], any(abs(q - thr) < BORDER * max(probs) for q in probs) and 0 < m < 1


def ref_repetition_penalty(row: list[float], seen: list[bool], pen: float) -> list[float]:
    out = []
    for x, s in zip(row, seen):
        if s:
            x = x / pen if x > 0 else x * pen
        out.append(x)
    return out


def kept(out: torch.Tensor) -> list[list[bool]]:
    return (out != NEG_INF).tolist()


def check_unchanged_where_kept(out: torch.Tensor, logits: torch.Tensor) -> None:
    mask = out != NEG_INF
    assert torch.equal(out[mask], logits[mask]), "kept logits must be unchanged"


def random_logits(seed: int, rows: int, vocab: int, scale: float) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


logit_cases = st.tuples(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(2, 64),
                        st.sampled_from([0.1, 1.0, 3.0, 10.0]))
FAST = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# --- (a) processors ---------------------------------------------------------------------------------


@FAST
@given(case=logit_cases, data=st.data())
def test_top_k_matches_reference(case, data):
    seed, rows, vocab, scale = case
    logits = random_logits(seed, rows, vocab, scale)
    ks = data.draw(st.lists(st.integers(-1, vocab + 3), min_size=rows, max_size=rows))
    out = apply_top_k(logits, torch.tensor(ks))
    check_unchanged_where_kept(out, logits)
    for r in range(rows):
        assert kept(out)[r] == ref_top_k(logits[r].tolist(), ks[r]), (r, ks[r])


def test_top_k_keeps_ties_and_edge_values():
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 2.0, 0.0]] * 6)
    ks = torch.tensor([1, 2, 3, 6, 100, 0])
    out = apply_top_k(logits, ks)
    assert kept(out) == [
        [True, False, True, False, False, False],  # k=1: both tied maxima
        [True, False, True, False, False, False],
        [True, False, True, True, True, False],    # k=3: the tie at the 3rd value is kept
        [True] * 6, [True] * 6, [True] * 6,        # k = vocab, k > vocab, k = 0 (off)
    ]
    assert kept(apply_top_k(logits[:1], torch.tensor([-1]))) == [[True] * 6]


@FAST
@given(case=logit_cases, data=st.data())
def test_top_p_matches_reference(case, data):
    seed, rows, vocab, scale = case
    logits = random_logits(seed, rows, vocab, scale)
    ps = data.draw(st.lists(st.one_of(st.floats(1e-6, 1.0), st.just(1.0)), min_size=rows, max_size=rows))
    out = apply_top_p(logits, torch.tensor(ps))
    check_unchanged_where_kept(out, logits)
    for r in range(rows):
        want, borderline = ref_top_p(logits[r].tolist(), ps[r])
        if borderline:
            continue
        assert kept(out)[r] == want, (r, ps[r])


def test_top_p_edge_values():
    logits = random_logits(3, 4, 50, 2.0)
    out = apply_top_p(logits, torch.tensor([1.0, 1e-9, 1e-9, 1.0]))
    for r, row in enumerate(kept(out)):
        if r in (0, 3):
            assert all(row), "top_p=1 keeps everything"
        else:
            assert row == [i == int(logits[r].argmax()) for i in range(50)], "tiny top_p keeps the argmax only"
    # one dominant token with p just below its mass: only it survives; just above: the runner-up joins
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 2)
    p0 = softmax64(logits[0].tolist())[0]
    assert kept(apply_top_p(logits, torch.tensor([p0 - 1e-3, p0 + 1e-3]))) == [
        [True, False, False, False], [True, True, False, False]]


@FAST
@given(case=logit_cases, data=st.data())
def test_min_p_matches_reference(case, data):
    seed, rows, vocab, scale = case
    logits = random_logits(seed, rows, vocab, scale)
    ms = data.draw(st.lists(st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0])), min_size=rows,
                            max_size=rows))
    out = apply_min_p(logits, torch.tensor(ms))
    check_unchanged_where_kept(out, logits)
    for r in range(rows):
        want, borderline = ref_min_p(logits[r].tolist(), ms[r])
        if borderline:
            continue
        assert kept(out)[r] == want, (r, ms[r])


def test_min_p_edge_values():
    logits = random_logits(5, 3, 40, 2.0)
    out = apply_min_p(logits, torch.tensor([0.0, 1.0, 0.5]))
    assert all(kept(out)[0])
    assert kept(out)[1] == [i == int(logits[1].argmax()) for i in range(40)]
    want, _ = ref_min_p(logits[2].tolist(), 0.5)
    assert kept(out)[2] == want and 1 <= sum(want) < 40


@FAST
@given(case=logit_cases, data=st.data())
def test_repetition_penalty_matches_reference(case, data):
    seed, rows, vocab, scale = case
    logits = random_logits(seed, rows, vocab, scale)
    pens = data.draw(st.lists(st.floats(0.2, 5.0), min_size=rows, max_size=rows))
    seen = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(seed + 1)) < 0.4
    out = apply_repetition_penalty(logits, seen, torch.tensor(pens))
    ref = torch.tensor([ref_repetition_penalty(logits[r].tolist(), seen[r].tolist(), pens[r]) for r in range(rows)])
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=0)


def test_repetition_penalty_lowers_seen_tokens_of_either_sign():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[True, True, False, False]]), torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


# --- (c) the distribution sample() draws from -------------------------------------------------------

CHI_LOGITS = [2.0, 1.6, 1.2, 0.9, 0.4, 0.0, -0.6, -1.5]
CHI_CASES = {
    "T0.7,top_p0.9": dict(temperature=0.7, top_p=0.9),
    "T2,top_k3": dict(temperature=2.0, top_k=3),
    "T0.6,min_p0.2": dict(temperature=0.6, min_p=0.2),
    "T0.5,k5,p0.8,min_p0.05": dict(temperature=0.5, top_k=5, top_p=0.8, min_p=0.05),
}


def expected_probs(logits: list[float], temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0) -> list[float]:
    """Temperature -> top-k -> top-p -> min-p on a float64 row, as vLLM orders them."""
    row = [x / temperature for x in logits]
    for step in (lambda r: ref_top_k(r, top_k), lambda r: ref_top_p(r, top_p)[0], lambda r: ref_min_p(r, min_p)[0]):
        row = [x if k else NEG_INF for x, k in zip(row, step(row))]  # each step sees the previous truncation
    return softmax64(row)


def test_sample_draws_from_processed_distribution():
    """One batch mixes four parameter sets (rows interleaved); each set's draws fit its distribution."""
    draws_per_case = 3000
    names = list(CHI_CASES)
    params = [SamplingParams(**CHI_CASES[names[i % len(names)]]) for i in range(draws_per_case * len(names))]
    logits = torch.tensor([CHI_LOGITS] * len(params))
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.tensor(sample(logits, params, [gen] * len(params)).token_ids)
    for c, name in enumerate(names):
        counts = torch.bincount(tokens[c :: len(names)], minlength=len(CHI_LOGITS)).tolist()
        probs = expected_probs(CHI_LOGITS, **CHI_CASES[name])
        support = [i for i, q in enumerate(probs) if q > 0]
        assert 2 <= len(support) < len(CHI_LOGITS), f"{name}: the case must truncate something"
        assert all(counts[i] == 0 for i in range(len(probs)) if probs[i] == 0), f"{name}: truncated token drawn"
        obs = [counts[i] for i in support]
        exp = [probs[i] * draws_per_case for i in support]
        assert chisquare(obs, exp).pvalue > 0.01, (name, obs, exp)
        # the test has power: the same draws clearly reject the untempered, untruncated distribution
        plain = softmax64(CHI_LOGITS)
        assert chisquare(obs, [plain[i] * draws_per_case / sum(plain[j] for j in support) for i in support]
                         ).pvalue < 1e-3, name


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = random_logits(9, 6, 30, 3.0)
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.5) if i % 2 == 0 else SamplingParams(temperature=2.0)
              for i in range(6)]
    res = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(6)])
    for i in range(0, 6, 2):
        assert res.token_ids[i] == int(logits[i].argmax())


def test_a_temperature_below_0_01_is_raised_to_0_01_as_in_vllm():
    """Dividing logits by a tiny temperature risks inf/NaN (which would fail the whole batch's step): vLLM raises
    0 < T < 0.01 to 0.01 with a warning, and so does minifer. 0 stays greedy."""
    with pytest.warns(UserWarning, match="raised to 0.01"):
        params = SamplingParams(temperature=1e-30)
    assert params.temperature == 0.01 and not params.greedy
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.01).temperature == 0.01
    logits = torch.tensor([[1e4, -1e4, 0.0, float("-inf")]])
    res = sample(logits, [params], [torch.Generator().manual_seed(0)])
    assert res.token_ids == [0] and math.isfinite(res.sampled_logprob[0])


def test_top_k_beyond_the_vocabulary_keeps_every_token():
    """A top_k larger than the vocabulary means no truncation, and never reaches a tensor as is (not even one set
    after validation, beyond int64: ``torch.tensor`` would fail the whole batch)."""
    from minifer.sample.sampler import process_logits

    logits = random_logits(3, 3, 10, 1.0)
    huge = SamplingParams()
    huge.top_k = 10**20
    out = process_logits(logits, [SamplingParams(top_k=2**31 - 1), huge, SamplingParams(top_k=3)], None)
    assert torch.equal(out[:2], logits[:2]) and int(torch.isfinite(out[2]).sum()) == 3


# --- (b) seeded requests ----------------------------------------------------------------------------


def test_seeded_request_reproduces_alone_and_batched(target_llm):
    import minifer

    seeded = SamplingParams(seed=7, temperature=1.0, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    prompt = "Once upon a time"
    alone = target_llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = target_llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == again and len(alone) == 24
    batch = target_llm.generate(["The little bird was sad because the", prompt, "Tom"], [other, seeded, other],
                                use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    split = minifer.LLM("tinystories-target", dtype="float32", device="cpu", max_num_seqs=2, seed=99)
    batch = split.generate(["Tom", "A dog", prompt], [other, other, seeded], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    # the seed is what fixes the draws: another seed gives another continuation
    other_seed = SamplingParams(seed=8, temperature=1.0, max_tokens=24, ignore_eos=True)
    assert target_llm.generate(prompt, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


# --- (d) stop conditions ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_story(target_llm):
    """The target's unconstrained greedy continuation of a prompt (ignoring EOS): ids and text."""
    out = target_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 48
    return out.token_ids, out.text


def _tokens_until(tok, ids, needle):
    """The number of leading tokens whose decoded text first contains ``needle``."""
    return next(m for m in range(1, len(ids) + 1) if needle in tok.decode(ids[:m], skip_special_tokens=True))


def test_stop_string_truncates_text(target_llm, greedy_story):
    ids, text = greedy_story
    stop = text[25:36]  # spans several tokens, discovered from the model's own output
    assert len(stop.strip()) >= 5
    out = target_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=48, stop=stop),
                              use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text
    m = _tokens_until(target_llm.get_tokenizer(), ids, stop)
    assert out.token_ids == ids[:m]


def test_earliest_stop_string_wins(target_llm, greedy_story):
    ids, text = greedy_story
    early, late = text[12:20], text[60:75]
    assert text.find(early) < text.find(late)
    out = target_llm.generate("Once upon a time",
                              SamplingParams(temperature=0, max_tokens=48, stop=["#never#", late, early]),
                              use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", early)
    assert out.text == text[: text.find(early)]


def test_absent_stop_string_runs_to_length(target_llm, greedy_story):
    ids, text = greedy_story
    out = target_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=48, stop=["#never#"],
                                                                 ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids, out.text) == ("length", None, ids, text)


def test_stop_token_ids(target_llm, greedy_story):
    ids, _ = greedy_story
    stop_id = ids[6]
    first = ids.index(stop_id)
    out = target_llm.generate("Once upon a time",
                              SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[1999, stop_id]),
                              use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == ids[: first + 1]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_is_in_token_ids_but_not_in_the_text(target_llm, greedy_story, include):
    """vLLM's rule: the token that stopped a request stays in ``token_ids``, its text is not in ``text``
    (``include_stop_str_in_output=True`` keeps it), for stop_token_ids and for EOS when special tokens are shown."""
    tok = target_llm.get_tokenizer()
    ids, _ = greedy_story
    stop_id = ids[6]
    out = target_llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=48, stop_token_ids=[stop_id], include_stop_str_in_output=include),
        use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == stop_id and tok.decode([stop_id]).strip()
    assert out.text == tok.decode(out.token_ids if include else out.token_ids[:-1])
    prompt = "Tom and his dog"  # ends with EOS after about ten tokens
    out = target_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False,
                                                     include_stop_str_in_output=include),
                              use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == tok.eos_token_id and out.finish_reason == "stop"
    assert out.text.endswith("<|endoftext|>") == include and out.text.strip()


def test_include_stop_str_in_output_keeps_the_stop_string(target_llm, greedy_story):
    _, text = greedy_story
    stop = text[25:36]
    out = target_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=48, stop=stop,
                                                                 include_stop_str_in_output=True),
                              use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[: text.find(stop) + len(stop)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_deltas_add_up_to_the_final_text(target_llm, greedy_story, data):
    """Whatever ends a request (a stop string, kept or cut; a stop token; EOS), a stream never sends text that the
    final text does not contain: the deltas add up to it exactly."""
    import minifer

    ids, text = greedy_story
    stop_at = data.draw(st.integers(2, 40))
    length = data.draw(st.integers(1, 6))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=data.draw(st.booleans()),
                            stop=data.draw(st.sampled_from([None, [text[stop_at : stop_at + length]]])),
                            stop_token_ids=data.draw(st.sampled_from([None, [ids[stop_at // 4]]])),
                            include_stop_str_in_output=data.draw(st.booleans()),
                            skip_special_tokens=data.draw(st.booleans()))
    engine = minifer.LLM("tinystories-target", share_weights_with=target_llm).engine
    deltas = []
    for prompt in ("Once upon a time", "Tom and his dog"):
        engine.add_request(prompt, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append((out.request_id, out.outputs[0].delta_text))
            if out.finished:
                finals[out.request_id] = out.outputs[0].text
    for rid, final in finals.items():
        assert "".join(d for r, d in deltas if r == rid) == final, (rid, params)


def test_eos_stops_unless_ignored(target_llm):
    eos = target_llm.get_tokenizer().eos_token_id
    prompt = "Tom and his dog"  # the target ends this story after about ten tokens
    out = target_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1] and len(out.token_ids) < 64
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert "<|endoftext|>" not in out.text and out.text.strip()
    n = len(out.token_ids)
    cont = target_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n + 5, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0]
    assert cont.finish_reason == "length" and len(cont.token_ids) == n + 5
    assert cont.token_ids[:n] == out.token_ids


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_gives_length(target_llm, max_tokens):
    outs = target_llm.generate(["Once upon a time", "Tom"],
                               SamplingParams(temperature=0.8, seed=3, max_tokens=max_tokens, ignore_eos=True),
                               use_tqdm=False)
    for o in outs:
        assert (o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) == ("length", max_tokens)
        assert o.finished


# --- (e) logprobs -----------------------------------------------------------------------------------


def _hf_logprobs(hf_target, prompt_ids, gen_ids):
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt_ids + gen_ids])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]


def test_logprobs_top3_greedy(target_llm, hf_target):
    out = target_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8, logprobs=3),
                              use_tqdm=False)[0]
    comp = out.outputs[0]
    ref = _hf_logprobs(hf_target, out.prompt_token_ids, comp.token_ids)
    assert len(comp.logprobs) == len(comp.token_ids) == 8
    for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        top3 = ref[step].topk(3).indices.tolist()
        assert set(entry) == set(top3) and tok == top3[0]
        assert {t: e.rank for t, e in entry.items()} == {t: r for r, t in enumerate(top3, start=1)}
        for t, e in entry.items():
            assert abs(e.logprob - float(ref[step, t])) < 1e-4
            assert e.decoded_token == target_llm.get_tokenizer().decode([t])
    # the first generated token against a single HF forward of the prompt alone
    with torch.no_grad():
        first = torch.log_softmax(hf_target(torch.tensor([out.prompt_token_ids])).logits[0, -1].double(), -1)
    for t, e in comp.logprobs[0].items():
        assert abs(e.logprob - float(first[t])) < 1e-4
    assert abs(comp.cumulative_logprob - sum(comp.logprobs[i][t].logprob for i, t in enumerate(comp.token_ids))) < 1e-4


def test_logprobs_include_sampled_token_outside_top_k(target_llm, hf_target):
    """Hot sampling picks tokens outside the top 3: they are added with their true rank."""
    out = target_llm.generate("Once upon a time", SamplingParams(temperature=2.5, seed=11, max_tokens=24, logprobs=3,
                                                                 ignore_eos=True), use_tqdm=False)[0]
    comp = out.outputs[0]
    ref = _hf_logprobs(hf_target, out.prompt_token_ids, comp.token_ids)
    outside = 0
    for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        top3 = ref[step].topk(3).indices.tolist()
        assert tok in entry and set(top3) <= set(entry)
        rank = int((ref[step] > ref[step, tok]).sum()) + 1
        assert entry[tok].rank == rank
        assert abs(entry[tok].logprob - float(ref[step, tok])) < 1e-4
        if tok not in top3:
            outside += 1
            assert len(entry) == 4 and rank > 3
    assert outside >= 1, "temperature 2.5 should leave the top 3 at least once in 24 draws"


def test_logprobs_zero_gives_the_sampled_token_only(target_llm, hf_target):
    out = target_llm.generate("Tom", SamplingParams(temperature=1.0, seed=5, max_tokens=6, logprobs=0,
                                                    ignore_eos=True), use_tqdm=False)[0]
    comp = out.outputs[0]
    ref = _hf_logprobs(hf_target, out.prompt_token_ids, comp.token_ids)
    for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert list(entry) == [tok]
        assert entry[tok].rank == int((ref[step] > ref[step, tok]).sum()) + 1
        assert abs(entry[tok].logprob - float(ref[step, tok])) < 1e-4


def test_no_logprobs_by_default(target_llm):
    comp = target_llm.generate("Tom", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert comp.logprobs is None and comp.cumulative_logprob is None


MULTIBYTE_WORDS = ["café", " naïve", " 日本", "語", " 🙂", " über", " the", " cat", ".", " a"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(st.sampled_from(MULTIBYTE_WORDS), min_size=1, max_size=12), data=st.data())
def test_stop_strings_on_multibyte_text_match_a_full_decode(target_llm, words, data):
    """Stop strings are matched on the incrementally decoded text, a token at a time. Oracle: decode the
    whole output after every token; the request must stop at the first token whose full decode contains the
    stop string, with the text cut before it, even where characters span several byte tokens. With
    ``min_tokens=k`` the stop string must end past the characters that the first k-1 tokens completed."""
    from minifer.request import Request

    tok = target_llm.get_tokenizer()
    text = "".join(words)
    ids = tok.encode(text, add_special_tokens=False)
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start:data.draw(st.integers(start + 1, min(len(text), start + 6)))]
    k = data.draw(st.integers(0, len(ids)))
    seq = Request("r", None, [1], SamplingParams(max_tokens=len(ids), stop=[stop], ignore_eos=True, min_tokens=k),
                   len(ids), frozenset())
    for t in ids:
        seq.append_token(t, 0.0, None, tok)
        if seq.is_finished:
            break
    # the characters complete before token k: the longest prefix of ids[:k-1] that does not end mid-character
    before = next(tok.decode(ids[:j]) for j in range(max(k - 1, 0), -1, -1)
                  if not tok.decode(ids[:j]).endswith("\ufffd"))
    ends = [m for m in range(max(k, 1), len(ids) + 1)
            if any(p + len(stop) > len(before) for p in _occurrences(tok.decode(ids[:m]), stop))]
    if not ends:
        assert (seq.finish_reason, len(seq.output_token_ids)) == ("length", len(ids))
        return
    m = ends[0]
    full = tok.decode(ids[:m])
    cut = next(p for p in _occurrences(full, stop) if p + len(stop) > len(before))
    assert (seq.finish_reason, seq.stop_reason, len(seq.output_token_ids)) == ("stop", stop, m)
    assert seq.to_output(tok).outputs[0].text == full[:cut]


def test_a_stop_string_ending_in_the_character_the_min_tokens_th_token_completes(target_llm):
    """"é" is two byte tokens; with min_tokens=4 on "café" the fourth token completes it, so the stop string
    "é" ends in that token's text and stops the request (a decode of the first three tokens ends in U+FFFD,
    which must not count as a character already written)."""
    from minifer.request import Request

    tok = target_llm.get_tokenizer()
    ids = tok.encode("café", add_special_tokens=False)
    assert len(ids) == 4 and tok.decode(ids[:3]).endswith("\ufffd")
    seq = Request("r", None, [1], SamplingParams(max_tokens=8, stop=["é"], min_tokens=4), 8, frozenset())
    for t in ids:
        seq.append_token(t, 0.0, None, tok)
    assert (seq.finish_reason, seq.stop_reason, seq.to_output(tok).outputs[0].text) == ("stop", "é", "caf")


def _occurrences(text: str, sub: str) -> list[int]:
    return [i for i in range(len(text) - len(sub) + 1) if text.startswith(sub, i)]
