"""Adaptive k for n-gram drafts: look first, then decide.

N-gram lookup costs almost nothing, so with ``"ngram"`` the engine looks first and decides after: it knows which
sequences have a draft and how long a match found it (a 4-token match is accepted far more often than a 1-token
one; acceptance is measured per match length), and verifies only the drafts predicted to pay (``plan_drafts``).
At large batches it skips even the lookups when recent match statistics say they cannot pay, and holds that
decision for ``PLAIN_HOLD`` steps like a clear plain one. With no request waiting for a slot it speculates only in
steps where every decoding sequence has a draft: a sequence that speeds ahead alone frees a slot nobody takes, and
the batch still ends with its slowest sequence.
"""

from __future__ import annotations

from collections import Counter

from minifer.features.adaptive_k import HELD, PLAIN_HOLD, AdaptiveK, Decision, DecodeBatch
from minifer.engine.proposers import Draft
from minifer.spec.theory import expected_tokens_per_forward


class NgramAdaptiveK(AdaptiveK):
    """``AdaptiveK`` whose decision reads the lookups: ``decide`` is given the batch's ``lookup`` and names the
    drafts to verify."""

    def decide(self, batch: DecodeBatch, waiting: int = 1) -> Decision:
        """The drafts to verify, found before deciding (``choose_ngram``); a plain step if lookups cannot pay or a
        plain decision is held."""
        if self.held(len(batch.rows)):
            return HELD
        choice = self.choose_ngram(batch, waiting)
        if choice is None:  # a plain step without even the lookups
            return Decision(0)
        chosen, k, probe = choice
        return Decision(k, probe, drafts=chosen)

    def plan_drafts(self, num_decodes: int, candidates: list[tuple[float, int]],
                    require_all: bool = False) -> tuple[int, int, float]:
        """Which drafts to verify this step. ``candidates``: (acceptance, draft length) of the sequences that
        have a draft, best acceptance first. Verifying the first ``m`` of them, each cut to ``k`` tokens, is
        predicted to emit ``B + sum(E(alpha_i, k_i) - 1)`` tokens in ``step_time(B + sum(k_i))`` seconds.
        Returns ``(m, k, predicted rate / plain rate)``; ``m = 0`` when nothing beats plain decoding.
        ``require_all``: only a plan that gives every decoding sequence a draft counts (see ``choose_ngram``)."""
        b = num_decodes
        base = b / self.step_time(b, False)
        best = (0, 0, 1.0)
        sizes = sorted({min(2 ** j, len(candidates)) for j in range(len(candidates).bit_length() + 1)})
        if require_all:
            sizes = [b] if len(candidates) == b else []
        if not sizes:
            return best
        for k in range(1, self.cfg.num_speculative_tokens + 1):
            gain = tokens = 0.0
            prefix = []  # (gain, tokens) after each candidate
            for alpha, length in candidates:
                kk = min(k, length)
                gain += expected_tokens_per_forward(min(alpha, 0.999), kk) - 1
                tokens += kk
                prefix.append((gain, tokens))
            for m in sizes:
                if m:
                    g, n = prefix[m - 1]
                    ratio = (b + g) / self.step_time(round(b + n), True) / base
                    if ratio > best[2]:
                        best = (m, k, ratio)
        return best

    def ngram_may_pay(self, num_decodes: int, require_all: bool = False, margin: float | None = None) -> bool:
        """Before the lookups: would the step pay if its sequences matched as often, and as long, as recent
        lookups did (``match_seen``: lookups by the match length they found, 0 for none)? Verifying only the
        sequences of the best match lengths is allowed. Asked only at 8 or more sequences: below that the
        lookups cost nothing worth saving. ``require_all`` (nothing waiting: a step speculates only if every sequence has a draft): if all ``b``
        sequences find a match less than one step in ten (``hit ** b < 0.1``, ``hit`` the recent share of
        lookups that found one), the lookups are not worth their cost."""
        seen, b = self.match_seen, num_decodes
        margin = self.cfg.margin if margin is None else margin
        total = seen.total()
        if b < 8 or total < 64:
            return True
        if require_all and (1 - seen[0] / total) ** b < 0.1:
            return False
        classes = sorted(((self.alpha_for_match(n), c / total) for n, c in seen.items() if n), reverse=True)
        base = b / self.step_time(b, False)
        for k in range(1, self.cfg.num_speculative_tokens + 1):
            gain = tokens = 0.0
            for alpha, share in classes:
                gain += b * share * (expected_tokens_per_forward(min(alpha, 0.999), k) - 1)
                tokens += b * share * k
                if (b + gain) / self.step_time(round(b + tokens), True) > base * margin:
                    return True
        return False

    def choose_ngram(self, batch: DecodeBatch, waiting: int = 1) -> tuple[dict[int, Draft], int, bool] | None:
        """Prompt lookup is nearly free, so look up every decoding sequence first and decide knowing which ones
        have a draft and how long a match found it (``alpha_for_match``). Returns the drafts to verify by row,
        the k cap, and whether this is a probe (one draft verified to keep the estimates current); None when
        the lookups were not worth making at all (``ngram_may_pay``). With no request ``waiting``, a step
        speculates only when every decoding sequence has a draft (see the module docstring)."""
        if not self.calibrated:
            self.calibrate()
        k_max = self.cfg.num_speculative_tokens
        b = len(batch.rows)
        margin = self.cfg.margin
        may_pay = self.ngram_may_pay(b, not waiting, margin)
        if not may_pay or not self.measured_allows(b):
            # not worth even the lookups; now and then a probe: every sequence looked up (the match
            # statistics stay current) and one draft verified (so does its acceptance)
            self.plain_choices += 1
            if not self.probe_due():
                if not may_pay:  # what decided it changes only with lookups, verifications and timings: hold it
                    self.plain_hold[b] = PLAIN_HOLD
                return None  # not even looked up
            self.last_probe = self.plain_choices
            found = self.lookup_all(batch)
            return ({found[0][1]: (found[0][2], found[0][3])}, k_max, True) if found else ({}, 0, False)
        found = self.lookup_all(batch)
        m, k, ratio = self.plan_drafts(b, [(a, len(t)) for a, _, t, _ in found], require_all=not waiting)
        probe = False
        if not (m and ratio > margin):
            m = 0
            self.plain_choices += 1
            if found and self.probe_due():
                self.last_probe = self.plain_choices
                m, k, probe = 1, k_max, True
        return {i: (tokens[:k], n) for _, i, tokens, n in found[:m]}, k if m else 0, probe

    def lookup_all(self, batch: DecodeBatch) -> list[tuple[float, int, list[int], int]]:
        """(acceptance, row, draft, match length) of every decoding sequence with a match, best first."""
        found = []
        for i in batch.rows:
            seq = batch.seqs[i]
            room = min(self.cfg.num_speculative_tokens, seq.max_tokens - len(seq.output_token_ids) - 1)
            if room > 0:
                tokens, n = batch.lookup(seq, room)
                self.match_seen[n] += 1
                if tokens:
                    found.append((self.alpha_for_match(n), i, tokens, n))
        found.sort(key=lambda c: -c[0])
        if self.match_seen.total() > 4096:  # a sliding memory: halve the counts
            self.match_seen = Counter({n: c // 2 for n, c in self.match_seen.items()})
        return found
