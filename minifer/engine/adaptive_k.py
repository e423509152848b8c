"""Adaptive k, an opt-in policy (``speculative_config["adaptive"] = True``): how many tokens to speculate this step,
decided from measured costs.

Fixed k (``engine/speculative.py``) is the reference and runs none of this. Asked for, ``AdaptiveSpeculator``
replaces the fixed-k ``Speculator``: everything adaptive k needs (the cost tables, the clocks around the forwards
and the step, each step's ``StepRecord``, the controller) is created here and only then.

Speculation pays only while the wider verify forward is nearly free, i.e. at low concurrency. For ``B`` decoding
sequences the controller picks the ``k`` in ``0..num_speculative_tokens`` that maximises the predicted tokens per
second

    B * (1 + h * (E(alpha, k) - 1)) / (T(B * (1 + h * k)) + t_draft(B, k)),   E = (1 - alpha^(k+1)) / (1 - alpha)

with ``h`` the measured share of sequences that get drafts, ``alpha`` the recent per-token acceptance and ``T(n)``
a whole step's predicted time when its forward covers ``n`` tokens (``step_time``). ``k = 0`` wins unless
speculation beats it by ``cfg.margin`` (10%: timings are noisy, the plain reference steps cost something, and a
batch ends with its slowest sequence), so under load speculation turns itself off. A clear plain decision is reused
for a few steps (``PLAIN_HOLD``), and most of those run as the plain engine's step itself (``plain_step``), so plain
decoding costs what it does in a plain engine.

The model can be wrong, so measurement has the last word: per batch-size bucket, speculative steps' measured
speedup over plain ones must clear the margin in a trial of ``TRIAL_STEPS`` steps, or speculation stops there until
a retry (``measured_allows``). When plain decoding wins by little, one sequence now and then speculates anyway (a
*probe*, ``probe_due``), so a stale estimate cannot switch speculation off for good. N-gram drafts are looked up
before deciding: ``adaptive_ngram.py``.

Under adaptive k a seeded *sampled* request is distributed exactly as without speculation, but its exact tokens
depend on the k chosen each step, which depends on timings: for bit-reproducible seeded sampling keep fixed k.

N-gram drafts (``NgramAdaptiveK``): look first, then decide.

N-gram lookup costs almost nothing, so with ``"ngram"`` the engine looks first and decides after: it knows which
sequences have a draft and how long a match found it (a 4-token match is accepted far more often than a 1-token
one; acceptance is measured per match length), and verifies only the drafts predicted to pay (``plan_drafts``).
At large batches it skips even the lookups when recent match statistics say they cannot pay, and holds that
decision for ``PLAIN_HOLD`` steps like a clear plain one. With no request waiting for a slot it speculates only in
steps where every decoding sequence has a draft: a sequence that speeds ahead alone frees a slot nobody takes, and
the batch still ends with its slowest sequence.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from minifer.core.kv_cache_manager import cdiv, scratch_sequence
from minifer.engine.core import StepParts, engine_step
from minifer.engine.spec_step import speculative_step
from minifer.engine.speculative import Proposal, Speculator, decoding_rows
from minifer.request import Request
from minifer.spec_decode.metadata import Draft
from minifer.spec_decode.ngram_proposer import NgramProposer
from minifer.spec_decode.theory import expected_tokens_per_forward
from minifer.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from minifer.core.kv_cache_manager import KVBlockAllocator
    from minifer.engine.speculative import SpeculativeConfig
    from minifer.sample.rejection_sampler import Verifier
    from minifer.sample.sampler import Sampler
    from minifer.spec_decode.metadata import DraftProposer

TRIAL_STEPS = 8  # speculative steps measured at a batch size before measurement may overrule the model
PROBE_BUDGET = 0.002  # probes may cost at most this fraction of the decode time (see AdaptiveK.probe_due)
PROBE_DECAY = 0.999  # per pure-decode step: the budget covers roughly the last thousand steps, not all history
ALPHA_DECAY = 0.995  # per verified sequence: the acceptance estimate follows roughly the last 200 verifications
PLAIN_HOLD = 15  # steps that reuse a clear "plain" decision at the same batch size (see AdaptiveK.held)
LIGHT_EVERY = 8  # of the held plain steps, every LIGHT_EVERY-th is timed into the tables (see AdaptiveK.observe)


# --- what the controller sees and decides --------------------------------------------------------------------


@dataclass
class DecodeBatch:
    """The decoding rows of a step, as the controller sees them."""

    seqs: list[Request]
    rows: list[int]  # indices into seqs of the sequences that decode this step (one new token, no history reads)
    lag: float = 1.0  # tokens per sequence a draft model has not read yet
    lookup: Callable[[Request, int], tuple[list[int], int]] | None = None  # n-gram: (draft, match length) of a row


@dataclass
class Decision:
    """What a step does: ``k`` drafts per decoding sequence (0: plain decoding). A ``probe`` is plain decoding in
    which one sequence speculates to keep the estimates current. ``drafts``: for n-gram speculation, the drafts to
    verify (by row: tokens and the length of the match that found them), looked up before deciding."""

    k: int
    probe: bool = False
    drafts: dict[int, tuple[list[int], int]] | None = None
    held: bool = False  # a held plain decision (``PLAIN_HOLD``): its step is timed only now and then (``LIGHT_EVERY``)


HELD = Decision(0, held=True)  # the decision of every held plain step (shared: nothing writes to a Decision)


@dataclass
class StepRecord:
    """One step as the controller observes it: what was decided and proposed, each verified sequence's acceptance,
    the target forward's tokens and time, and the whole step's tokens and time."""

    decodes: int = 0  # decoding sequences (0: a step of prompt chunks only: nothing to learn from its time)
    k: int = 0  # drafts per sequence; a probe counts 0
    probe: bool = False
    held: bool = False  # the step reused a held plain decision (see AdaptiveK.observe)
    propose_s: float = 0.0  # seconds spent finding drafts (left out of a plain step's time)
    draft_s: float | None = None  # seconds the drafts took to make, when some were made
    expected: float | None = None  # a speculative step's tokens at the estimated acceptance (see observe)
    asked: int = 0  # sequences asked for drafts (not in probes), and those that got at least one
    got: int = 0
    acceptances: list[tuple[int, bool, int]] = field(default_factory=list)  # (accepted, rejected, match length)
    forward_tokens: int = 0
    forward_s: float = 0.0
    pure_decode: bool = False
    emitted: int = 0
    seconds: float = 0.0

    @property
    def speculated(self) -> bool:
        return self.k > 0


class KController(Protocol):
    """What ``AdaptiveSpeculator`` asks of a controller (``AdaptiveK`` is the reference).

    Before scheduling, ``plain_step(n)``: may the next step, of ``n`` running sequences and none waiting, run as the
    plain engine's step itself, nothing proposed or recorded (its time then goes to ``observe_plain``)? Once
    scheduled, ``decide``: the step's ``Decision`` for its decoding rows, ``waiting`` requests queued;
    ``expected_emitted``: a speculative step's tokens at the estimated acceptance. After the step, ``observe``: its
    ``StepRecord``."""

    def plain_step(self, num_running: int) -> bool: ...
    def observe_plain(self, seconds: float) -> None: ...
    def decide(self, batch: DecodeBatch, waiting: int = 1) -> Decision: ...
    def expected_emitted(self, b: int, drafts: list[Draft]) -> float: ...
    def observe(self, r: StepRecord) -> None: ...


# --- measuring forwards --------------------------------------------------------------------------------------


class CostTable:
    """Measured seconds of a forward over ``n`` tokens.

    Per ``n`` it keeps the last few measurements and uses their median: on a shared machine single
    timings spike when a neighbour runs, and one spike must not switch speculation off. Across ``n`` the
    table is made non-decreasing (more tokens never cost less: a point above a larger ``n``'s is lowered),
    interpolated linearly in between, and extended linearly past the largest ``n`` measured (a compute-bound
    forward). Each ``n``'s median is updated when it is measured, so a step's refresh costs one median."""

    def __init__(self, window: int = 9) -> None:
        self.samples: dict[int, deque[float]] = {}
        self.window = window
        self._medians: dict[int, float] = {}  # per n, kept current by observe (a step changes only its own n)
        self._curve: tuple[list[int], list[float]] | None = None

    def observe(self, n: int, seconds: float) -> None:
        window = self.samples.setdefault(n, deque(maxlen=self.window))
        window.append(seconds)
        self._medians[n] = statistics.median(window)
        self._curve = None

    def curve(self) -> tuple[list[int], list[float]]:
        if self._curve is None:  # recomputed only after a new measurement (choose_k reads it many times)
            if self._medians.keys() != self.samples.keys():  # samples edited directly (tests, notebooks)
                self._medians = {n: statistics.median(w) for n, w in self.samples.items() if w}
            xs = sorted(self._medians)
            ys = [self._medians[x] for x in xs]
            for i in range(len(ys) - 2, -1, -1):  # non-decreasing from below: interference only ever adds time
                ys[i] = min(ys[i], ys[i + 1])
            self._curve = xs, ys
        return self._curve

    def __call__(self, n: int) -> float:
        xs, ys = self.curve()
        if not xs:
            return float(n)
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            return ys[-1] * n / xs[-1]
        j = bisect.bisect_left(xs, n)
        return ys[j - 1] + (ys[j] - ys[j - 1]) * (n - xs[j - 1]) / (xs[j] - xs[j - 1])


class ForwardTimer:
    """Times every forward of ``runner`` in place (its ``forward`` is replaced by this timer): ``last_s``, the
    latest forward's seconds (on CUDA after a synchronize, or the clock would stop before the kernels do), and, with
    a ``table``, each forward's time by its token count. The engine's runner keeps no clock: only what measures
    wears one."""

    def __init__(self, runner, table: CostTable | None = None) -> None:
        self.runner, self.table, self.inner, self.last_s = runner, table, runner.forward, 0.0
        runner.forward = self

    def __call__(self, request_ids: list[object], starts: list[int], tokens: list[list[int]],
                 num_logits: list[int]) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.inner(request_ids, starts, tokens, num_logits)
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)
        self.last_s = time.perf_counter() - t0
        if self.table is not None:
            self.table.observe(sum(len(c) for c in tokens), self.last_s)
        return logits

    def remove(self) -> None:
        """Give the runner its own forward back."""
        if self.runner.forward is self:
            self.runner.forward = self.inner


def timed_forward(runner, request_ids: list[object], starts: list[int], tokens: list[list[int]]) -> float:
    """Seconds of one forward of ``runner`` (CUDA synchronized), not recorded anywhere."""
    forward = runner.forward.inner if isinstance(runner.forward, ForwardTimer) else runner.forward
    t0 = time.perf_counter()
    logits = forward(request_ids, starts, tokens, [1] * len(request_ids))
    if logits.device.type == "cuda":
        torch.cuda.synchronize(logits.device)
    return time.perf_counter() - t0


def calibrate_decode(runner, table: CostTable, max_tokens: int = 128, context: int = 64) -> None:
    """Fill ``table`` with ``runner``'s forwards shaped like decode steps, once, at start-up while every block is free:
    1, 2, 4, ... scratch sequences with ``context`` cached tokens bring one new token each. Decode-shaped because
    a forward's time depends on how many sequences' caches it reads, not only on its token count (a table timed
    on one long prompt chunk underrates decode steps). Verify steps, with fewer sequences and more tokens each,
    differ too: for them the table is a first guess that their own steps refresh. The cached values stay zeros:
    the time depends on the sizes read, not the numbers."""
    blocks, n = runner.blocks, 1
    # a small cache holds a shorter context (down to one token): the timing still has one sequence
    ctx = min(context, blocks.block_size * blocks.num_free_blocks - 1)
    if ctx < 1:
        return  # not even two tokens fit: the table keeps its prior, refreshed by real steps
    while 2 * n <= max_tokens and 2 * n * cdiv(ctx + 1, blocks.block_size) <= blocks.num_free_blocks:
        n *= 2
    ids = [f"__calibrate{i}__" for i in range(n)]
    with ExitStack() as stack:
        for i, rid in enumerate(ids):  # distinct tokens: no prefix-cache sharing between them
            stack.enter_context(scratch_sequence(blocks, rid, [i + 1] * (ctx + 1)))
        m = 1
        while m <= n:
            timed_forward(runner, ids[:m], [ctx] * m, [[0]] * m)  # warm-up
            for _ in range(3):
                table.observe(m, timed_forward(runner, ids[:m], [ctx] * m, [[0]] * m))
            m *= 2


# --- the controller ------------------------------------------------------------------------------------------


class AdaptiveK:
    """The adaptive-k controller: cost tables, acceptance estimates, held decisions, probes and measured trials."""

    def __init__(self, cfg: SpeculativeConfig, target_runner: ModelRunner, draft_runner: ModelRunner | None = None,
                 draft_cost: CostTable | None = None) -> None:
        self.cfg, self.target_runner, self.draft_runner = cfg, target_runner, draft_runner
        self.target_cost = CostTable()
        self.draft_cost = draft_cost if draft_cost is not None else CostTable()
        self.probe_every = 32  # see choose_k
        self.plain_choices = self.last_probe = 0  # plain choices so far, and at the last probe
        # decode-step seconds so far, and what probes added to them (the budget of probe_due)
        self.decode_s = self.probe_extra_s = 0.0
        self._observed = 0  # pure-decode steps observed (the step-factor medians refresh every 8th)
        self.plain_hold: dict[int, int] = {}  # per batch size: steps left that reuse a clear plain decision
        self._held_steps = 0  # held plain steps observed (every LIGHT_EVERY-th is timed)
        # the measurement that has the last word on k: per batch-size bucket, each recent speculative step's
        # tokens per second over plain decoding's at its batch size (plain_step_s: whole plain steps by size)
        self.realized: dict[int, deque[float]] = {}
        self.plain_step_s: dict[int, float] = {}
        self._plain_window: dict[int, deque[float]] = {}  # the recent plain step times behind plain_step_s
        self.spec_choices = 0
        self._overruled: Counter[int] = Counter()  # per bucket: steps the measurement overruled in a row
        self._retry_after: dict[int, int] = {}  # per bucket: overruled steps before speculating anyway
        self._asked = self._got = 0  # sequences asked for drafts, and those that got at least one
        self.alpha_prior, self.alpha_weight = 0.6, 8.0  # a prior worth 8 tested tokens until data arrives
        self._recent_alpha = (0.0, 0.0)  # accepted and tested draft tokens, decayed (see alpha_estimate)
        self.calibrated = False
        self.last_draft_s = 0.0
        # whole step / target forward, for plain and for speculative steps (see step_time): recent ratios, and
        # their median, refreshed once per step (the predictions read it many times per step)
        self.step_factor: dict[bool, deque[float]] = {False: deque(maxlen=32), True: deque(maxlen=32)}
        self._factor = {False: 1.0, True: 1.0}
        self.match_seen: Counter[int] = Counter()  # n-gram lookups by the match length they found (0: none)
        # n-gram drafts by the length of the match that found them: accepted tokens and rejections
        self.match_accepted: Counter[int] = Counter()
        self.match_rejections: Counter[int] = Counter()

    # --- the interface -------------------------------------------------------------------------------

    def decide(self, batch: DecodeBatch, waiting: int = 1) -> Decision:
        """This step's decision for ``batch``; ``waiting``: requests queued for a slot (the n-gram controller reads
        it): a held plain decision (``PLAIN_HOLD``), else ``choose_k``'s one k for every decoding sequence
        (``adaptive_ngram.py`` looks up drafts first)."""
        if self.held(len(batch.rows)):  # a held plain decision at this batch size: nothing to predict
            return HELD
        k, probe = self.choose_k(len(batch.rows), batch.lag)
        return Decision(k, probe)

    def held_step(self, num_decodes: int) -> Decision | None:
        """A held plain decision at this batch size (``PLAIN_HOLD``), used up by one step; None if there is none."""
        return HELD if self.held(num_decodes) else None

    def plain_step(self, num_running: int) -> bool:
        """May the next step, of ``num_running`` sequences and none waiting, run as the plain engine's step itself?
        Yes while a plain decision is held at that batch size, except every ``LIGHT_EVERY``-th held step, which runs
        through ``propose`` to be measured in full (``observe``). Uses up one held step when it says yes."""
        if not self.plain_hold.get(num_running) or (self._held_steps + 1) % LIGHT_EVERY == 0:
            return False
        self.held(num_running)
        self._held_steps += 1
        return True

    def observe_plain(self, seconds: float) -> None:
        """A step that ran as the plain engine's (``plain_step``) took ``seconds``: it counts in the probe budget."""
        self.decode_s = self.decode_s * PROBE_DECAY + seconds
        self.probe_extra_s *= PROBE_DECAY

    def observe(self, r: StepRecord) -> None:
        """Learn from a step that ran: the acceptance of its verified drafts, how often asked sequences got drafts,
        and, for a pure decode/verify step (a prompt chunk in the batch would make the step look slower than its
        token count says), the cost table and the measured speedup (``observe_realized``).

        A held plain step (``PLAIN_HOLD``) only adds its time to the probe budget, except every ``LIGHT_EVERY``-th,
        which is measured in full: this bookkeeping (medians, the cost table's curve) is most of what an adaptive
        engine adds to a plain step, and a plain step should cost what a plain engine's does."""
        if r.held:
            self._held_steps += 1
            if self._held_steps % LIGHT_EVERY:
                self.observe_plain(r.seconds)
                return
        for accepted, rejected, match_len in r.acceptances:
            self.observe_acceptance(accepted, rejected)
            if match_len:
                self.match_accepted[match_len] += accepted
                self.match_rejections[match_len] += rejected
        self._asked += r.asked
        self._got += r.got
        if r.draft_s is not None:
            self.last_draft_s = r.draft_s
        if r.pure_decode:
            self.target_cost.observe(r.forward_tokens, r.forward_s)
            self.observe_realized(r)

    def observe_realized(self, r: StepRecord) -> None:
        """The tokens a whole pure-decode step emitted and its wall time, by batch-size bucket and by whether
        it speculated: the measurement that overrules the cost model (see ``choose_k``). A speculative step counts
        the tokens it emits on average at the measured acceptance (``expected_emitted``) rather than its own."""
        b, seconds = r.decodes, r.seconds
        if seconds <= 0 or not b:
            return
        # a sliding window: decode time banked long ago (say, while speculating at small batches, when no probe
        # was needed) must not pay for a run of probes later, at a rate far above the budget
        self.decode_s = self.decode_s * PROBE_DECAY + seconds
        self.probe_extra_s *= PROBE_DECAY
        if r.probe:  # what the probe added to a plain step (all of it while plain is unmeasured)
            self.probe_extra_s += max(0.0, seconds - self.plain_estimate(b))
            return  # neither a plain step nor a speculative one: it measures nothing else
        forward = self.target_cost(r.forward_tokens)
        self.step_factor[r.speculated].append(max(seconds - r.propose_s, forward) / forward)
        self._observed += 1
        if self._observed % 8 == 0 or self._observed < 32:  # the ratio drifts slowly: medians now and then
            for kind in (False, True):
                seen = self.step_factor[kind] or self.step_factor[False]  # speculative unmeasured yet: as plain
                self._factor[kind] = statistics.median(seen) if len(seen) >= 4 else 1.0
        if not r.speculated:  # plain decoding would not have looked for drafts: leave that time out
            plain = max(seconds - r.propose_s, 1e-9)
            # the median of the last few: a neighbour's spike only ever adds time, and an inflated plain time would
            # overrate every speculative step measured against it and underrate what probes cost
            window = self._plain_window.setdefault(b, deque(maxlen=9))
            window.append(plain)
            self.plain_step_s[b] = statistics.median(window)
            return
        if self.plain_step_s:
            # counted at the expected tokens, not the emitted ones: acceptance is measured over every verified
            # token (alpha_estimate), while one step's luck (1 to k + 1 tokens per sequence) would make an 8-step
            # trial's verdict a coin toss at small batches; what the trial has to measure is the step's cost
            tokens = r.emitted if r.expected is None else r.expected
            self.realized.setdefault(b.bit_length(), deque(maxlen=64)).append(
                tokens * self.plain_estimate(b) / (b * seconds))

    # --- choosing k ----------------------------------------------------------------------------------

    def calibrate(self) -> None:
        """Time the target's (and the draft's) forwards once, at start-up (``calibrate_decode``)."""
        calibrate_decode(self.target_runner, self.target_cost)
        if self.draft_runner is not None:
            calibrate_decode(self.draft_runner, self.draft_cost)
        self.calibrated = True

    def step_time(self, num_tokens: int, speculative: bool) -> float:
        """Predicted seconds of a whole engine step whose target forward covers ``num_tokens`` tokens, drafting
        excluded: the forward from the cost table times the measured ratio of whole steps to their forwards.
        The ratio is larger for speculative steps (verification, rollback, more tokens to append and
        detokenize); a model of forwards alone overrates speculation wherever its gain is small."""
        return self.target_cost(num_tokens) * self._factor[speculative]

    def alpha_estimate(self) -> float:
        """The acceptance the predictions use: recent verifications (``ALPHA_DECAY``), not all history as in
        ``stats``: a server's workload changes, and the rule must follow it. A prior worth 8 tested tokens."""
        acc, tried = self._recent_alpha
        return (acc + self.alpha_prior * self.alpha_weight) / (tried + self.alpha_weight)

    def observe_acceptance(self, accepted: int, rejected: bool) -> None:
        """One verified sequence: ``accepted`` draft tokens, then a rejection or not (``alpha_estimate``)."""
        acc, tried = self._recent_alpha
        self._recent_alpha = (acc * ALPHA_DECAY + accepted, tried * ALPHA_DECAY + accepted + rejected)

    def expected_emitted(self, b: int, drafts: list[Draft]) -> float:
        """Tokens a step of ``b`` decodes with these drafts emits on average at the estimated acceptance: what
        the measured speedup of a speculative step counts (see ``observe_realized``)."""
        gain = 0.0
        for d in drafts:
            if d.tokens:
                alpha = self.alpha_for_match(d.match_len) if d.match_len else self.alpha_estimate()
                gain += expected_tokens_per_forward(min(alpha, 0.999), len(d.tokens)) - 1
        return b + gain

    def predicted_rate(self, b: int, k: int, alpha: float, lag: float = 1.0) -> float:
        """Predicted tokens per second of a step of ``b`` decodes with ``k`` drafts each. ``lag``: tokens per
        sequence the draft has not read yet (1-2 after a speculative step, more after plain ones). Catching up on
        them is the price of switching speculation back on, paid once, so it is spread over ``TRIAL_STEPS`` steps:
        charged to one step, it would grow with every plain step and keep speculation off where it pays. A drafter
        with forwards (a draft model, the EAGLE head through ``eagle.HeadRunner``) is priced from its cost table;
        n-gram lookup by its last measured lookup."""
        # Only a fraction `hit` of the sequences asked for drafts get any (n-gram lookup finds no match for
        # the others; a draft model always proposes): they alone add verify tokens and gain tokens.
        hit = (self._got + 4) / (self._asked + 4)  # a prior of 4 hits in 4 until measured
        t = self.step_time(max(b, round(b + hit * b * k)), k > 0)
        if k:
            if self.draft_runner is not None:
                steady = self.draft_cost(max(1, round(b * min(lag, 2.0))))  # the first forward of a steady state
                catch_up = max(0.0, self.draft_cost(max(1, round(b * lag))) - steady) / TRIAL_STEPS
                t += steady + catch_up + (k - 1) * self.draft_cost(b)
            else:
                t += self.last_draft_s
        return b * (1 + hit * (expected_tokens_per_forward(min(alpha, 0.999), k) - 1)) / t

    def choose_k(self, num_decodes: int, lag: float = 1.0) -> tuple[int, bool]:
        """The k for this step (see the module docstring), and whether it is a *probe*: when plain decoding
        wins but not by much, every ``probe_every``-th such step lets one sequence speculate anyway, so the
        draft's cost and the acceptance rate keep being measured (a stale estimate must not switch
        speculation off for good), at the price of a few extra tokens in one step."""
        k_max = self.cfg.num_speculative_tokens
        if not self.cfg.adaptive or num_decodes == 0:
            return k_max, False
        if not self.calibrated:
            self.calibrate()
        if self.held(num_decodes):
            return 0, False
        margin = self.cfg.margin
        alpha = self.alpha_estimate()
        base = self.predicted_rate(num_decodes, 0, alpha)
        rates = {k: self.predicted_rate(num_decodes, k, alpha, lag) for k in range(1, k_max + 1)}
        best = max(rates, key=rates.get)
        if rates[best] > base * margin:
            return (best if self.measured_allows(num_decodes) else 0), False
        self.plain_choices += 1
        if rates[best] < 0.9 * base * margin:  # clearly short: the next few steps need no new prediction
            self.plain_hold[num_decodes] = PLAIN_HOLD
        elif self.probe_due():  # short of the margin, but not by much: worth keeping the estimates current
            self.last_probe = self.plain_choices
            return best, True
        return 0, False

    def held(self, num_decodes: int) -> bool:
        """Is a clear plain decision at this batch size still held (``PLAIN_HOLD``)? Uses up one held step."""
        if not self.plain_hold.get(num_decodes):
            return False
        self.plain_hold[num_decodes] -= 1
        self.plain_choices += 1
        return True

    def probe_due(self) -> bool:
        """A probe may run: ``probe_every`` plain choices since the last one, and probes have added at most
        ``PROBE_BUDGET`` (0.2%) to the decode time of roughly the last thousand steps (``PROBE_DECAY``). A
        draft-model probe first catches the draft up on every token it skipped, which is dear at a large batch:
        the budget keeps the price of staying informed below what a measurement can see."""
        return (self.plain_choices - self.last_probe >= self.probe_every
                and self.probe_extra_s <= PROBE_BUDGET * self.decode_s)

    def measured_allows(self, num_decodes: int) -> bool:
        """The cost model says speculate; do the measured steps of this batch size agree? Keep a few plain steps
        in the mix (every 8th until the batch size has a plain time, then every 32nd) and speculate only while the
        measured speculative steps beat them by the margin (a trial stops after 4 steps that lose outright). Once
        overruled, retry after 32, 64, ... (at most 1024) plain steps with a fresh trial: a batch size where
        speculation loses then costs little, and one where it starts to win is found again. A bucket's first trial
        waits for a plain step of its own: against a plain time scaled from another batch size, the trial would
        read the scaling's error as speedup."""
        margin = self.cfg.margin
        bucket = num_decodes.bit_length()
        on = self.realized.get(bucket, ())
        self.spec_choices += 1
        if (self.spec_choices % (8 if num_decodes not in self.plain_step_s else 32) == 0
                or not any(n.bit_length() == bucket for n in self.plain_step_s)):
            return False  # a plain step now and then keeps the reference current
        # a trial ends early when its first steps already lose outright
        lost = (len(on) >= TRIAL_STEPS and not _beats(on, margin)) or (len(on) >= 4 and not _beats(on, 1.0))
        if bucket not in self.realized and any(self._overruled[smaller] for smaller in range(1, bucket)):
            # never tried here, and speculation is losing at a smaller batch size: that speaks for this one too
            # (more sequences only make the verify forward dearer), so it waits for a retry as if it had lost
            lost = True
        if lost:
            self._overruled[bucket] += 1
            retry = self._retry_after.setdefault(bucket, 32)
            if self._overruled[bucket] < retry:
                return False
            self._overruled[bucket] = 0
            self._retry_after[bucket] = min(2 * retry, 1024)
            # a fresh trial, this bucket's own from now on: old steps must not outvote what is true now
            self.realized.setdefault(bucket, deque(maxlen=64)).clear()
            return True
        self._overruled[bucket] = 0
        self._retry_after.pop(bucket, None)
        return True

    def alpha_for_match(self, n: int) -> float:
        """Acceptance of n-gram drafts found by an ``n``-token match: measured per ``n``, pulled toward the
        overall estimate while few are measured (a prior worth 8 tested tokens)."""
        acc, tried = self.match_accepted[n], self.match_accepted[n] + self.match_rejections[n]
        return (acc + self.alpha_estimate() * self.alpha_weight) / (tried + self.alpha_weight)

    def plain_estimate(self, b: int) -> float:
        """Seconds of a whole plain step of ``b`` decodes: measured at ``b``, or scaled from the nearest batch
        size measured by the cost table's ratio; 0 before any plain step is measured."""
        if not self.plain_step_s:
            return 0.0
        near = min(self.plain_step_s, key=lambda n: abs(n - b))
        return self.plain_step_s[near] * self.target_cost(b) / self.target_cost(near)


# --- the speculator that asks it -----------------------------------------------------------------------------


class AdaptiveSpeculator(Speculator):
    """A ``Speculator`` whose k each step is the controller's ``Decision`` (``adaptive``: a ``KController``). It times
    the step (``step``) and the target's forwards (``target_timer``), records each step in a ``StepRecord`` for the
    controller, and runs a step held plain as the plain engine's step itself."""

    def __init__(self, cfg: SpeculativeConfig, proposer: DraftProposer, target_blocks: KVBlockAllocator,
                 vocab_size: int, adaptive: KController, target_timer: ForwardTimer, verifier: Verifier | None = None,
                 sampler: Sampler | None = None) -> None:
        super().__init__(cfg, proposer, target_blocks, vocab_size, verifier, sampler)
        self.adaptive, self.target_timer = adaptive, target_timer
        self.record: StepRecord | None = None  # the running step's
        self.waiting: Callable[[], int] = lambda: 1

    def step(self, parts: StepParts, waiting: Callable[[], int]) -> list[Request]:
        """One engine step, timed from scheduling to the last appended token (the outputs' assembly after it is the
        same for every k). While the controller holds plain decoding at this batch size and nothing waits, the
        step is ``engine_step`` itself (``KController.plain_step``): a held step costs what a plain engine's does."""
        start = time.perf_counter()
        running = len(parts.scheduler.running)
        if not waiting() and self.adaptive.plain_step(running):
            self.k_in_use = 0
            self.stats.k_counts[0] += 1
            sampled = engine_step(parts)
            for seq in sampled:  # some finished (nothing waited to join): their draft state goes too
                if seq.is_finished:
                    self.release(seq.request_id)
            self.adaptive.observe_plain(time.perf_counter() - start)
            return sampled
        self.waiting, self.record = waiting, None
        sampled = speculative_step(parts, self)
        if self.record is not None:
            self.record.forward_s, self.record.seconds = self.target_timer.last_s, time.perf_counter() - start
            self.adaptive.observe(self.record)
        return sampled

    def propose(self, seqs: list[Request], num_new: list[int], token_budget: int) -> Proposal | None:
        """The controller's decision for the decoding rows, then its drafts (a draft model's or EAGLE's made now for
        the k decided; n-gram drafts already looked up by the controller), their target KV slots reserved."""
        self.record = record = StepRecord(forward_tokens=sum(num_new), pure_decode=sum(num_new) == len(num_new))
        rows = decoding_rows(seqs, num_new)
        if not rows:  # a step of prompt chunks only: nothing to speculate on, and not a step to count
            return None
        b = len(rows)
        t0 = time.perf_counter()
        lag, computed = 1.0, getattr(self.proposer, "computed", None)
        if computed is not None:  # tokens the draft still has to read, per sequence
            lag = sum(seqs[i].num_tokens - computed.get(seqs[i].request_id, 0) for i in rows) / b
        lookup = getattr(self.proposer, "lookup", None)
        decision = self.adaptive.decide(DecodeBatch(seqs, rows, lag, lookup), self.waiting())
        self.record = record = self.record_choice(b, decision, record)
        proposal = None
        if decision.k and decision.drafts is not None:  # looked up while deciding
            proposal = Proposal(list(seqs), self._looked_up(seqs, decision.drafts, token_budget))
            record.draft_s = time.perf_counter() - t0
        elif decision.k:
            ks = self.reserve(seqs, rows[:1] if decision.probe else rows, decision.k, token_budget)
            t1 = time.perf_counter()
            proposal = Proposal(list(seqs), self.proposer.propose(seqs, ks, self.vocab_size))
            record.draft_s = time.perf_counter() - t1
            if not decision.probe:  # how often an asked sequence gets a draft (predicted_rate's hit rate)
                record.asked = sum(1 for k_i in ks if k_i)
                record.got = sum(1 for k_i, d in zip(ks, proposal.drafts_of) if k_i and d.tokens)
        # a lookup is part of every n-gram step's price; a draft model's decision costs nothing to leave out
        record.propose_s = time.perf_counter() - t0 if lookup is not None else record.draft_s or 0.0
        if proposal is not None:
            record.forward_tokens += sum(len(d.tokens) for d in proposal.drafts_of)
            if not decision.probe:
                record.expected = self.adaptive.expected_emitted(b, proposal.drafts_of)
        return proposal

    def _looked_up(self, seqs: list[Request], found: dict[int, tuple[list[int], int]],
                   token_budget: int) -> list[Draft]:
        """The n-gram drafts the controller chose (by row: tokens, match length), as far as the budget and the free
        blocks let their target slots be reserved."""
        drafts = [Draft([]) for _ in seqs]
        for i, (tokens, n) in found.items():
            seq, tokens = seqs[i], tokens[: max(token_budget, 0)]
            if tokens and self.target_blocks.can_append(seq.request_id, seq.num_tokens + len(tokens)):
                self.target_blocks.append_slots(seq.request_id, seq.num_tokens + len(tokens))
                drafts[i] = NgramProposer.draft(seq, tokens, n, self.vocab_size)
                token_budget -= len(tokens)
        return drafts

    def record_choice(self, b: int, decision: Decision, record: StepRecord | None = None) -> StepRecord:
        """This step's choice, in ``stats`` and in ``record`` (a fresh one by default): ``b`` decoding sequences,
        ``decision.k`` drafts each (a probe counts as k = 0: it is plain decoding plus one sequence's measurement)."""
        self.k_in_use = 0 if decision.probe else decision.k
        self.stats.k_counts[self.k_in_use] += 1
        self.stats.num_probes += decision.probe
        record = record or StepRecord()
        record.decodes, record.k, record.probe, record.held = b, self.k_in_use, decision.probe, decision.held
        return record

    def verify(self, proposal: Proposal, seqs: list[Request],
               logits: torch.Tensor) -> list[tuple[list[int], torch.Tensor]]:
        """``Speculator.verify``, each verified sequence's acceptance noted in the step's record."""
        out = super().verify(proposal, seqs, logits)
        by_id = {id(s): d for s, d in zip(proposal.seqs, proposal.drafts_of)}
        for seq, (toks, _) in zip(seqs, out):
            d = by_id.get(id(seq))
            if d is not None and d.tokens:
                self.record.acceptances.append((len(toks) - 1, len(toks) - 1 < len(d.tokens), d.match_len))
        self.record.emitted = sum(len(toks) for toks, _ in out)
        return out


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


def build_adaptive_speculator(cfg: SpeculativeConfig, proposer: DraftProposer, target_runner: ModelRunner,
                              target_blocks: KVBlockAllocator, vocab_size: int,
                              verifier: Verifier | None = None, sampler: Sampler | None = None) -> AdaptiveSpeculator:
    """Adaptive k's speculator for ``proposer`` (``NgramAdaptiveK`` for n-gram lookups, else ``AdaptiveK``), its
    forwards calibrated now, then timed: the target's every forward (``ForwardTimer``), a draft model's into the
    draft's cost table (an EAGLE head times its own drafting forwards into the table it is handed as ``cost``)."""
    draft_runner = getattr(proposer, "runner", None)
    controller = NgramAdaptiveK if isinstance(proposer, NgramProposer) else AdaptiveK  # n-grams: look, then decide
    ctl = controller(cfg, target_runner, draft_runner)
    ctl.calibrate()
    if hasattr(proposer, "cost"):
        proposer.cost = ctl.draft_cost
    elif isinstance(draft_runner, ModelRunner):
        ForwardTimer(draft_runner, ctl.draft_cost)
    return AdaptiveSpeculator(cfg, proposer, target_blocks, vocab_size, ctl, ForwardTimer(target_runner), verifier,
                              sampler)


def _beats(speedups, margin: float) -> bool:
    """Did the recent speculative steps (``speedups``: each one's tokens per second over plain decoding's at its
    batch size) beat plain decoding by ``margin``? (Why a margin and not 1: the module docstring.)"""
    return statistics.fmean(speedups) > margin
