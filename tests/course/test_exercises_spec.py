"""The chapter-04 graders (``minifer_course.grading.spec``): minifer's own implementations pass, the classic
mistakes fail with a message that names them, and the chi-squared helper agrees with scipy.

(The generated notebooks themselves are covered by ``tests/course/test_exercises.py``, which discovers every
exercise source.)"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from minifer_course.grading import spec as grading_spec
from minifer.spec_decode.ngram_proposer import ngram_propose as ref_ngram_propose
from minifer.sample.rejection_sampler import verify_greedy as ref_verify_greedy

REFERENCES = [
    (grading_spec.check_verify_greedy, ref_verify_greedy, "verify_greedy: 7/7 checks passed"),
    (grading_spec.check_rejection_sample, grading_spec._rejection_sample_with_minifer,
     "rejection_sample: 8/8 checks passed"),
    (grading_spec.check_ngram_propose, ref_ngram_propose, "ngram_propose: 10/10 checks passed"),
]


@pytest.mark.parametrize("grader, reference, summary", REFERENCES, ids=lambda v: getattr(v, "__name__", None))
def test_graders_pass_minifers_own_implementation(grader, reference, summary, capsys):
    grader(reference)
    out = capsys.readouterr().out
    assert out.rstrip().endswith(summary), out
    assert "FAIL" not in out


# --- deliberately wrong versions ---------------------------------------------------------------------------


def _verify(drafts, target, *, bonus=True, target_token=True, stop=True, last_column=False, shift=0):
    """The notebook's verify_greedy with switches for the classic mistakes."""
    out = []
    for d, row in zip(drafts, target.tolist()):
        emitted = []
        for j, x in enumerate(d):
            if x == row[min(j + shift, len(row) - 1)]:
                emitted.append(x)
                continue
            emitted.append(row[j] if target_token else x)
            if stop:
                break
        else:
            if bonus:
                emitted.append(row[-1] if last_column else row[len(d)])
        out.append(emitted)
    return out


def _rejection(draft, q, p, generator, *, residual="p-q", accept="ratio", draw="once", zero_q="reject",
               fallback=True, position=None, residual_position=None, bonus_offset=0):
    """The notebook's rejection_sample (one sequence) with switches for the classic mistakes."""
    k = len(draft)
    u = torch.rand(k, generator=generator) if draw == "once" else None
    out = []
    for j, x in enumerate(draft):
        pj, qj = p[j if position is None else position], q[j if position is None else position]
        uj = u[j] if u is not None else torch.rand(1, generator=generator)[0]
        if accept == "always":
            ok = True
        elif accept == "p":
            ok = bool(uj < pj[x])
        elif qj[x] == 0 and zero_q == "reject":
            ok = False
        else:
            ok = bool(uj < pj[x] / qj[x])
        if not ok:
            if residual_position is not None:
                pj, qj = p[residual_position], q[residual_position]
            dist = {"p-q": (pj - qj).clamp(min=0), "q-p": (qj - pj).clamp(min=0), "p": pj, "raw": pj - qj}[residual]
            if fallback and not dist.sum() > 0:
                dist = pj
            return out + [int(torch.multinomial(dist, 1, generator=generator))]
        out.append(x)
    return out + [int(torch.multinomial(p[k - bonus_offset], 1, generator=generator))]


def _ngram(tokens, k, hi, lo, *, longest_first=True, most_recent=True, include_suffix=False, pad=False,
           skip_min=False):
    """The notebook's ngram_propose with switches for the classic mistakes."""
    sizes = range(hi, lo - 1 + skip_min, -1) if longest_first else range(lo, hi + 1)
    for n in sizes:
        if n >= len(tokens) + include_suffix:
            continue
        pattern = tokens[-n:]
        last_start = len(tokens) - n - (0 if include_suffix else 1)
        starts = range(last_start, -1, -1) if most_recent else range(0, last_start + 1)
        for s in starts:
            if tokens[s : s + n] == pattern:
                proposal = tokens[s + n : s + n + k]
                return proposal + [proposal[-1]] * (k - len(proposal)) if pad and proposal else proposal
    return []


WRONG = [
    (grading_spec.check_verify_greedy, lambda d, t: _verify(d, t, bonus=False), "bonus token target_argmax"),
    (grading_spec.check_verify_greedy, lambda d, t: _verify(d, t, target_token=False), "not the draft's"),
    (grading_spec.check_verify_greedy, lambda d, t: _verify(d, t, stop=False), "and stop"),
    (grading_spec.check_verify_greedy, lambda d, t: _verify(d, t, last_column=True), "padding"),
    (grading_spec.check_verify_greedy, lambda d, t: _verify(d, t, shift=1), "check 1/7"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, residual="p"), "drew from p; draw from the residual"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, accept="p"), "accept with probability p\\(x\\)"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, accept="always"), "must always reject"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, residual="q-p"), "check 2/8"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, residual="raw"), "clamp p - q at 0"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, fallback=False), "draw from p if nothing is left"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, zero_q="divide"), "q\\[j, x\\] == 0, reject"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, position=0), "check 1/8"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, residual_position=0), "first two emitted tokens are not"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, bonus_offset=1), "bonus from p\\[k\\]"),
    (grading_spec.check_rejection_sample, lambda *a: _rejection(*a, draw="one at a time"), "torch.rand\\(k, generator"),
    (grading_spec.check_ngram_propose, lambda *a: _ngram(*a, longest_first=False), "prompt_lookup_max first"),
    (grading_spec.check_ngram_propose, lambda *a: _ngram(*a, most_recent=False), "search backwards from the end"),
    (grading_spec.check_ngram_propose, lambda *a: _ngram(*a, include_suffix=True), "start before len"),
    (grading_spec.check_ngram_propose, lambda *a: _ngram(*a, pad=True), "fewer than k tokens"),
    (grading_spec.check_ngram_propose, lambda t, k, hi, lo: _ngram(t, k, hi, 1), "prompt_lookup_min count"),
    (grading_spec.check_ngram_propose, lambda *a: _ngram(*a, skip_min=True),
     r"(?s)check 5/10.*hint: only n = prompt_lookup_min = 1 matches here, and you never tried it: .*both included"
     r", range\(prompt_lookup_max, prompt_lookup_min - 1, -1\)$"),  # and no unrelated hint after it
]


@pytest.mark.parametrize("grader, wrong, match", WRONG, ids=[m for _, _, m in WRONG])
def test_graders_reject_classic_mistakes(grader, wrong, match, capsys):
    with pytest.raises(AssertionError, match=match):
        grader(wrong)
    assert "  FAIL  " in capsys.readouterr().out


def test_graders_accept_the_notebooks_approach():
    """The straightforward per-row loops (the solution's approach, as in the switches above) pass."""
    grading_spec.check_verify_greedy(_verify)
    grading_spec.check_rejection_sample(_rejection)
    grading_spec.check_ngram_propose(_ngram)


def test_inputs_modified_in_place_are_reported():
    def pops(drafts, target):
        out = ref_verify_greedy(drafts, target)
        drafts.clear()
        return out

    with pytest.raises(AssertionError, match="modified draft_tokens"):
        grading_spec.check_verify_greedy(pops)

    def zeroes(draft, q, p, generator):
        out = grading_spec._rejection_sample_with_minifer(draft, q, p, generator)
        p.zero_()
        return out

    with pytest.raises(AssertionError, match="modified draft_tokens, q or p"):
        grading_spec.check_rejection_sample(zeroes)


def test_an_assert_in_the_learners_code_is_reported_as_theirs():
    def asserts(tokens, k, hi, lo):  # `assert len(tokens) > 1, "..."` in a notebook
        if len(tokens) < 2:
            raise AssertionError("too short")
        return ref_ngram_propose(tokens, k, hi, lo)

    with pytest.raises(AssertionError, match=r"^ngram_propose: check 9/10 \(empty .*\): your function raised "
                                             r"AssertionError: too short$"):
        grading_spec.check_ngram_propose(asserts)


def test_not_implemented_stubs_get_the_clear_message():
    def stub(*args):
        raise NotImplementedError("implement it")

    for grader in (grading_spec.check_verify_greedy, grading_spec.check_rejection_sample,
                   grading_spec.check_ngram_propose):
        with pytest.raises(AssertionError, match="not implemented yet"):
            grader(stub)


def test_chi2_pvalue_matches_scipy():
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    counts = torch.bincount(torch.multinomial(probs, 500, replacement=True, generator=g), minlength=5)
    want = chisquare(counts[:4].tolist(), (probs[:4] * 500).tolist()).pvalue
    assert abs(grading_spec.chi2_pvalue(counts, probs) - want) < 1e-6  # probs in float32
    assert grading_spec.chi2_pvalue(torch.tensor([10, 0, 0, 0, 1]), probs) == 0.0  # an impossible outcome
    pooled = torch.tensor([0.5, 0.49, 0.005, 0.005])  # the two rare outcomes are pooled into one bin
    c = torch.tensor([52, 46, 1, 1])
    want = chisquare([52, 46, 2], [50, 49, 1.0]).pvalue
    assert abs(grading_spec.chi2_pvalue(c, pooled) - want) < 1e-6
