"""Speculative decoding's self-contained pieces: greedy verification, lossless rejection sampling (checked
by chi-squared against the target distribution, with wrong samplers shown to fail the same test), the
n-gram proposer and the speedup formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from minifer import SamplingParams
from minifer.sample.sampler import process_logits
from minifer.spec_decode.theory import acceptance_rate, estimate_alpha, expected_accepted, expected_speedup, expected_tokens_per_forward, optimal_k
from minifer.spec_decode.ngram_proposer import ngram_propose
from minifer.sample.rejection_sampler import one_hot_draft_probs, probs_from_logits, rejection_sample, verify_greedy

pytestmark = pytest.mark.core  # the fast tier (tests/README.md)

FAST = settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def gens(n: int, offset: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(offset + i) for i in range(n)]


# --- verify_greedy ------------------------------------------------------------------------------------


def test_verify_greedy_hand_cases():
    target = torch.tensor([[4, 5, 6, 7],   # all 3 accepted: the bonus 7 follows
                           [4, 9, 6, 7],   # second rejected: the target's 9 replaces it, then stop
                           [1, 5, 6, 7],   # first rejected: only the target's token
                           [8, 0, 0, 0],   # k = 0: the plain next token (padding never read)
                           [4, 5, 3, 3]])  # k = 2 in a max_k = 3 batch: bonus at column 2, not 3
    drafts = [[4, 5, 6], [4, 5, 6], [4, 5, 6], [], [4, 5]]
    assert verify_greedy(drafts, target) == [[4, 5, 6, 7], [4, 9], [1], [8], [4, 5, 3]]


def test_verify_greedy_stops_at_the_first_mismatch_even_if_later_ones_agree():
    assert verify_greedy([[1, 2, 3]], torch.tensor([[1, 0, 3, 4]])) == [[1, 0]]


def test_verify_greedy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="batch, max_k"):
        verify_greedy([[1]], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="2 rows but draft_tokens has 1"):
        verify_greedy([[1]], torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="needs k \\+ 1 = 3"):
        verify_greedy([[1, 2]], torch.zeros(1, 2, dtype=torch.long))


@FAST
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=5), st.lists(st.integers(0, 3), min_size=6,
                                                                                 max_size=6)), min_size=1, max_size=6))
def test_verify_greedy_properties(rows):
    drafts = [d for d, _ in rows]
    target = torch.tensor([t for _, t in rows])
    for draft, row, out in zip(drafts, target.tolist(), verify_greedy(drafts, target)):
        n = len(out) - 1  # accepted drafts
        assert 0 <= n <= len(draft)
        assert out[:n] == draft[:n] == row[:n], "the accepted tokens are an agreeing prefix"
        assert out[n] == row[n], "the last token is always the target's"
        assert n == len(draft) or draft[n] != row[n], "stopped only at a disagreement or after all k"


# --- rejection_sample: the distribution of what it emits -----------------------------------------------


def chi2_pvalue(samples: torch.Tensor | list[int], probs: torch.Tensor) -> float:
    """p-value of the samples under ``probs`` (0.0 if a zero-probability outcome was drawn); outcomes with
    fewer than 5 expected draws are pooled so the chi-squared approximation holds."""
    samples = torch.as_tensor(samples)
    probs = probs.double().flatten() / probs.double().sum()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * len(samples)
    big = expected >= 5
    obs = counts[big].tolist() + ([float(counts[~big].sum())] if bool((~big & (probs > 0)).any()) else [])
    exp = expected[big].tolist() + ([float(expected[~big].sum())] if len(obs) > int(big.sum()) else [])
    return float(chisquare(obs, exp).pvalue)


V = 6


def _dist(seed: int, scale: float = 1.5, zeros: tuple[int, ...] = ()) -> torch.Tensor:
    w = (torch.randn(V, generator=torch.Generator().manual_seed(seed)) * scale).exp()
    w[list(zeros)] = 0
    return w / w.sum()


def _table(seed: int, **kw) -> torch.Tensor:
    """A distribution per previous token: position 1's p or q depends on the token emitted at position 0."""
    return torch.stack([_dist(seed * 100 + x, **kw) for x in range(V)])


# (name, p0, p1[prev], q0, q1[prev]): p is the target, q the draft.
CASES = [
    ("random p and q", _dist(1), _table(2), _dist(3), _table(4)),
    ("q far from p", _dist(5), _table(6), _dist(7, scale=4.0), _table(8, scale=4.0)),
    ("q has zeros where p > 0", _dist(9), _table(10), _dist(11, zeros=(0, 1, 2)), _table(12, zeros=(3, 4))),
    ("p has zeros where q > 0 (a truncated target)", _dist(13, zeros=(4, 5)), _table(14, zeros=(0, 2)), _dist(15),
     _table(16)),
]
N = 15_000


def speculate(p0, p1, q0, q1, k: int, n: int = N, seed: int = 0, sampler=rejection_sample) -> torch.Tensor:
    """``n`` independent requests, each with its own generator, speculating ``k`` (1 or 2) tokens from the
    same context; a request that emitted one token takes a plain step (k = 0) for its second, as the engine
    would. Returns the first two tokens of each, ``[n, 2]``."""
    draw = torch.Generator().manual_seed(10_000 + seed)
    x0 = torch.multinomial(q0.expand(n, V), 1, generator=draw)[:, 0]
    x1 = torch.multinomial(q1[x0], 1, generator=draw)[:, 0]
    drafts = torch.stack([x0, x1], 1)[:, :k].tolist()
    bonus = _dist(99).expand(n, V)  # p after two drafts: any distribution (its own test is the k = 1 case)
    q = torch.stack([q0.expand(n, V), q1[x0]], 1)[:, :k]
    p = torch.stack([p0.expand(n, V), p1[x0], bonus], 1)[:, : k + 1]
    generators = gens(n, offset=seed * n)
    out = sampler(drafts, q, p, generators)
    short = [i for i, o in enumerate(out) if len(o) == 1]
    if short:
        first = torch.tensor([out[i][0] for i in short])
        more = sampler([[] for _ in short], torch.zeros(len(short), 0, V), p1[first][:, None],
                       [generators[i] for i in short])
        for i, o in zip(short, more):
            out[i] = out[i] + o
    return torch.tensor([o[:2] for o in out])


def joint(p0: torch.Tensor, p1: torch.Tensor) -> torch.Tensor:
    """P(y0, y1) = p0(y0) p1(y1 | y0), flattened as y0 * V + y1."""
    return (p0[:, None] * p1).flatten()


@pytest.mark.parametrize("case, k", [(c, 2) for c in CASES] + [(c, 1) for c in CASES[:2]],
                         ids=[f"{c[0]}, k={k}" for c, k in [(c, 2) for c in CASES] + [(c, 1) for c in CASES[:2]]])
def test_rejection_sampling_reproduces_the_target_distribution(case, k):
    """The theorem: every emitted token is distributed as p at its position given the ones before it, so the
    first token follows p0 and the first two jointly p0(y0) p1(y1 | y0), whatever the draft was."""
    name, p0, p1, q0, q1 = case
    y = speculate(p0, p1, q0, q1, k, seed=k)
    assert chi2_pvalue(y[:, 0], p0) > 0.01, f"{name}: the first token is not distributed as p0"
    assert chi2_pvalue(y[:, 0] * V + y[:, 1], joint(p0, p1)) > 0.01, f"{name}: the first two tokens"


def _resample_from_p(drafts, q, p, generators):
    """A classic mistake: on rejection, draw from p instead of the residual max(p - q, 0)."""
    out = rejection_sample(drafts, q, p, generators)
    for i, (d, o) in enumerate(zip(drafts, out)):
        if len(o) <= len(d):  # a draft was rejected: replace the residual's token by one from p
            o[-1] = int(torch.multinomial(p[i, len(o) - 1], 1, generator=generators[i]))
    return out


def _always_accept(drafts, q, p, generators):
    """Another: keep every draft token (the target never gets a say except for the bonus)."""
    return [list(d) + [int(torch.multinomial(p[i, len(d)], 1, generator=g))]
            for i, (d, g) in enumerate(zip(drafts, generators))]


@pytest.mark.parametrize("wrong", [_resample_from_p, _always_accept])
def test_the_chi_squared_test_catches_wrong_samplers(wrong):
    """The test above can fail: the same draws through a wrong sampler are rejected decisively."""
    name, p0, p1, q0, q1 = CASES[1]
    y = speculate(p0, p1, q0, q1, 2, n=8_000, sampler=wrong)
    assert chi2_pvalue(y[:, 0] * V + y[:, 1], joint(p0, p1)) < 1e-4
    assert chi2_pvalue(y[:, 0], p0) < 1e-4


def test_bonus_token_after_all_accepted_follows_p_at_position_k():
    """When the draft is the target (q = p) every token is accepted and the second is the bonus, from p1."""
    p0, p1 = _dist(20), _table(21)
    y = speculate(p0, p1, p0, p1, 1, n=8_000)
    assert chi2_pvalue(y[:, 0] * V + y[:, 1], joint(p0, p1)) > 0.01


def test_sampling_with_temperature_and_top_p_reproduces_the_processed_target():
    """p and q from probs_from_logits with the request's knobs: the emitted token follows the *processed*
    target distribution (top-p cuts its support), not the raw softmax."""
    vocab, n = 8, N
    g = torch.Generator().manual_seed(6)
    target_logits, draft_logits = torch.randn(1, 3, vocab, generator=g), torch.randn(1, 3, vocab, generator=g)
    params = SamplingParams(temperature=0.8, top_p=0.8, top_k=6)
    p = probs_from_logits(target_logits, [params])[0]
    q = probs_from_logits(draft_logits[:, :2], [params])[0]
    assert 2 <= int((p[0] > 0).sum()) < vocab, "the case must truncate the target's support"
    x = torch.multinomial(q[0].expand(n, vocab), 1, generator=g)
    x1 = torch.multinomial(q[1].expand(n, vocab), 1, generator=g)
    out = rejection_sample(torch.cat([x, x1], 1).tolist(), q.expand(n, 2, vocab), p.expand(n, 3, vocab), gens(n))
    first = torch.tensor([o[0] for o in out])
    assert chi2_pvalue(first, p[0]) > 0.01
    assert chi2_pvalue(first, target_logits[0, 0].softmax(-1)) < 1e-4, "the test must tell the knobs apart"
    # the second token, among requests whose first draft was accepted (a rejection never emits the draft)
    second = torch.tensor([o[1] for o in out if len(o) >= 2])
    assert chi2_pvalue(second, p[1]) > 0.01


# --- rejection_sample: determinism, edge cases, errors ---------------------------------------------------


def _batch(seed: int, b: int, max_k: int, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, max_k, vocab, generator=g).softmax(-1)
    p = torch.randn(b, max_k + 1, vocab, generator=g).softmax(-1)
    ks = torch.randint(0, max_k + 1, (b,), generator=g).tolist()
    drafts = [torch.multinomial(q[i, :k], 1, generator=g)[:, 0].tolist() if k else [] for i, k in enumerate(ks)]
    return drafts, q, p


def test_documented_draw_order():
    """k uniforms in one torch.rand(k), accept while u < p(x)/q(x), then one torch.multinomial: the order the
    exercise specifies, reproduced by hand for one row."""
    drafts, q, p = _batch(0, 40, 4)
    got = rejection_sample(drafts, q, p, gens(40))
    for i, draft in enumerate(drafts):
        g = torch.Generator().manual_seed(i)
        u = torch.rand(len(draft), generator=g)
        n = 0
        while n < len(draft) and u[n] < p[i, n, draft[n]] / q[i, n, draft[n]]:
            n += 1
        dist = (p[i, n] - q[i, n]).clamp(min=0) if n < len(draft) else p[i, n]
        assert got[i] == draft[:n] + [int(torch.multinomial(dist, 1, generator=g))], i


def test_a_seeded_row_reproduces_alone_and_in_any_batch():
    drafts, q, p = _batch(1, 12, 3)
    full = rejection_sample(drafts, q, p, gens(12))
    assert full == rejection_sample(drafts, q, p, gens(12))
    for i in (0, 5, 11):
        alone = rejection_sample([drafts[i]], q[i : i + 1], p[i : i + 1], [torch.Generator().manual_seed(i)])
        assert alone == [full[i]]
    reordered = rejection_sample(drafts[::-1], q.flip(0), p.flip(0), gens(12)[::-1])
    assert reordered == full[::-1]
    assert full != rejection_sample(drafts, q, p, gens(12, offset=100)), "other seeds should change something"


def test_unseeded_rows_use_the_default_generator():
    drafts, q, p = _batch(2, 6, 2)
    torch.manual_seed(0)
    a = rejection_sample(drafts, q, p, [None] * 6)
    torch.manual_seed(0)
    assert a == rejection_sample(drafts, q, p, [None] * 6)


def test_k_zero_rows_sample_from_p_at_the_first_position():
    p = torch.zeros(3, 1, 5)
    p[0, 0, 2] = p[1, 0, 4] = 1.0
    p[2, 0, 1:3] = 0.5
    out = rejection_sample([[], [], []], torch.zeros(3, 0, 5), p, gens(3))
    assert out[0] == [2] and out[1] == [4] and out[2][0] in (1, 2)


def test_q_zero_for_the_draft_token_is_a_rejection_not_a_nan():
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    q = torch.tensor([[[0.0, 0.0, 1.0]]])  # the draft "proposed" token 0, which q gives probability 0
    for seed in range(20):
        out = rejection_sample([[0]], q, p, [torch.Generator().manual_seed(seed)])
        assert len(out[0]) == 1 and out[0][0] in (0, 1), out  # rejected; the residual max(p - q, 0) = p here


def test_a_token_the_target_excludes_is_never_accepted():
    p = torch.tensor([[[0.0, 1.0, 0.0], [1 / 3] * 3]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    assert all(rejection_sample([[0]], q, p, [torch.Generator().manual_seed(s)]) == [[1]] for s in range(50))


def test_empty_residual_falls_back_to_p():
    """p below q everywhere (p not quite normalised): max(p - q, 0) is all zero after a rejection."""
    q = torch.tensor([[[0.25, 0.25, 0.5, 0.0]]])
    p = torch.cat([0.5 * q, torch.tensor([[[0.0, 0.0, 0.0, 1.0]]])], 1)
    outs = [rejection_sample([[2]], q, p, [torch.Generator().manual_seed(s)])[0] for s in range(200)]
    rejected = [o for o in outs if len(o) == 1]
    assert rejected and all(o[0] in (0, 1, 2) for o in rejected)  # drawn from p[0], no crash
    assert all(o == [2, 3] for o in outs if len(o) == 2)


def test_greedy_rows_through_rejection_sample_match_verify_greedy():
    """probs_from_logits gives a greedy row a one-hot, and then rejection sampling is greedy verification."""
    g = torch.Generator().manual_seed(4)
    b, k, vocab = 16, 3, 9
    target, draft = torch.randn(b, k + 1, vocab, generator=g), torch.randn(b, k, vocab, generator=g)
    params = [SamplingParams(temperature=0, top_k=3)] * b
    p, q = probs_from_logits(target, params), probs_from_logits(draft, params)
    drafts = draft.argmax(-1).tolist()
    drafts = [d[: i % (k + 1)] for i, d in enumerate(drafts)]
    for i in range(b // 2):  # half the rows propose the target's own tokens, so long acceptances happen
        drafts[i] = target.argmax(-1)[i, : len(drafts[i])].tolist()
        q[i, : len(drafts[i])] = one_hot_draft_probs([drafts[i]], vocab)[0]
    want = verify_greedy(drafts, target.argmax(-1))
    assert rejection_sample(drafts, q, p, gens(b)) == want
    assert any(len(w) == len(d) + 1 for w, d in zip(want, drafts) if d), "no row accepted every draft"


def test_rejection_sample_rejects_bad_inputs():
    drafts, q, p = _batch(5, 3, 2)
    with pytest.raises(ValueError, match="3 rows but draft_tokens has 2"):
        rejection_sample(drafts[:2], q, p, gens(3))
    with pytest.raises(ValueError, match="2 generators for a batch of 3"):
        rejection_sample(drafts, q, p, gens(2))
    with pytest.raises(ValueError, match="agree on batch and vocabulary"):
        rejection_sample(drafts, q[..., :-1], p, gens(3))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rejection_sample([[11], [], []], q, p, gens(3))
    with pytest.raises(ValueError, match="needs k \\+ 1 = 4"):
        rejection_sample([[1, 2, 3], [], []], q, p, gens(3))
    with pytest.raises(ValueError, match="batch, max_k, vocab"):
        rejection_sample(drafts, q[0], p, gens(3))


# --- probs_from_logits -----------------------------------------------------------------------------------


def test_probs_from_logits_is_plain_samplings_processing_per_position():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 3, 20, generator=g) * 3
    params = [SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(temperature=1.3, top_k=4),
              SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=0)]
    probs = probs_from_logits(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == (4, 3, 20)
    for i in range(3):
        for t in range(3):
            want = process_logits(logits[i, t][None], [params[i]], None).softmax(-1)[0]
            torch.testing.assert_close(probs[i, t], want)
    assert torch.equal(probs[3], torch.nn.functional.one_hot(logits[3].argmax(-1), 20).float())


def test_probs_from_logits_needs_per_position_seen_for_a_repetition_penalty():
    logits = torch.randn(1, 2, 5)
    with pytest.raises(ValueError, match="repetition_penalty"):
        probs_from_logits(logits, [SamplingParams(repetition_penalty=1.2)])
    seen = torch.zeros(1, 2, 5, dtype=torch.bool)
    seen[0, 1, 3] = True  # the draft token before position 1
    probs = probs_from_logits(logits, [SamplingParams(repetition_penalty=1.2)], seen)
    want = process_logits(logits[0, 1][None], [SamplingParams(repetition_penalty=1.2)], seen[0, 1][None])
    torch.testing.assert_close(probs[0, 1], want.softmax(-1)[0])
    with pytest.raises(ValueError, match="seen must be"):
        probs_from_logits(logits, [SamplingParams()], seen[:, 0])
    with pytest.raises(ValueError, match="2 SamplingParams for a batch of 1"):
        probs_from_logits(logits, [SamplingParams()] * 2)


# --- ngram_propose ---------------------------------------------------------------------------------------


def test_ngram_repeated_phrase():
    #         the cat sat on the mat . the cat
    tokens = [1, 2, 3, 4, 1, 5, 6, 1, 2]
    assert ngram_propose(tokens, 3, 3, 1) == [3, 4, 1]


def test_ngram_no_match_and_short_sequences():
    assert ngram_propose([1, 2, 3, 4], 3, 3, 1) == []
    assert ngram_propose([], 3, 3, 1) == [] and ngram_propose([7], 3, 3, 1) == []


def test_ngram_prefers_the_longest_pattern():
    # "2 9" occurs after 8 (longest: "8 2 9"), and more recently after 5 (only "2 9")
    tokens = [8, 2, 9, 40, 41, 5, 2, 9, 50, 8, 2, 9]
    assert ngram_propose(tokens, 2, 3, 1) == [40, 41]
    assert ngram_propose(tokens, 2, 2, 1) == [50, 8], "capped at 2 tokens: the most recent '2 9'"


def test_ngram_takes_the_most_recent_occurrence():
    tokens = [3, 7, 10, 3, 7, 20, 3, 7]
    assert ngram_propose(tokens, 1, 2, 2) == [20]


def test_ngram_min_length_is_enforced():
    tokens = [5, 1, 2, 6, 2]  # only a 1-token match ("2")
    assert ngram_propose(tokens, 2, 3, 1) == [6, 2]
    assert ngram_propose(tokens, 2, 3, 2) == []


def test_ngram_proposals_stop_at_the_end_of_the_sequence():
    assert ngram_propose([4, 4, 4, 4], 5, 2, 1) == [4], "'4 4' last occurred ending one before the end"
    assert ngram_propose([1, 2, 1, 2], 5, 2, 2) == [1, 2]


@pytest.mark.parametrize("args, match", [((0, 3, 1), "k .* must be >= 1"), ((2, 1, 2), "prompt_lookup_min <="),
                                         ((2, 3, 0), "1 <= prompt_lookup_min"), ((2.0, 3, 1), "k must be an integer")])
def test_ngram_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        ngram_propose([1, 2, 1], *args)


def _ngram_brute_force(tokens: list[int], k: int, hi: int, lo: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        pattern = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                return tokens[start + n : start + n + k]
    return []


@FAST
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_ngram_matches_brute_force(tokens, k, lo, extra):
    assert ngram_propose(tokens, k, lo + extra, lo) == _ngram_brute_force(tokens, k, lo + extra, lo)


def test_ngram_on_a_long_sequence():
    tokens = list(range(100_000)) + [500, 501, 502]
    assert ngram_propose(tokens, 4, 3, 2) == [503, 504, 505, 506]
    assert ngram_propose(np.array(tokens), 4, 3, 2) == [503, 504, 505, 506]


# --- theory ---------------------------------------------------------------------------------------------


def test_expected_tokens_formula():
    for alpha in (0.0, 0.3, 0.8, 0.99):
        for k in (0, 1, 4, 7):
            assert math.isclose(expected_tokens_per_forward(alpha, k), (1 - alpha ** (k + 1)) / (1 - alpha))
    assert expected_tokens_per_forward(1.0, 4) == 5.0
    assert expected_tokens_per_forward(0.0, 4) == 1.0 and expected_tokens_per_forward(0.5, 0) == 1.0
    assert math.isclose(expected_accepted(0.6, 3), 0.6 + 0.36 + 0.216)


def test_expected_speedup_and_optimal_k():
    assert math.isclose(expected_speedup(0.8, 4, 0.1), 3.3616 / 1.4)  # Leviathan's eq. 1
    assert expected_speedup(0.5, 0, 10.0) == 1.0
    assert optimal_k(0.1, 0.5) == 0, "a poor, expensive draft: don't speculate"
    assert optimal_k(0.3, 0.3) == 0  # alpha <= c rules out even k = 1
    assert optimal_k(0.9, 0.05, k_max=8) >= 5
    assert optimal_k(1.0, 0.0, k_max=6) == 6 and optimal_k(0.8, 0.1, k_max=0) == 0
    ks = [optimal_k(a / 20, 0.05) for a in range(21)]
    assert ks == sorted(ks), "a better draft never wants fewer tokens"
    for k in (1, 3, 6):
        s = [expected_speedup(a / 20, k, 0.1) for a in range(21)]
        assert s == sorted(s), "speedup grows with alpha"


@pytest.mark.parametrize("call, match", [
    (lambda: expected_tokens_per_forward(1.2, 3), "alpha"), (lambda: expected_tokens_per_forward(-0.1, 3), "alpha"),
    (lambda: expected_tokens_per_forward(float("nan"), 3), "alpha"), (lambda: expected_tokens_per_forward(0.5, -1), "k"),
    (lambda: expected_speedup(0.5, 2, -0.1), "draft_cost"), (lambda: optimal_k(0.5, 0.1, k_max=-1), "k_max"),
    (lambda: estimate_alpha(5, 4), "cannot exceed"), (lambda: acceptance_rate(0, 0), "proposed is 0"),
    (lambda: estimate_alpha(1, 4, k=0), "k"),
])
def test_theory_rejects_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_estimate_alpha_inverts_the_model():
    assert estimate_alpha(3, 10) == 0.3 == acceptance_rate(3, 10)
    assert estimate_alpha(0, 10, k=4) == 0.0 and estimate_alpha(40, 40, k=4) == 1.0
    steps = 1000
    for alpha in (0.2, 0.6, 0.9):  # expected counts in, alpha out
        accepted = round(steps * expected_accepted(alpha, 4) * 1000)
        assert abs(estimate_alpha(accepted, steps * 4 * 1000, k=4) - alpha) < 1e-4
    rng = np.random.default_rng(0)  # simulated truncated-geometric steps: the estimate converges
    accepted = int(np.minimum(rng.geometric(1 - 0.7, size=20_000) - 1, 4).sum())
    assert abs(estimate_alpha(accepted, 20_000 * 4, k=4) - 0.7) < 0.01
    assert acceptance_rate(accepted, 20_000 * 4) < 0.6, "the raw rate underestimates alpha for k > 1"
