"""Graders for the chapter-04 exercises (speculative decoding), on the machinery of :mod:`minifer_course.grading.base`.

* :func:`check_verify_greedy` grades ``fn(draft_tokens, target_argmax)``, the batched greedy verification,
  against :func:`minifer.sample.rejection_sampler.verify_greedy`;
* :func:`check_rejection_sample` grades ``fn(draft_tokens, q, p, generator)``, rejection sampling for one
  sequence, two ways: token for token against minifer's on fixed seeds (the exercise fixes the order of
  the random draws), and by what makes the method worth having, **losslessness**: a chi-squared test that
  the emitted tokens follow the target distribution, with a hint naming the classic mistake whose
  distribution the draws fit instead. The report says pass or fail, never a p-value;
* :func:`check_ngram_propose` grades ``fn(token_ids, k, prompt_lookup_max, prompt_lookup_min)`` against
  :func:`minifer.spec_decode.ngram_proposer.ngram_propose`.

Each takes well under two seconds on a CPU; the tests (``tests/course/test_exercises_spec.py``) check that
minifer's own implementations pass and the classic mistakes fail.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from minifer_course.grading.base import Check, as_int_list, run_checks, seeded

__all__ = ["check_verify_greedy", "check_rejection_sample", "check_ngram_propose", "chi2_pvalue"]


def _as_rows(got: Any, rows: int, what: str) -> list[list[int]]:
    if isinstance(got, torch.Tensor) or not isinstance(got, (list, tuple)):
        raise AssertionError(f"{what}: expected a list with one list of tokens per row, got {type(got).__name__}")
    if len(got) != rows:
        raise AssertionError(f"{what}: {len(got)} rows returned for a batch of {rows}")
    return [as_int_list(r, f"{what} row {i}") for i, r in enumerate(got)]


# --- chapter 04: greedy verification -------------------------------------------------------------------


def check_verify_greedy(fn: Callable[[list[list[int]], torch.Tensor], list[list[int]]]) -> None:
    """Grade ``fn(draft_tokens, target_argmax) -> emitted tokens per row`` on hand-built batches (padding
    filled with tokens that must never be read) and random ragged ones, against
    :func:`minifer.sample.rejection_sampler.verify_greedy`."""
    from minifer.sample.rejection_sampler import verify_greedy as ref

    def case(drafts: list[list[int]], target: list[list[int]], hint: str) -> Check:
        def run() -> None:
            drafts_in, target_in = [list(d) for d in drafts], torch.tensor(target)
            got = _as_rows(fn(drafts_in, target_in), len(drafts), "verify_greedy")
            if drafts_in != drafts or not torch.equal(target_in, torch.tensor(target)):
                raise AssertionError("your function modified draft_tokens or target_argmax; build new lists")
            want = ref(drafts, torch.tensor(target))
            for i, (d, t, g, w) in enumerate(zip(drafts, target, got, want)):
                if g != w:
                    raise AssertionError(f"row {i}: drafts {d}, target_argmax row {t}\ngot      {g}\nexpected {w}"
                                         f"\nhint: {hint}")
        return run

    bonus = "when all k drafts agree, emit them and then the bonus token target_argmax[i, k]"
    rng = random.Random(0)
    randoms = []
    for _ in range(200):
        b, max_k, vocab = rng.randrange(1, 6), rng.randrange(0, 6), rng.choice([2, 3, 50])
        target = [[rng.randrange(vocab) for _ in range(max_k + 1)] for _ in range(b)]
        drafts = []
        for row in target:
            k = rng.randrange(0, max_k + 1)
            agree = rng.randrange(0, k + 1)  # mostly agreeing prefixes, as from a decent draft
            drafts.append(row[:agree] + [rng.randrange(vocab) for _ in range(k - agree)])
        randoms.append((drafts, target))

    def random_batches() -> None:
        for drafts, target in randoms:
            case(drafts, target, "keep drafts while they equal the target's argmax, stop at the first mismatch "
                                 "and emit the target's token there (or the bonus at column k_i)")()

    checks: list[Check] = [
        ("every draft agrees: the drafts, then the bonus token", case([[5, 6, 7]], [[5, 6, 7, 8]], bonus)),
        ("the first draft disagrees: only the target's token", case(
            [[5, 6, 7]], [[9, 6, 7, 8]], "at the first mismatch emit the target's token (not the draft's) and stop")),
        ("a mismatch in the middle: the agreeing prefix, then the target's token", case(
            [[5, 6, 7, 1]], [[5, 6, 2, 1, 3]], "emit the accepted prefix plus target_argmax[i, n] at the first "
                                               "mismatch n; everything the draft proposed after it is discarded")),
        ("drafts after the first mismatch are discarded even if they agree", case(
            [[4, 0, 2]], [[4, 1, 2, 3]], "stop at the first mismatch: the target's tokens after it were computed "
                                         "for a context that contained the wrong draft token")),
        ("k = 0: the target's next token", case([[]], [[3]], "with no draft, emit target_argmax[i, 0]")),
        ("a ragged batch: each row's bonus sits at its own k, padding is never read", case(
            [[1, 2, 3], [1], [], [4, 4]], [[1, 2, 3, 9], [1, 8, 99, 99], [7, 99, 99, 99], [4, 4, 6, 99]],
            "row i proposed len(draft_tokens[i]) tokens: its bonus is target_argmax[i, k_i], columns after it are "
            "padding (99 here)")),
        ("200 random ragged batches, compared with minifer's verify_greedy", random_batches),
    ]
    run_checks("verify_greedy", checks)


# --- chapter 04: rejection sampling --------------------------------------------------------------------


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-squared p-value of ``counts`` (per outcome) under ``probs``, without scipy (the course
    extras do not install it): outcomes expected fewer than 5 times are pooled, and the survival function of
    the chi-squared distribution with ``d`` degrees of freedom is the regularised upper incomplete gamma
    function ``Q(d/2, x/2)``. Returns 0.0 if an outcome of probability 0 was observed."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    probs = probs / probs.sum()
    if bool((counts[probs == 0] > 0).any()):
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    small = ~big & (probs > 0)
    if bool(small.any()):
        obs, exp = torch.cat([obs, counts[small].sum()[None]]), torch.cat([exp, expected[small].sum()[None]])
    if obs.numel() < 2:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64), stat / 2))


def _rejection_sample_with_minifer(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor,
                                   generator: torch.Generator) -> list[int]:
    """minifer's batched :func:`~minifer.sample.rejection_sampler.rejection_sample` for one sequence (the exercise's
    signature)."""
    from minifer.sample.rejection_sampler import rejection_sample

    return rejection_sample([list(draft_tokens)], q[None], p[None], [generator])[0]


def _mistake_distributions(p: torch.Tensor, q: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
    """What the first emitted token follows under the classic mistakes, for one drafted position."""
    both = torch.minimum(p, q)  # accepted mass of each token
    residual = (p - q).clamp(min=0)
    return [
        (q, "your tokens follow the draft's q: every draft token is accepted, or the residual is max(q - p, 0) "
            "instead of max(p - q, 0)"),
        (both + (1 - both.sum()) * p, "after a rejection you drew from p; draw from the residual max(p - q, 0) "
                                      "(normalised): p already had its chance through the acceptance"),
        (q * p + (1 - (q * p).sum()) * residual / residual.sum(),
         "you accept with probability p(x); the rule is min(1, p(x) / q(x)): u < p(x) / q(x)"),
    ]


def check_rejection_sample(fn: Callable[[list[int], torch.Tensor, torch.Tensor, torch.Generator], list[int]]) -> None:
    """Grade ``fn(draft_tokens, q, p, generator) -> emitted tokens`` for one sequence: ``k`` draft tokens,
    ``q`` ``[k, V]`` the draft's distributions, ``p`` ``[k + 1, V]`` the target's. Deterministic cases,
    agreement with minifer on fixed seeds, and chi-squared tests of losslessness."""
    draw_order = ("draw u = torch.rand(k, generator=generator) once, before the loop (all k, even if an early "
                  "draft is rejected); accept draft j iff u[j] < p[j, x] / q[j, x]; then call "
                  "torch.multinomial(dist, 1, generator=generator) exactly once, on float32 probabilities: "
                  "(p[j] - q[j]).clamp(min=0) at the first rejection j, or p[k] after k acceptances")

    def call(draft: list[int], q: torch.Tensor, p: torch.Tensor, seed: int, copies: bool = True) -> list[int]:
        """``fn``'s answer, checked for shape; ``copies``: on copies of the inputs, checked to be unmodified."""
        draft_in, q_in, p_in = (list(draft), q.clone(), p.clone()) if copies else (draft, q, p)
        try:
            got = as_int_list(fn(draft_in, q_in, p_in, seeded(seed)), "rejection_sample")
        except RuntimeError as exc:
            if "multinomial" not in str(exc) and "probability tensor" not in str(exc):
                raise
            raise AssertionError(f"your function raised RuntimeError: {exc}\nhint: torch.multinomial needs weights "
                                 f">= 0 with a positive sum: clamp p - q at 0, and draw from p if nothing is left")
        if copies and (draft_in != draft or not (torch.equal(q_in, q) and torch.equal(p_in, p))):
            raise AssertionError("your function modified draft_tokens, q or p; compute new tensors instead")
        k = len(draft)
        if not 1 <= len(got) <= k + 1:
            raise AssertionError(f"{len(got)} tokens emitted for k = {k} drafts; expected between 1 and k + 1 = {k + 1}"
                                 f"\nhint: the accepted drafts, then exactly one token (residual or bonus)")
        if got[:-1] != draft[: len(got) - 1]:
            raise AssertionError(f"drafts {draft}: got {got}, whose first {len(got) - 1} tokens are not the drafts'"
                                 f"\nhint: every token before the last must be an accepted draft token")
        return got

    def exact(draft: list[int], q: torch.Tensor, p: torch.Tensor, want_fixed: list[int] | None, hint: str) -> Check:
        """Five seeds; ``want_fixed=None``: what minifer emits on each seed."""
        def run() -> None:
            for seed in range(5):
                got = call(draft, q, p, seed)
                want = want_fixed if want_fixed is not None else _rejection_sample_with_minifer(draft, q, p, seeded(seed))
                if got != want:
                    raise AssertionError(f"drafts {draft}: got {got}, expected {want}\nhint: {hint}")
        return run

    def one_hot(*tokens: int, vocab: int = 6) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()

    gen = seeded(40)
    flat = torch.full((3, 6), 1 / 6)

    def agrees_with_minifer() -> None:
        for seed in range(40):
            vocab, k = 10, seed % 5
            p = (torch.randn(k + 1, vocab, generator=gen) * 1.5).softmax(-1)
            q = (torch.randn(k, vocab, generator=gen) * 1.5).softmax(-1)
            if seed % 3 == 0:  # a truncated target (as after top-k), which the draft does not know about
                p[:, torch.randperm(vocab, generator=gen)[:4]] = 0
                p = p / p.sum(-1, keepdim=True)
            draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
            want = _rejection_sample_with_minifer(draft, q, p, seeded(seed))
            got = call(draft, q, p, seed)
            if got != want:
                raise AssertionError(f"seed {seed}, k = {k}, drafts {draft}: got {got}, minifer emits {want}\n"
                                     f"hint: {draw_order}")

    # Losslessness: many sequences from one context, each with its own generator; p1 and q1 (position 1)
    # depend on the token at position 0, as a model's would.
    vocab, n = 5, 3000
    g = seeded(41)
    p0, q0 = (torch.randn(vocab, generator=g) * 1.5).softmax(-1), (torch.randn(vocab, generator=g) * 4).softmax(-1)
    p1, q1 = (torch.randn(vocab, vocab, generator=g) * 1.5).softmax(-1), (torch.randn(vocab, vocab, generator=g) * 3).softmax(-1)
    p2 = (torch.randn(vocab, generator=g)).softmax(-1)
    xs0 = torch.multinomial(q0.expand(n, vocab), 1, generator=g)[:, 0].tolist()
    xs1 = [int(torch.multinomial(q1[x], 1, generator=g)) for x in xs0]

    def first_two(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts of the first emitted token, and of the first two (a sequence that emitted one token takes a
        plain step, k = 0, for its second)."""
        first, pairs = torch.zeros(vocab), torch.zeros(vocab * vocab)
        ps = [torch.stack([p0, p1[x], p2])[: k + 1] for x in range(vocab)]  # by the token at position 0
        qs = [torch.stack([q0, q1[x]])[:k] for x in range(vocab)]
        nexts, no_draft = [p1[x][None] for x in range(vocab)], q0[None][:0]
        for i, (x0, x1) in enumerate(zip(xs0, xs1)):
            got = call([x0, x1][:k], qs[x0], ps[x0], 1000 + i, copies=False)
            if len(got) == 1:
                got = got + call([], no_draft, nexts[got[0]], 100_000 + i, copies=False)
            first[got[0]] += 1
            pairs[got[0] * vocab + got[1]] += 1
        return first, pairs

    def lossless(k: int, what: str) -> Check:
        def run() -> None:
            first, pairs = first_two(k)
            if chi2_pvalue(first, p0) < 1e-3:
                fits = [why for dist, why in _mistake_distributions(p0, q0) if chi2_pvalue(first, dist) > 1e-3]
                raise AssertionError(f"over {n} sequences the first emitted token is not distributed as the target's "
                                     f"p[0], so the output would change with the draft\nhint: "
                                     f"{fits[0] if fits else 'accept with probability min(1, p(x) / q(x)); on rejection draw from max(p - q, 0)'}")
            if chi2_pvalue(pairs, (p0[:, None] * p1).flatten()) < 1e-3:
                raise AssertionError(f"over {n} sequences the first two emitted tokens are not distributed as "
                                     f"p0(y0) * p1(y1 | y0)\nhint: {what}")
        return run

    checks: list[Check] = [
        ("the target agrees with every draft: all accepted, then the bonus from p[k]",
         exact([2, 4], flat[:2], one_hot(2, 4, 1), [2, 4, 1],
               "p(x) = 1 makes p(x) / q(x) >= 1: always accept; after k acceptances draw the bonus from p[k]")),
        ("the target excludes the first draft: rejected, the token comes from the residual",
         exact([2, 4], flat[:2], one_hot(3, 4, 1), [3],
               "p(x) = 0 must always reject (u < 0 is never true); the residual max(p - q, 0) is all on token 3")),
        ("k = 0: one token from p[0]", exact([], flat[:0], one_hot(5), [5], "with no drafts, draw from p[0]")),
        ("lossless, k = 2: the first two tokens follow the target (chi-squared)",
         lossless(2, "at the second position use p[1] and q[1]; stop after the first rejection")),
        ("lossless, k = 1: the bonus token follows p[1] (chi-squared)",
         lossless(1, "after k acceptances the bonus comes from p[k], the target's distribution after all drafts")),
        ("q(x) = 0 for a draft token: counted as a rejection, no division by zero",
         exact([0], one_hot(1), one_hot(0, 2), [0],
               "if q[j, x] == 0, reject (the notebook's rule); then max(p - q, 0) is p, here all on token 0")),
        ("the residual has no mass (p <= q everywhere): fall back to p",
         exact([1], torch.tensor([[0.0, 1.0, 0.0, 0.0]]), torch.tensor([[0.0, 0.25, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]),
               None, "p[0, 1] / q[0, 1] = 0.25 rejects most seeds, and then max(p - q, 0) is all zero: draw from "
                     "p[0] instead")),
        ("40 random cases, token for token the same as minifer on the same seeds", agrees_with_minifer),
    ]
    run_checks("rejection_sample", checks)


# --- chapter 04: n-gram proposals ----------------------------------------------------------------------


def check_ngram_propose(fn: Callable[[list[int], int, int, int], list[int]]) -> None:
    """Grade ``fn(token_ids, k, prompt_lookup_max, prompt_lookup_min) -> proposed tokens`` against
    :func:`minifer.spec_decode.ngram_proposer.ngram_propose` on hand-built sequences and random ones."""
    from minifer.spec_decode.ngram_proposer import ngram_propose as ref

    def case(tokens: list[int], k: int, hi: int, lo: int, hint: str) -> Check:
        def run() -> None:
            tokens_in = list(tokens)
            got = as_int_list(fn(tokens_in, k, hi, lo), "ngram_propose")
            if tokens_in != tokens:
                raise AssertionError("your function modified token_ids; work on a copy")
            want = ref(tokens, k, hi, lo)
            if got != want:
                shown = tokens if len(tokens) <= 30 else f"[... {len(tokens)} tokens, ending {tokens[-8:]}]"
                without_min = [] if hi == lo else ref(tokens, k, hi, lo + 1)  # what skipping n = min gives
                if got == without_min:
                    why = (f"only n = prompt_lookup_min = {lo} matches here, and you never tried it: n runs from "
                           f"prompt_lookup_max down to prompt_lookup_min, both included, "
                           f"range(prompt_lookup_max, prompt_lookup_min - 1, -1)")
                else:
                    why = hint + ("; an earlier occurrence exists: did your search count the pattern's own place at "
                                  "the end (occurrences must start before len(token_ids) - n)?" if want and not got
                                  else "")
                raise AssertionError(f"token_ids {shown}, k={k}, prompt_lookup_max={hi}, prompt_lookup_min={lo}\n"
                                     f"got      {got}\nexpected {want}\nhint: {why}")
        return run

    rng = random.Random(0)
    randoms = [([rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(0, 40))], rng.randrange(1, 6),
                rng.randrange(0, 3), rng.randrange(1, 4)) for _ in range(300)]

    def random_sequences() -> None:
        for tokens, k, extra, lo in randoms:
            case(tokens, k, lo + extra, lo, "n from prompt_lookup_max down to prompt_lookup_min; the most recent "
                                            "earlier occurrence; the tokens after it, at most k")()

    checks: list[Check] = [
        ("a repeated phrase: propose what followed it", case(
            [1, 2, 3, 4, 1, 5, 6, 1, 2], 3, 3, 1, "the last 2 tokens (1, 2) occurred at the start, followed by 3 4 1")),
        ("no earlier occurrence: propose nothing", case([1, 2, 3, 4], 3, 3, 1, "return [] when no n matches")),
        ("the pattern's own place at the end does not count", case(
            [1, 2, 9, 1, 2], 2, 2, 1, "search only occurrences that start before len(token_ids) - n")),
        ("the longest n wins", case(
            [8, 2, 9, 40, 41, 5, 2, 9, 50, 8, 2, 9], 2, 3, 1,
            "try n = prompt_lookup_max first: '8 2 9' matched at the start beats the more recent '2 9'")),
        ("only the shortest n matches: n = prompt_lookup_min is tried too", case(
            [1, 2, 3, 4, 2], 2, 3, 1, "no 3- or 2-token match; the last token alone (n = 1) occurred at index 1")),
        ("the most recent occurrence wins", case(
            [3, 7, 10, 3, 7, 20, 3, 7], 1, 2, 2, "search backwards from the end: the nearest context is the best guess")),
        ("matches shorter than prompt_lookup_min are ignored", case(
            [5, 1, 2, 6, 2], 2, 3, 2, "only n >= prompt_lookup_min count; a lone '2' is too weak a context")),
        ("the proposal stops at the end of the sequence", case(
            [4, 4, 4, 4], 5, 2, 1, "take token_ids[end : end + k]: fewer than k tokens when the sequence ends; the "
                                   "occurrence may overlap the pattern")),
        ("empty and one-token sequences", lambda: (case([], 3, 2, 1, "nothing to match: return []")(),
                                                   case([7], 3, 2, 1, "nothing to match: return []")())),
        ("300 random sequences, compared with minifer's ngram_propose", random_sequences),
    ]
    run_checks("ngram_propose", checks)
