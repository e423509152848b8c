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

    B * (1 + h * (E(alpha, k) - 1)) / (t_target(B * (1 + h * k)) + t_draft(B, k))
    E = (1 - alpha^(k+1)) / (1 - alpha)

where ``h`` is the measured fraction of sequences that get drafts at all (1 for a draft model; n-gram lookup often
finds no match), ``alpha`` the measured per-token acceptance (a running estimate) and ``t_target(n)`` the measured
time of a target forward over ``n`` tokens: a table (by powers of two, interpolated) filled by a short
calibration at start-up and refreshed by every pure-decode step. ``k = 0`` (plain decoding) wins unless the
prediction beats it by a margin, so under load — when ``t_target`` grows with the tokens — speculation turns
itself off instead of becoming the 1.4-1.8x slowdown that fixed-k speculation shows at high QPS.

The model can be wrong (a cost table measured on prompt chunks, acceptance that differs between
requests), so measurement has the last word: per batch-size bucket the engine keeps the tokens per second
of its recent whole steps with and without speculation (it mixes in a few plain steps to know both), and
stops speculating in a bucket where the measured speculative steps are not faster.

Limits (documented, not hidden): requests with ``repetition_penalty != 1`` decode without speculation;
with adaptive k, a seeded *sampled* request is distributed exactly as without speculation but its exact
tokens depend on the k chosen each step (timing-based), so set ``"adaptive": False`` for bit-reproducible
seeded sampling.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from minifer.engine.block_manager import BlockManager
from minifer.engine.runner import ModelRunner
from minifer.engine.sequence import Sequence
from minifer.layers.paged_attention import PagedKVCache
from minifer.models.llama import LlamaForCausalLM
from minifer.spec.ngram import ngram_propose
from minifer.spec.rejection import one_hot_draft_probs, probs_from_logits, rejection_sample, verify_greedy
from minifer.spec.theory import expected_tokens_per_forward

METHODS = ("draft_model", "ngram")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: Any = None  # draft: bundled name, local folder, hub id, or an already built LlamaForCausalLM
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    adaptive: bool = True
    margin: float = 1.05  # adaptive: speculate only if predicted >= margin x plain decoding

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


class NgramProposer:
    """Prompt lookup: no model, no cache; a deterministic guess (``q`` is one-hot)."""

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg

    def propose(self, seqs: list[Sequence], ks: list[int], vocab_size: int) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, ks):
            tokens = ngram_propose(seq.all_token_ids, k, self.cfg.prompt_lookup_max, self.cfg.prompt_lookup_min) if k else []
            drafts.append(Draft(tokens, None if seq.params.greedy or not tokens
                                else one_hot_draft_probs([tokens], vocab_size)[0]))
        return drafts

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
                if seq.params.greedy:
                    tok = int(logits[r].argmax())
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
    table is made non-decreasing (more tokens never cost less: a point above a larger ``n``'s is lowered), interpolated linearly in between, and
    extended linearly past the largest ``n`` measured (a compute-bound forward)."""

    def __init__(self, window: int = 9) -> None:
        self.samples: dict[int, deque[float]] = {}
        self.window = window
        self._curve: tuple[list[int], list[float]] | None = None

    def observe(self, n: int, seconds: float) -> None:
        self.samples.setdefault(n, deque(maxlen=self.window)).append(seconds)
        self._curve = None

    def curve(self) -> tuple[list[int], list[float]]:
        if self._curve is None:  # recomputed only after a new measurement (choose_k reads it many times)
            xs = sorted(self.samples)
            ys = [statistics.median(self.samples[x]) for x in xs]
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
    num_emitted: int = 0  # tokens those verifications emitted
    k_counts: Counter[int] = field(default_factory=Counter)  # steps by the k they used (a server runs for days)

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
        self._plain_choices = 0
        # measured tokens/s of whole engine steps by (batch-size bucket, speculated?): the last word on k
        self.realized: dict[tuple[int, bool], deque[tuple[int, float]]] = {}  # (tokens, seconds) per step
        self._step_decodes, self._step_speculated, self._spec_choices, self._overruled = 0, False, 0, 0
        self._asked = self._got = 0  # sequences asked for drafts, and those that got at least one
        self.alpha_prior, self.alpha_weight = 0.6, 8.0  # a prior worth 8 tested tokens until data arrives
        self.calibrated = False
        self.last_draft_s = 0.0

    # --- choosing k ----------------------------------------------------------------------------------

    def calibrate(self, max_tokens: int = 256) -> None:
        """Time target (and draft) forwards over 1, 2, 4, ... tokens once, on a scratch sequence (at
        start-up, while every block is free)."""
        def measure(runner: ModelRunner, table: CostTable) -> None:
            blocks, n = runner.blocks, 1
            counters = blocks.cache_queries, blocks.cache_hits
            while n <= max_tokens and blocks.blocks_needed(n) <= blocks.num_free_blocks:
                blocks.allocate("__calibrate__", [0] * n)
                try:
                    runner.forward(["__calibrate__"], [0], [[0] * n], [n])  # warm-up
                    for _ in range(3):
                        runner.forward(["__calibrate__"], [0], [[0] * n], [n])
                        table.observe(n, runner.last_forward_s)
                finally:
                    blocks.free("__calibrate__")
                n *= 2
            blocks.cache_queries, blocks.cache_hits = counters  # scratch lookups are not cache traffic
        measure(self.target_runner, self.target_cost)
        if self.draft_runner is not None:
            measure(self.draft_runner, self.draft_cost)
        self.calibrated = True

    def alpha_estimate(self) -> float:
        s = self.stats
        tried = s.num_accepted + s.num_rejections
        return (s.num_accepted + self.alpha_prior * self.alpha_weight) / (tried + self.alpha_weight)

    def predicted_rate(self, b: int, k: int, alpha: float, lag: float = 1.0) -> float:
        """Predicted tokens per second of a step of ``b`` decodes with ``k`` drafts each. ``lag``: tokens per
        sequence the draft has not seen yet (its first forward catches up on them: 1-2 after a speculative
        step, more after plain steps, which makes switching back on cost what it really costs)."""
        # Only a fraction `hit` of the sequences asked for drafts get any (n-gram lookup finds no match for
        # the others; a draft model always proposes): they alone add verify tokens and gain tokens.
        hit = (self._got + 4) / (self._asked + 4)  # a prior of 4 hits in 4 until measured
        t = self.target_cost(max(b, round(b + hit * b * k)))
        if k:
            if self.draft_runner is not None:
                t += self.draft_cost(max(1, round(b * lag))) + (k - 1) * self.draft_cost(b)
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
        alpha = self.alpha_estimate()
        base = self.predicted_rate(num_decodes, 0, alpha)
        rates = {k: self.predicted_rate(num_decodes, k, alpha, lag) for k in range(1, k_max + 1)}
        best = max(rates, key=rates.get)
        if rates[best] > base * self.cfg.margin:
            # The model says speculate. Measured steps of this batch size overrule it: keep a few plain
            # steps in the mix (every 8th while fewer than 4 are measured, then every 32nd) and speculate
            # only while the measured speculative steps beat them.
            bucket = num_decodes.bit_length()
            on, off = self.realized.get((bucket, True), ()), self.realized.get((bucket, False), ())
            self._spec_choices += 1
            if self._spec_choices % (8 if len(off) < 4 else 32) == 0:
                return 0, False
            if len(on) >= 8 and len(off) >= 4 and _rate(on) < _rate(off) * self.cfg.margin:
                self._overruled += 1  # every 16th overruled step speculates anyway, to keep `on` current
                return (best, False) if self._overruled % 16 == 0 else (0, False)
            return best, False
        self._plain_choices += 1
        if rates[best] > 0.75 * base and self._plain_choices % self.probe_every == 0:
            return best, True
        return 0, False

    # --- proposing and verifying ----------------------------------------------------------------------

    def propose(self, seqs: list[Sequence], num_new: list[int], token_budget: int) -> list[list[int]] | None:
        """Drafts for the decoding rows of a scheduled step (``num_new == 1`` and prompt complete), with
        target KV slots reserved for them; ``[]`` for other rows. None when nothing speculates."""
        decoding = [i for i, (s, n) in enumerate(zip(seqs, num_new))
                    if n == 1 and s.num_computed_tokens + 1 == s.num_tokens and s.params.repetition_penalty == 1]
        lag = 1.0
        computed = getattr(self.proposer, "computed", None)
        if computed is not None and decoding:  # tokens the draft still has to read, per sequence
            lag = sum(seqs[i].num_tokens - computed.get(seqs[i].request_id, 0) for i in decoding) / len(decoding)
        k, probe = self.choose_k(len(decoding), lag)
        self.k_in_use = 0 if probe else k
        self.stats.k_counts[self.k_in_use] += 1
        self._step_decodes, self._step_speculated = len(decoding), self.k_in_use > 0
        if k == 0 or not decoding:
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
        self.last_draft_s = time.perf_counter() - t0
        if not probe:
            self._asked += sum(1 for k_i in ks if k_i)
            self._got += sum(1 for k_i, d in zip(ks, drafts) if k_i and d.tokens)
        self._batch_seqs, self._drafts = list(seqs), drafts
        return [d.tokens for d in drafts]

    def observe_step(self, num_tokens: int, pure_decode: bool) -> None:
        """Refresh the cost table with the forward just run (pure decode/verify steps only: a prompt chunk in
        the batch would make the step look slower than its token count says)."""
        if pure_decode:
            self.target_cost.observe(num_tokens, self.target_runner.last_forward_s)

    def observe_realized(self, emitted: int, seconds: float) -> None:
        """The tokens a whole pure-decode step emitted and its wall time, by batch-size bucket and by whether
        it speculated: the measurement that overrules the cost model (see ``choose_k``)."""
        if seconds > 0 and self._step_decodes:
            key = (self._step_decodes.bit_length(), self._step_speculated)
            self.realized.setdefault(key, deque(maxlen=16)).append((emitted, seconds))

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
        padded = logits.new_zeros(len(seqs), max_k + 1, vocab)
        for r, k in enumerate(ks):
            padded[r, : k + 1] = logits[offsets[r] : offsets[r + 1]]
        emitted: list[list[int]] = [[] for _ in seqs]
        greedy = [r for r, s in enumerate(seqs) if s.params.greedy]
        sampled = [r for r, s in enumerate(seqs) if not s.params.greedy]
        if greedy:
            out = verify_greedy([drafts[r].tokens for r in greedy], padded[greedy].argmax(-1))
            for r, toks in zip(greedy, out):
                emitted[r] = toks
        if sampled:
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
        }


def _rate(steps) -> float:
    """Tokens per second over recent steps: total tokens / total time. (Not a median of per-step rates: a
    speculative step emits 1 to k+1 tokens, so its per-step rate is spread wide and skewed.)"""
    return sum(t for t, _ in steps) / sum(s for _, s in steps)


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
