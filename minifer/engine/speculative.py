"""Speculative decoding inside continuous batching (chapter 04).

Decode is memory-bandwidth-bound: a forward pass over ``k + 1`` new tokens per sequence costs about as
much as one token, as long as the batch is small. So each step, every decoding sequence may bring ``k``
guessed tokens; the target scores the sequence's last token plus the guesses in one forward over the
paged cache; :mod:`minifer.spec.rejection` keeps the longest acceptable prefix and adds one token of the
target's own, so a step emits between 1 and ``k + 1`` tokens and the output is exactly what plain decoding
would give (greedy: the same tokens; sampled: the same distribution).

Two proposers (vLLM's ``speculative_config`` names):

- ``{"method": "draft_model", "model": "tinystories-draft", "num_speculative_tokens": 4}``: a small model
  with the same tokenizer runs ``k`` cheap decode steps over its *own* paged cache;
- ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}``:
  prompt-lookup decoding, free to compute, good on input-grounded text (summaries, code edits, RAG).

Rejected guesses leave KV behind: the target's (and draft's) block tables are truncated back to the
tokens that are really there, freeing blocks that the rollback empties (``BlockManager.truncate``).

**Adaptive k** (``"adaptive": True``, the default). Speculation costs the draft's steps and a wider verify
forward; it pays only while that wider forward is nearly free, i.e. at low concurrency. Each step, for the
``B`` sequences decoding, the engine picks the ``k`` in ``0..num_speculative_tokens`` that maximises the
predicted tokens per second

    B * (1 + h * (E(alpha, k) - 1)) / (T(B * (1 + h * k)) + t_draft(B, k))
    E = (1 - alpha^(k+1)) / (1 - alpha)

where ``h`` is the measured fraction of sequences that get drafts at all (1 for a draft model), ``alpha`` the
measured per-token acceptance (over roughly the last 200 verifications) and ``T(n)`` the predicted time of a whole
engine step whose target forward covers ``n`` tokens: the forward's time from a table (by powers of two,
interpolated) filled at start-up by a short calibration shaped like decode steps and refreshed by every pure-decode
step, times the measured ratio of whole steps to their forwards (larger for speculative steps: verification,
rollback and more tokens to append). ``k = 0`` (plain decoding) wins unless the prediction beats it by a margin
(10%, more in closed batches, see below), so under load, when ``T`` grows with the tokens, speculation turns itself
off instead of becoming the 1.4-1.8x slowdown that fixed-k speculation shows at high QPS. A clear plain decision is
reused for the next few steps at the same batch size (``PLAIN_HOLD``), and such steps keep only a light bookkeeping
(``_plain_step``): the predictions and timings of every step would otherwise cost about 1% at 16-64 sequences, and
plain decoding should cost the same in an adaptive engine as in a plain one.

N-gram lookup costs almost nothing, so with ``"ngram"`` the engine looks first and decides after: it knows which
sequences have a draft and how long a match found it (a 4-token match is accepted far more often than a 1-token
one; acceptance is measured per match length), and verifies only the drafts predicted to pay
(``plan_drafts``). At large batches it skips even the lookups when recent match statistics say they cannot pay,
and holds that decision for ``PLAIN_HOLD`` steps like a clear plain one (deciding it cost 30-50 us a step here).
With no request waiting for a slot it speculates only in steps where every decoding sequence has a draft: a
sequence that speeds ahead alone frees a slot nobody takes, and the batch still ends with its slowest sequence.

The model can be wrong (a cost table from a calibration, acceptance that differs between requests), so measurement
has the last word: per batch-size bucket the engine keeps the measured speedup of each recent speculative step (its
tokens per second over a plain step's at the same batch size, counting the tokens such a step emits on average at
the measured acceptance, so that one step's luck does not decide a trial; it mixes in a few plain steps to know
those) and stops speculating in a bucket where, after a trial of 8 steps, the mean speedup does not clear the margin
(or after 4 that lose outright). It tries again after 32, 64, ... 1024 plain steps. Why a margin rather than 1, and
why a growing one when nothing is waiting: speculation speeds sequences up unevenly, so the batch ends in a ragged
tail of a few slow sequences stepping at a small, inefficient batch size, and a batch takes as long as its slowest
sequence; a step's own speedup does not see that. Measured with the bundled pair on the CPU, draft-model steps about
1.4x faster per step at 8 sequences finished batches about 1.2x sooner, while steps about 1.3x faster at 16
sequences finished them no sooner at all: the more sequences, the further the slowest lags the mean, so with nothing
waiting the margin grows with the batch (``margin_for``). (A GPU's flatter cost keeps the per-step gains of small
batches far above the margin.)

Staying informed costs too: when plain decoding wins but not by much (the best prediction within 10% of the
margin), now and then one sequence speculates anyway (a *probe*), so a stale acceptance or draft cost cannot
switch speculation off for good. A draft-model probe first catches the draft up on every token it skipped,
which at 32 sequences can cost a third of a step, so probes are rationed to 0.2% of the decode time of roughly
the last thousand steps (``PROBE_BUDGET``, ``PROBE_DECAY``): time banked while speculating at small batches must
not pay for a run of probes later. A prediction clearly short of the margin gets no probes: its decision is held
for a few steps instead.

Limits (documented, not hidden): requests whose distribution reads their history (a repetition, presence or
frequency penalty, ``min_tokens``: ``SamplingParams.reads_history``) decode without speculation;
with adaptive k, a seeded *sampled* request is distributed exactly as without speculation but its exact
tokens depend on the k chosen each step (timing-based), so set ``"adaptive": False`` for bit-reproducible
seeded sampling.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import Counter, deque
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch

from minifer.engine.block_manager import BlockManager
from minifer.engine.runner import ModelRunner
from minifer.engine.sequence import Sequence
from minifer.layers.paged_attention import PagedKVCache
from minifer.models.llama import LlamaForCausalLM
from minifer.sampling import greedy_argmax
from minifer.spec.ngram import ngram_match
from minifer.spec.rejection import one_hot_draft_probs, probs_from_logits, rejection_sample, verify_greedy
from minifer.spec.theory import expected_tokens_per_forward

METHODS = ("draft_model", "ngram")
TRIAL_STEPS = 8  # speculative steps measured at a batch size before measurement may overrule the model
PROBE_BUDGET = 0.002  # probes may cost at most this fraction of the decode time (see Speculator._probe_due)
PROBE_DECAY = 0.999  # per pure-decode step: the budget covers roughly the last thousand steps, not all history
ALPHA_DECAY = 0.995  # per verified sequence: the acceptance estimate follows roughly the last 200 verifications
TAIL_GROWTH = 0.02  # closed batches: the margin grows by 1 + TAIL_GROWTH * log2(b)^2 (see Speculator.margin_for)
PLAIN_HOLD = 15  # steps that reuse a clear "plain" decision at the same batch size (see Speculator._plain_step)
LIGHT_EVERY = 8  # of the held plain steps, every LIGHT_EVERY-th refreshes the timings (see Speculator._plain_step)
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: Any = None  # draft: bundled name, local folder, hub id, or an already built LlamaForCausalLM
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    adaptive: bool = True
    margin: float = 1.1  # adaptive: speculate only if predicted >= margin x plain (more in closed batches: margin_for)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in d:
            raise ValueError(f"speculative_config needs a 'method': one of {METHODS}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (how many tokens to propose)")
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}: use one of {METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("method 'draft_model' needs speculative_config['model'] (the draft checkpoint)")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}")
        if not self.margin >= 1:
            raise ValueError(f"margin must be >= 1, got {self.margin}")


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [k, V] the distributions they were drawn from (sampled rows)
    match_len: int = 0  # n-gram drafts: the length of the match that found them (0: a draft model's)


class NgramProposer:
    """Prompt lookup: no model, no cache; a deterministic guess (``q`` is one-hot)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def lookup(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """Up to ``k`` draft tokens and the length of the match that found them."""
        return ngram_match(seq.all_token_ids, k, self.cfg.prompt_lookup_max, self.cfg.prompt_lookup_min)

    def propose(self, seqs: list[Sequence], ks: list[int], vocab_size: int) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, ks):
            tokens, n = self.lookup(seq, k) if k else ([], 0)
            drafts.append(self.draft(seq, tokens, n, vocab_size))
        return drafts

    @staticmethod
    def draft(seq: Sequence, tokens: list[int], match_len: int, vocab_size: int) -> Draft:
        return Draft(tokens, None if seq.params.greedy or not tokens else one_hot_draft_probs([tokens], vocab_size)[0],
                     match_len)

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        pass

    def release(self, request_id: object) -> None:
        pass


class DraftModelProposer:
    """A small model with its own paged KV cache, run ``k`` decode steps per engine step.

    ``computed[rid]``: how many of the request's tokens the draft cache holds. Each proposal first feeds
    the tokens it has not seen (the prompt the first time; afterwards the one or two tokens the last
    verification added), then decodes its own guesses one at a time."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        self.cost = CostTable()  # the draft's forward time by tokens, refreshed by every proposal
        cfg = model.config
        w = model.lm_head.weight
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.cache = PagedKVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                                  cfg.head_dim, w.dtype, w.device)
        self.runner = ModelRunner(model, self.cache, self.blocks)
        self.computed: dict[object, int] = {}

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        rid = seq.request_id
        if not self.blocks.has_seq(rid):
            if self.blocks.blocks_needed(num_tokens) > self.blocks.num_free_blocks:
                return False
            self.blocks.allocate(rid, seq.token_slice(0, 1))
            self.computed[rid] = 0
        if not self.blocks.can_append(rid, num_tokens):
            return False
        self.blocks.append_slots(rid, num_tokens)
        return True

    def propose(self, seqs: list[Sequence], ks: list[int], vocab_size: int) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        active = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k and self._reserve(s, s.num_tokens + k - 1)]
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        step = 0
        while active:
            rids, starts, chunks = [], [], []
            for i in active:
                seq = seqs[i]
                if step == 0:  # catch up on what the draft has not seen, up to the last token
                    start = self.computed[seq.request_id]
                    chunk = seq.token_slice(start, seq.num_tokens)
                else:
                    start, chunk = seq.num_tokens + step - 1, drafts[i].tokens[-1:]
                rids.append(seq.request_id)
                starts.append(start)
                chunks.append(chunk)
            logits = self.runner.forward(rids, starts, chunks, [1] * len(active))
            self.cost.observe(sum(len(c) for c in chunks), self.runner.last_forward_s)
            for r, i in enumerate(active):
                self.computed[seqs[i].request_id] = starts[r] + len(chunks[r])
            params = [seqs[i].params for i in active]
            q = probs_from_logits(logits[:, None, :], params)[:, 0]
            for r, i in enumerate(active):
                seq = seqs[i]
                if seq.params.greedy:  # the draft takes the bias too, or it proposes what the target rules out
                    tok = int(greedy_argmax(logits[r : r + 1], seq.params))
                else:
                    tok = int(torch.multinomial(q[r], 1, generator=seq.generator))
                    probs[i].append(q[r])
                drafts[i].tokens.append(tok)
            step += 1
            active = [i for i in active if len(drafts[i].tokens) < ks[i]]
        for i, p in probs.items():
            if p:
                drafts[i].probs = torch.stack(p)
        return drafts

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Keep the draft's KV of the first ``num_valid`` tokens of the sequence, free the rest."""
        rid = seq.request_id
        if rid in self.computed and self.computed[rid] > num_valid:
            self.computed[rid] = num_valid
        if self.blocks.has_seq(rid):
            self.blocks.truncate(rid, max(self.computed.get(rid, 0), 1))

    def release(self, request_id: object) -> None:
        self.computed.pop(request_id, None)
        if self.blocks.has_seq(request_id):
            self.blocks.free(request_id)


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


@dataclass
class SpecStats:
    num_proposed: int = 0  # draft tokens the target verified
    num_accepted: int = 0
    num_rejections: int = 0  # verifications that stopped at a rejected draft token
    num_verifies: int = 0  # (sequence, step) pairs that speculated
    num_probes: int = 0  # plain steps in which one sequence speculated to keep the estimates current (k_counts: 0)
    num_emitted: int = 0  # tokens those verifications emitted
    k_counts: Counter[int] = field(default_factory=Counter)  # steps by the k they used (a server runs for days)
    # n-gram drafts by the length of the match that found them: accepted tokens and rejections
    match_accepted: Counter[int] = field(default_factory=Counter)
    match_rejections: Counter[int] = field(default_factory=Counter)

    @property
    def alpha(self) -> float:
        """Per-token acceptance, the maximum-likelihood estimate under Leviathan's i.i.d. model: each
        accepted token is a success, each stop at a rejection one failure (drafts after a rejection are never
        tested, so dividing by all proposed tokens would bias it low)."""
        tried = self.num_accepted + self.num_rejections
        return self.num_accepted / tried if tried else float("nan")


class Speculator:
    """Proposes drafts for the decoding sequences of a step, then verifies the target's logits."""

    def __init__(self, cfg: SpeculativeConfig, proposer, target_runner: ModelRunner, target_blocks: BlockManager,
                 vocab_size: int, draft_runner: ModelRunner | None = None) -> None:
        self.cfg, self.proposer = cfg, proposer
        self.target_runner, self.target_blocks, self.vocab_size = target_runner, target_blocks, vocab_size
        self.draft_runner = draft_runner
        self.stats = SpecStats()
        self.k_in_use = cfg.num_speculative_tokens
        self.target_cost = CostTable()
        self.draft_cost = proposer.cost if draft_runner is not None else CostTable()
        self.probe_every = 32  # see choose_k
        self._plain_choices = self._last_probe = 0  # plain choices so far, and at the last probe
        # decode-step seconds so far, and what probes added to them (the budget of _probe_due)
        self._decode_s = self._probe_extra_s = 0.0
        self._step_probe = False
        self._observed = 0  # pure-decode steps observed (the step-factor medians refresh every 8th)
        self._plain_hold: dict[int, int] = {}  # per batch size: steps left that reuse a clear plain decision
        self._light_steps, self._step_light = 0, False  # see _plain_step
        # the measurement that has the last word on k: per batch-size bucket, each recent speculative step's
        # tokens per second over plain decoding's at its batch size (plain_step_s: whole plain steps by size)
        self.realized: dict[int, deque[float]] = {}
        self.plain_step_s: dict[int, float] = {}
        self._plain_window: dict[int, deque[float]] = {}  # the recent plain step times behind plain_step_s
        self._step_decodes, self._step_speculated, self._spec_choices = 0, False, 0
        self._overruled: Counter[int] = Counter()  # per bucket: steps the measurement overruled in a row
        self._retry_after: dict[int, int] = {}  # per bucket: overruled steps before speculating anyway
        self._asked = self._got = 0  # sequences asked for drafts, and those that got at least one
        self.alpha_prior, self.alpha_weight = 0.6, 8.0  # a prior worth 8 tested tokens until data arrives
        self._recent_alpha = (0.0, 0.0)  # accepted and tested draft tokens, decayed (see alpha_estimate)
        self._step_expected: float | None = None  # a speculative step's expected tokens (see observe_realized)
        self.calibrated = False
        self.last_draft_s = 0.0
        # whole step / target forward, for plain and for speculative steps (see step_time): recent ratios, and
        # their median, refreshed once per step (the predictions read it many times per step)
        self.step_factor: dict[bool, deque[float]] = {False: deque(maxlen=32), True: deque(maxlen=32)}
        self._factor = {False: 1.0, True: 1.0}
        self._step_tokens, self._step_propose_s = 0, 0.0
        self.match_seen: Counter[int] = Counter()  # n-gram lookups by the match length they found (0: none)

    # --- choosing k ----------------------------------------------------------------------------------

    def calibrate(self, max_tokens: int = 128, context: int = 64) -> None:
        """Time target (and draft) forwards shaped like decode steps, once, at start-up while every block is free:
        1, 2, 4, ... scratch sequences with ``context`` cached tokens bring one new token each. Why decode-shaped: a
        forward's time depends on how many sequences' caches it reads, not only on its token count; a table timed
        on one long prompt chunk ran 15-20% under real decode steps of 64-128 tokens here, and made speculation
        at 32 sequences look like a gain. Verify steps carry fewer sequences and more tokens each; at the same
        token count they measured from about 0.6x to 1.35x a decode step here, so for them the table is a first
        guess that their own steps refresh (and the measured trials overrule). Beyond ``max_tokens`` the table
        extends linearly (``CostTable``). The cached values are left as the fresh cache has them (zeros): a
        forward's time depends on the sizes it reads, not on the numbers."""
        def measure(runner: ModelRunner, table: CostTable) -> None:
            blocks, n = runner.blocks, 1
            # a small cache holds a shorter context (down to one token): the timing still has one sequence
            ctx = min(context, blocks.block_size * blocks.num_free_blocks - 1)
            if ctx < 1:
                return  # not even two tokens fit: the table keeps its prior, refreshed by real steps
            while 2 * n <= max_tokens and 2 * n * blocks.blocks_needed(ctx + 1) <= blocks.num_free_blocks:
                n *= 2
            ids = [f"__calibrate{i}__" for i in range(n)]
            with ExitStack() as stack:
                for i, rid in enumerate(ids):  # distinct tokens: no prefix-cache sharing between them
                    stack.enter_context(blocks.scratch(rid, [i + 1] * (ctx + 1)))
                m = 1
                while m <= n:
                    runner.forward(ids[:m], [ctx] * m, [[0]] * m, [1] * m)  # warm-up
                    for _ in range(3):
                        runner.forward(ids[:m], [ctx] * m, [[0]] * m, [1] * m)
                        table.observe(m, runner.last_forward_s)
                    m *= 2
        measure(self.target_runner, self.target_cost)
        if self.draft_runner is not None:
            measure(self.draft_runner, self.draft_cost)
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

    def _observe_acceptance(self, accepted: int, rejected: bool) -> None:
        """One verified sequence: ``accepted`` draft tokens, then a rejection or not (``alpha_estimate``)."""
        acc, tried = self._recent_alpha
        self._recent_alpha = (acc * ALPHA_DECAY + accepted, tried * ALPHA_DECAY + accepted + rejected)

    def _expected_emitted(self, b: int, drafts: list[Draft]) -> float:
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
        sequence the draft has not seen yet. Its first forward catches up on them: 1-2 after a speculative step,
        more after plain steps. That catch-up is the price of switching speculation back on, paid once for the
        steps that follow, so it is spread over a trial's worth of them (``TRIAL_STEPS``). Charged in full to one
        step, it grew with every plain step and, at 8 sequences here, kept speculation off for good where it
        was worth 1.25x."""
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

    def margin_for(self, num_decodes: int, waiting: int) -> float:
        """How much faster than plain decoding a step must be predicted (and measured) to be to speculate.

        ``cfg.margin`` (10%) covers the noise of the timings and what the measuring plain steps cost. When nothing
        is waiting for a slot, a step's speedup also overrates the batch's: the batch ends with its slowest
        sequence, in a ragged tail of steps at small, inefficient batch sizes, and the more sequences, the further
        the slowest lags the mean. Measured with the bundled pair on the CPU, the batch's speedup was about 0.95x
        the steps' at 4 sequences, 0.86x at 8 and 0.74x at 16, so the margin grows as
        ``1 + TAIL_GROWTH * log2(b) ** 2``: 1.1 at one sequence, about 1.3 at 8, 1.45 at 16, 1.9 at 64. With
        requests waiting, a finished sequence's slot is refilled at once: there is no tail, and 10% holds."""
        m = self.cfg.margin
        if not waiting:
            m *= 1 + TAIL_GROWTH * math.log2(num_decodes) ** 2
        return m

    def choose_k(self, num_decodes: int, lag: float = 1.0, waiting: int = 1) -> tuple[int, bool]:
        """The k for this step (see the module docstring), and whether it is a *probe*: when plain decoding
        wins but not by much, every ``probe_every``-th such step lets one sequence speculate anyway, so the
        draft's cost and the acceptance rate keep being measured (a stale estimate must not switch
        speculation off for good), at the price of a few extra tokens in one step."""
        k_max = self.cfg.num_speculative_tokens
        if not self.cfg.adaptive or num_decodes == 0:
            return k_max, False
        if not self.calibrated:
            self.calibrate()
        if self._held(num_decodes):
            return 0, False
        margin = self.margin_for(num_decodes, waiting)
        alpha = self.alpha_estimate()
        base = self.predicted_rate(num_decodes, 0, alpha)
        rates = {k: self.predicted_rate(num_decodes, k, alpha, lag) for k in range(1, k_max + 1)}
        best = max(rates, key=rates.get)
        if rates[best] > base * margin:
            return (best if self.measured_allows(num_decodes, margin) else 0), False
        self._plain_choices += 1
        if rates[best] < 0.9 * base * margin:  # clearly short: the next few steps need no new prediction
            self._plain_hold[num_decodes] = PLAIN_HOLD
        elif self._probe_due():  # short of the margin, but not by much: worth keeping the estimates current
            self._last_probe = self._plain_choices
            return best, True
        return 0, False

    def _held(self, num_decodes: int) -> bool:
        """Is a clear plain decision at this batch size still held (``PLAIN_HOLD``)? Uses up one held step."""
        if not self._plain_hold.get(num_decodes):
            return False
        self._plain_hold[num_decodes] -= 1
        self._plain_choices += 1
        return True

    def _probe_due(self) -> bool:
        """A probe may run: ``probe_every`` plain choices since the last one, and probes have added at most
        ``PROBE_BUDGET`` (0.2%) to the decode time of roughly the last thousand steps (``PROBE_DECAY``). A
        draft-model probe first catches the draft up on every token it skipped, so at a large batch one probe
        can cost a third of a step; the budget keeps the price of staying informed below what a measurement
        can see."""
        return (self._plain_choices - self._last_probe >= self.probe_every
                and self._probe_extra_s <= PROBE_BUDGET * self._decode_s)

    def measured_allows(self, num_decodes: int, margin: float | None = None) -> bool:
        """The cost model says speculate; do the measured steps of this batch size agree? Keep a few plain
        steps in the mix (every 8th until the batch size has a plain time, then every 32nd) and speculate
        only while the measured speculative steps beat them by the margin (``_beats``; a trial stops after 4
        steps that lose outright). Once overruled, try again after 32, 64, ... (at most 1024) plain steps,
        with a fresh trial of 8 speculative steps: a batch size where speculation loses then costs little,
        and one where it starts to win (acceptance rose, an unlucky first trial) is found again. ``margin``: this
        step's (``margin_for``), ``cfg.margin`` by default."""
        margin = self.cfg.margin if margin is None else margin
        bucket = num_decodes.bit_length()
        on = self.realized.get(bucket, ())
        self._spec_choices += 1
        if self._spec_choices % (8 if num_decodes not in self.plain_step_s else 32) == 0:
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

    # --- n-gram: look first, then choose ----------------------------------------------------------------

    def alpha_for_match(self, n: int) -> float:
        """Acceptance of n-gram drafts found by an ``n``-token match: measured per ``n``, pulled toward the
        overall estimate while few are measured (a prior worth 8 tested tokens)."""
        s = self.stats
        acc, tried = s.match_accepted[n], s.match_accepted[n] + s.match_rejections[n]
        return (acc + self.alpha_estimate() * self.alpha_weight) / (tried + self.alpha_weight)

    def plan_drafts(self, num_decodes: int, candidates: list[tuple[float, int]],
                    require_all: bool = False) -> tuple[int, int, float]:
        """Which drafts to verify this step. ``candidates``: (acceptance, draft length) of the sequences that
        have a draft, best acceptance first. Verifying the first ``m`` of them, each cut to ``k`` tokens, is
        predicted to emit ``B + sum(E(alpha_i, k_i) - 1)`` tokens in ``step_time(B + sum(k_i))`` seconds.
        Returns ``(m, k, predicted rate / plain rate)``; ``m = 0`` when nothing beats plain decoding.
        ``require_all``: only a plan that gives every decoding sequence a draft counts (see ``_choose_ngram``)."""
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

    def _ngram_may_pay(self, num_decodes: int, require_all: bool = False, margin: float | None = None) -> bool:
        """Before the lookups: would the step pay if its sequences matched as often, and as long, as recent
        lookups did (``match_seen``: lookups by the match length they found, 0 for none)? Verifying only the
        sequences of the best match lengths is allowed. Asked only at 8 or more sequences: below that the
        lookups cost nothing worth saving.

        ``require_all`` (nothing waiting: a step speculates only if every sequence has a draft): if every one
        of ``b`` sequences finds a match less than one step in ten (``hit ** b < 0.1``, with ``hit`` the
        recent share of lookups that found one), the lookups are not worth their cost — at 16 sequences they
        take 1-2% of a step on the CPU, and a step that speculates gains 10-20%."""
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

    def _choose_ngram(self, seqs: list[Sequence], decoding: list[int],
                      waiting: int = 1) -> tuple[dict[int, Draft], int, bool] | None:
        """Prompt lookup is nearly free, so look up every decoding sequence first and decide knowing which ones
        have a draft and how long a match found it (``alpha_for_match``). Returns the drafts to verify by row,
        the k cap, and whether this is a probe (one draft verified to keep the estimates current); None when
        the lookups were not worth making at all (``_ngram_may_pay``).

        With no request ``waiting``, speculating for only some of the sequences does not pay: the ones that
        speed ahead finish early and free slots nobody takes, and the batch still ends with its slowest
        sequence. Then a step speculates only when every decoding sequence has a draft."""
        if not self.calibrated:
            self.calibrate()
        k_max = self.cfg.num_speculative_tokens
        b = len(decoding)
        margin = self.margin_for(b, waiting)
        may_pay = self._ngram_may_pay(b, not waiting, margin)
        if not may_pay or not self.measured_allows(b, margin):
            # not worth even the lookups; now and then a probe: every sequence looked up (the match
            # statistics stay current) and one draft verified (so does its acceptance)
            self._plain_choices += 1
            if not self._probe_due():
                if not may_pay:  # what decided it changes only with lookups, verifications and timings: hold it
                    self._plain_hold[b] = PLAIN_HOLD
                return None  # not even looked up
            self._last_probe = self._plain_choices
            found = self._lookup_all(seqs, decoding)
            return ({found[0][1]: (found[0][2], found[0][3])}, k_max, True) if found else ({}, 0, False)
        found = self._lookup_all(seqs, decoding)
        m, k, ratio = self.plan_drafts(b, [(a, len(t)) for a, _, t, _ in found], require_all=not waiting)
        probe = False
        if not (m and ratio > margin):
            m = 0
            self._plain_choices += 1
            if found and self._probe_due():
                self._last_probe = self._plain_choices
                m, k, probe = 1, k_max, True
        return {i: (tokens[:k], n) for _, i, tokens, n in found[:m]}, k if m else 0, probe

    # --- proposing and verifying ----------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], num_new: list[int], token_budget: int,
                waiting: int = 1) -> list[list[int]] | None:
        """Drafts for the decoding rows of a scheduled step (``num_new == 1`` and prompt complete), with
        target KV slots reserved for them; ``[]`` for other rows. None when nothing speculates. ``waiting``:
        requests queued for a slot (see ``_choose_ngram``)."""
        self._step_light = False
        if self.cfg.adaptive and sum(num_new) == len(seqs) and self._held(len(seqs)):
            # the fast path: a pure-decode step at a batch size whose plain decision is held, recognised without
            # looking at each sequence (that alone cost 10-20 us a step at 16-64 sequences here)
            self._plain_step(len(seqs))
            return None
        decoding = [i for i, (s, n) in enumerate(zip(seqs, num_new))
                    if n == 1 and s.num_computed_tokens + 1 == s.num_tokens and not s.params.reads_history]
        if not decoding:  # a step of prompt chunks only: nothing to speculate on, and not a step to count
            self._step_decodes, self._step_speculated, self._step_probe, self._step_propose_s = 0, False, False, 0.0
            return None
        b = len(decoding)
        if self.cfg.adaptive and self._held(b):  # held, in a step with prompt chunks or excluded sequences
            self._plain_step(b)
            return None
        lag = 1.0
        computed = getattr(self.proposer, "computed", None)
        if computed is not None:  # tokens the draft still has to read, per sequence
            lag = sum(seqs[i].num_tokens - computed.get(seqs[i].request_id, 0) for i in decoding) / b
        t0 = time.perf_counter()
        if self.cfg.adaptive and isinstance(self.proposer, NgramProposer):
            out = self._propose_looked_up(seqs, decoding, token_budget, waiting)
            self._step_propose_s = time.perf_counter() - t0
            return out
        self._step_propose_s = 0.0
        k, probe = self.choose_k(b, lag, waiting)
        self._record_step(b, k, probe)
        if k == 0:
            return None
        ks = [0] * len(seqs)
        for i in decoding[:1] if probe else decoding:
            seq = seqs[i]
            # never more than the request may still emit, the step's token budget, or the free blocks
            want = min(k, seq.max_tokens - len(seq.output_token_ids) - 1, token_budget)
            if want > 0 and self.target_blocks.can_append(seq.request_id, seq.num_tokens + want):
                self.target_blocks.append_slots(seq.request_id, seq.num_tokens + want)
                ks[i] = want
                token_budget -= want
        t0 = time.perf_counter()
        drafts = self.proposer.propose(seqs, ks, self.vocab_size)
        self.last_draft_s = self._step_propose_s = time.perf_counter() - t0
        if not probe:
            self._asked += sum(1 for k_i in ks if k_i)
            self._got += sum(1 for k_i, d in zip(ks, drafts) if k_i and d.tokens)
            self._step_expected = self._expected_emitted(b, drafts)
        self._batch_seqs, self._drafts = list(seqs), drafts
        return [d.tokens for d in drafts]

    def _plain_step(self, b: int) -> None:
        """Bookkeeping of a step that does not speculate because a decision was held (or lookups could not pay):
        counted, and only every ``LIGHT_EVERY``-th such step refreshes the cost table and the plain step time. A
        plain step of an adaptive engine should cost what a plain engine's does: the full bookkeeping of every step
        added about 1% at 16-64 sequences here, the light one 0.1-0.2% (25-45 us of a 15-55 ms step, the decisions
        between holds included: ``python -m minifer.bench.speculative --bookkeeping``)."""
        self._record_step(b, 0, False)
        self._step_propose_s = 0.0
        self._light_steps += 1
        self._step_light = self._light_steps % LIGHT_EVERY != 0

    def _record_step(self, b: int, k: int, probe: bool) -> None:
        """This step's choice, for ``stats`` and for ``observe_realized``: ``b`` decoding sequences, ``k`` drafts
        each (a probe counts as k = 0: it is plain decoding plus one sequence's measurement)."""
        self.k_in_use = 0 if probe else k
        self.stats.k_counts[self.k_in_use] += 1
        self.stats.num_probes += probe
        self._step_decodes, self._step_speculated, self._step_probe = b, self.k_in_use > 0, probe
        self._step_expected = None

    def _lookup_all(self, seqs: list[Sequence], decoding: list[int]) -> list[tuple[float, int, list[int], int]]:
        """(acceptance, row, draft, match length) of every decoding sequence with a match, best first."""
        found = []
        for i in decoding:
            seq = seqs[i]
            room = min(self.cfg.num_speculative_tokens, seq.max_tokens - len(seq.output_token_ids) - 1)
            if room > 0:
                tokens, n = self.proposer.lookup(seq, room)
                self.match_seen[n] += 1
                if tokens:
                    found.append((self.alpha_for_match(n), i, tokens, n))
        found.sort(key=lambda c: -c[0])
        if self.match_seen.total() > 4096:  # a sliding memory: halve the counts
            self.match_seen = Counter({n: c // 2 for n, c in self.match_seen.items()})
        return found

    def _propose_looked_up(self, seqs: list[Sequence], decoding: list[int], token_budget: int,
                           waiting: int = 1) -> list[list[int]] | None:
        """``propose`` for adaptive n-gram speculation: the drafts are found before k is chosen."""
        t0 = time.perf_counter()
        choice = self._choose_ngram(seqs, decoding, waiting)
        if choice is None:  # a plain step without even the lookups: the fast path
            self._plain_step(len(decoding))
            return None
        chosen, k, probe = choice
        self._record_step(len(decoding), k, probe)
        if not chosen:
            return None
        drafts = [Draft([]) for _ in seqs]
        for i, (tokens, n) in chosen.items():
            seq = seqs[i]
            tokens = tokens[:max(token_budget, 0)]
            if tokens and self.target_blocks.can_append(seq.request_id, seq.num_tokens + len(tokens)):
                self.target_blocks.append_slots(seq.request_id, seq.num_tokens + len(tokens))
                drafts[i] = NgramProposer.draft(seq, tokens, n, self.vocab_size)
                token_budget -= len(tokens)
        self.last_draft_s = time.perf_counter() - t0
        if not probe:
            self._step_expected = self._expected_emitted(len(decoding), drafts)
        self._batch_seqs, self._drafts = list(seqs), drafts
        return [d.tokens for d in drafts]

    def observe_step(self, num_tokens: int, pure_decode: bool) -> None:
        """Refresh the cost table with the forward just run (pure decode/verify steps only: a prompt chunk in
        the batch would make the step look slower than its token count says)."""
        self._step_tokens = num_tokens
        if pure_decode and not self._step_light:
            self.target_cost.observe(num_tokens, self.target_runner.last_forward_s)

    def observe_realized(self, emitted: int, seconds: float) -> None:
        """The tokens a whole pure-decode step emitted and its wall time, by batch-size bucket and by whether
        it speculated: the measurement that overrules the cost model (see ``choose_k``). A speculative step counts
        the tokens it emits on average at the measured acceptance (``_expected_emitted``) rather than its own."""
        b = self._step_decodes
        if seconds <= 0 or not b:
            return
        # a sliding window: decode time banked long ago (say, while speculating at small batches, when no probe
        # was needed) must not pay for a run of probes later, at a rate far above the budget
        self._decode_s = self._decode_s * PROBE_DECAY + seconds
        self._probe_extra_s *= PROBE_DECAY
        if self._step_light:  # see _plain_step
            return
        if self._step_probe:  # what the probe added to a plain step (all of it while plain is unmeasured)
            self._probe_extra_s += max(0.0, seconds - self._plain_estimate(b))
            return  # neither a plain step nor a speculative one: it measures nothing else
        forward = self.target_cost(self._step_tokens)
        self.step_factor[self._step_speculated].append(max(seconds - self._step_propose_s, forward) / forward)
        self._observed += 1
        if self._observed % 8 == 0 or self._observed < 32:  # the ratio drifts slowly: medians now and then
            for kind in (False, True):
                seen = self.step_factor[kind] or self.step_factor[False]  # speculative unmeasured yet: as plain
                self._factor[kind] = statistics.median(seen) if len(seen) >= 4 else 1.0
        if not self._step_speculated:  # plain decoding would not have looked for drafts: leave that time out
            plain = max(seconds - self._step_propose_s, 1e-9)
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
            tokens = emitted if self._step_expected is None else self._step_expected
            self.realized.setdefault(b.bit_length(), deque(maxlen=64)).append(
                tokens * self._plain_estimate(b) / (b * seconds))

    def _plain_estimate(self, b: int) -> float:
        """Seconds of a whole plain step of ``b`` decodes: measured at ``b``, or scaled from the nearest batch
        size measured by the cost table's ratio; 0 before any plain step is measured."""
        if not self.plain_step_s:
            return 0.0
        near = min(self.plain_step_s, key=lambda n: abs(n - b))
        return self.plain_step_s[near] * self.target_cost(b) / self.target_cost(near)

    def verify(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[list[int], torch.Tensor]]:
        """``seqs``: the rows that got logits, in order; ``logits``: ``1 + k_i`` rows each. Returns, per
        sequence, the emitted tokens and the logits rows they were drawn from (for logprobs)."""
        drafts = self._drafts_for(seqs)
        ks = [len(d.tokens) for d in drafts]
        max_k = max(ks)
        offsets = [0]
        for k in ks:
            offsets.append(offsets[-1] + k + 1)
        vocab = logits.shape[-1]
        emitted: list[list[int]] = [[] for _ in seqs]
        # Rows whose distribution reads their history (penalties, min_tokens) never get drafts: they sample as plain
        # decoding does, with their own history, even when the rest of the batch speculates.
        plain = [r for r, s in enumerate(seqs) if s.params.reads_history]
        if plain:
            drawn = ModelRunner.sample([seqs[r] for r in plain], logits[[offsets[r] for r in plain]])
            for r, token in zip(plain, drawn.token_ids):
                emitted[r] = [token]
        greedy = [r for r, s in enumerate(seqs) if s.params.greedy and not s.params.reads_history]
        sampled = [r for r, s in enumerate(seqs) if not s.params.greedy and not s.params.reads_history]
        if greedy:  # the target's argmax at every row, once, then gathered into [rows, max_k + 1]
            index = torch.tensor([[offsets[r] + min(j, ks[r]) for j in range(max_k + 1)] for r in greedy],
                                 device=logits.device)
            top = logits.argmax(-1)
            for r in greedy:  # a logit_bias moves the argmax (sampled rows get it in process_logits)
                if seqs[r].params.logit_bias:
                    rows = slice(offsets[r], offsets[r + 1])
                    top[rows] = greedy_argmax(logits[rows], seqs[r].params)
            out = verify_greedy([drafts[r].tokens for r in greedy], top[index])
            for r, toks in zip(greedy, out):
                emitted[r] = toks
        if sampled:
            padded = logits.new_zeros(len(seqs), max_k + 1, vocab)
            for r in sampled:
                padded[r, : ks[r] + 1] = logits[offsets[r] : offsets[r + 1]]
            p = probs_from_logits(padded[sampled], [seqs[r].params for r in sampled])
            q = torch.zeros(len(sampled), max(max_k, 1), vocab, device=logits.device)
            for j, r in enumerate(sampled):
                if ks[r]:
                    q[j, : ks[r]] = drafts[r].probs
            out = rejection_sample([drafts[r].tokens for r in sampled], q, p, [seqs[r].generator for r in sampled])
            for r, toks in zip(sampled, out):
                emitted[r] = toks
        result = []
        for r, toks in enumerate(emitted):
            k = ks[r]
            if k:
                accepted = len(toks) - 1
                s = self.stats
                s.num_proposed += k
                s.num_accepted += accepted
                s.num_rejections += accepted < k
                s.num_verifies += 1
                s.num_emitted += len(toks)
                self._observe_acceptance(accepted, accepted < k)
                if drafts[r].match_len:
                    s.match_accepted[drafts[r].match_len] += accepted
                    s.match_rejections[drafts[r].match_len] += accepted < k
            result.append((toks, logits[offsets[r] : offsets[r] + len(toks)]))
        return result

    def _drafts_for(self, seqs: list[Sequence]) -> list[Draft]:
        by_id = {id(s): d for s, d in zip(self._batch_seqs, self._drafts)}
        return [by_id.get(id(s), Draft([])) for s in seqs]

    def rollback(self, seq: Sequence) -> None:
        """After the tokens are appended: the target holds valid KV for ``num_computed_tokens``; free any
        block beyond (rejected drafts), and let the draft keep only what matches the sequence."""
        if self.target_blocks.has_seq(seq.request_id):
            self.target_blocks.truncate(seq.request_id, seq.num_computed_tokens)
        self.proposer.rollback(seq, seq.num_tokens - 1)

    def release(self, request_id: object) -> None:
        self.proposer.release(request_id)

    def summary(self) -> dict[str, float | int]:
        s = self.stats
        return {
            "spec_method": self.cfg.method,
            "spec_num_proposed": s.num_proposed,
            "spec_num_accepted": s.num_accepted,
            "spec_acceptance_rate": s.num_accepted / s.num_proposed if s.num_proposed else 0.0,
            "spec_alpha": s.alpha if s.num_proposed else 0.0,
            "spec_mean_tokens_per_forward": s.num_emitted / s.num_verifies if s.num_verifies else 0.0,
            "spec_k": self.k_in_use,
            "spec_k_max": self.cfg.num_speculative_tokens,
            "spec_steps_speculating": s.k_counts.total() - s.k_counts[0],
            "spec_steps": s.k_counts.total(),
            "spec_probes": s.num_probes,
        }


def _beats(speedups, margin: float) -> bool:
    """Did the recent speculative steps beat plain decoding by ``margin``? ``speedups``: each step's tokens per
    second over plain decoding's at its batch size. Why a margin and not just 1 (the module docstring has the
    measurements): a step's speedup overrates the batch's, which ends with its slowest sequence, and the plain
    steps that measure it cost something too."""
    return statistics.fmean(speedups) > margin


def build_speculator(cfg: SpeculativeConfig, draft_model: LlamaForCausalLM | None, target_runner: ModelRunner,
                     target_blocks: BlockManager, vocab_size: int, num_blocks: int, block_size: int) -> Speculator:
    """The proposer ``cfg`` asks for, wired to the target's runner; calibrated now when adaptive."""
    draft_runner = None
    if cfg.method == "draft_model":
        if draft_model is None:
            raise ValueError("method 'draft_model' needs the draft model")
        proposer = DraftModelProposer(draft_model, num_blocks, block_size)
        draft_runner = proposer.runner
    else:
        proposer = NgramProposer(cfg)
    spec = Speculator(cfg, proposer, target_runner, target_blocks, vocab_size, draft_runner)
    if cfg.adaptive:
        spec.calibrate()
    return spec
