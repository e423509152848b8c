"""Speculative decoding inside continuous batching (chapter 04).

Decode is memory-bandwidth-bound: at small batches a forward over ``k + 1`` new tokens per sequence costs about as
much as one. So each step every decoding sequence may bring ``k`` guessed tokens; the target scores its last token
plus the guesses in one forward over the paged cache, and :mod:`minifer.spec.rejection` keeps the longest acceptable
prefix plus one token of the target's own: 1 to ``k + 1`` tokens, exactly what plain decoding would give (greedy:
the same tokens; sampled: the same distribution). The KV of rejected guesses is rolled back
(``BlockManager.truncate``), in the target's cache and the draft's.

The proposers (``speculative_config["method"]``, vLLM's names): ``"draft_model"``, a small model with the same
tokenizer and its own paged cache, and ``"ngram"``, prompt lookup (``proposers.py``); ``"eagle"``, a head reading
the target's hidden states (``features/eagle.py``). Adaptive k (``"adaptive": True``, the default) lives in
``features/adaptive_k.py``, behind the ``KController`` seam; this module proposes, verifies and rolls back, and
with ``"adaptive": False`` speculates ``num_speculative_tokens`` every step.

Limits: requests whose distribution reads their history (penalties, ``min_tokens``:
``SamplingParams.reads_history``) decode without speculation. With adaptive k a seeded *sampled* request is
distributed exactly as without speculation, but its exact tokens depend on the k chosen each step (timing-based):
set ``"adaptive": False`` for bit-reproducible seeded sampling.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from minifer.engine.block_manager import KVBlockAllocator
from minifer.engine.proposers import Draft, DraftModelProposer, DraftProposer, NgramProposer
from minifer.engine.runner import ModelRunner
from minifer.engine.sequence import Sequence
from minifer.models.llama import LlamaForCausalLM
from minifer.sampling import greedy_argmax
from minifer.sampling import Sampler
from minifer.spec.rejection import RejectionVerifier, Verifier, probs_from_logits

if TYPE_CHECKING:
    from minifer.features.eagle import EagleForward

METHODS = ("draft_model", "ngram", "eagle")
MAX_SPECULATIVE_TOKENS = 16

# The seam that replaces ``Speculator.rollback`` (``Components(rollback=...)``): called after a verified sequence's
# emitted tokens are appended, with the speculator (its ``target_blocks`` and ``proposer``), the sequence, the draft
# tokens the target verified for it this step and how many of them it accepted. It must leave the target's block
# table holding exactly the tokens whose KV is valid, and the proposer's cache likewise.
Rollback = Callable[["Speculator", Sequence, list[int], int], None]


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: Any = None  # draft or EAGLE head: bundled name, local folder (a draft: also a hub id or a built model)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    adaptive: bool = True
    margin: float = 1.1  # adaptive: speculate only if predicted (and measured) >= margin x plain

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
        if self.method in ("draft_model", "eagle") and self.model is None:
            raise ValueError(f"method {self.method!r} needs speculative_config['model'] (the draft checkpoint)")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}")
        if not self.margin >= 1:
            raise ValueError(f"margin must be >= 1, got {self.margin}")


@dataclass
class DecodeBatch:
    """The decoding rows of a step, as the controller sees them."""

    seqs: list[Sequence]
    rows: list[int]  # indices into seqs of the sequences that decode this step (one new token, no history reads)
    lag: float = 1.0  # tokens per sequence a draft model has not read yet
    lookup: Callable[[Sequence, int], tuple[list[int], int]] | None = None  # n-gram: (draft, match length) of a row


@dataclass
class Decision:
    """What a step does: ``k`` drafts per decoding sequence (0: plain decoding). A ``probe`` is plain decoding in
    which one sequence speculates to keep the estimates current. ``drafts``: for n-gram speculation, the drafts to
    verify (by row: tokens and the length of the match that found them), looked up before deciding."""

    k: int
    probe: bool = False
    drafts: dict[int, tuple[list[int], int]] | None = None
    held: bool = False  # a held plain decision (``PLAIN_HOLD``): its step is timed only now and then (``LIGHT_EVERY``)


@dataclass
class StepRecord:
    """One step as the controller observes it: filled by the speculator (what it decided and proposed, each verified
    sequence's acceptance) and by the engine (the forward's tokens and time, the whole step's tokens and time)."""

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
    """The seam of adaptive k (``features/adaptive_k.py`` is the reference; ``"adaptive": False`` runs without one).

    ``decide``: a step's ``Decision`` for its decoding rows, ``waiting`` requests queued; ``held_step(b)``: a plain
    decision still held at ``b`` decoding sequences (None: decide afresh), so a held step skips looking at each
    sequence; ``plain_step(n)``: whether the next step, of ``n`` running sequences and none waiting, may run as the
    plain engine's step itself, nothing proposed or recorded (its time then goes to ``observe_plain``);
    ``expected_emitted``: a speculative step's tokens at the estimated acceptance (for ``observe``); ``observe``: the
    step's ``StepRecord`` once it ran; ``calibrate``: time the forwards once, before serving."""

    def decide(self, batch: DecodeBatch, waiting: int = 1) -> Decision: ...
    def held_step(self, num_decodes: int) -> Decision | None: ...
    def plain_step(self, num_running: int) -> bool: ...
    def observe_plain(self, seconds: float) -> None: ...
    def expected_emitted(self, b: int, drafts: list[Draft]) -> float: ...
    def observe(self, r: StepRecord) -> None: ...
    def calibrate(self) -> None: ...


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


@dataclass
class SpecStep:
    """What ``Speculator.propose`` decided for one engine step, handed back to ``verify`` and ``observe``: the
    sequences it saw and their drafts (none when the step decodes plainly), and the step's ``StepRecord``."""

    record: StepRecord
    seqs: list[Sequence] = field(default_factory=list)
    drafts_of: list[Draft] = field(default_factory=list)

    @property
    def drafts(self) -> list[list[int]] | None:
        """Each row's draft tokens (``[]`` for rows without), or None when nothing speculates this step."""
        return [d.tokens for d in self.drafts_of] if self.drafts_of else None


class Speculator:
    """Proposes drafts for the decoding sequences of a step, then verifies the target's logits and rolls back what
    they rejected. ``proposer``: a ``DraftProposer``; ``adaptive``: the adaptive-k controller (None: fixed k);
    ``verifier``: a ``Verifier`` (``RejectionVerifier`` by default); ``sampler``: how rows that may not speculate
    sample (a ``Sampler``, ``ModelRunner.sample`` by default)."""

    def __init__(self, cfg: SpeculativeConfig, proposer: DraftProposer, target_blocks: KVBlockAllocator,
                 vocab_size: int, adaptive: KController | None = None, verifier: Verifier | None = None,
                 sampler: Sampler | None = None, rollback: Rollback | None = None) -> None:
        self.cfg, self.proposer, self.adaptive = cfg, proposer, adaptive
        self.custom_rollback = rollback
        self.verified: dict[object, tuple[list[int], int]] = {}  # a custom rollback's inputs, by request id
        self.verifier: Verifier = verifier or RejectionVerifier()
        self.sampler: Sampler = sampler or ModelRunner.sample
        self.target_blocks, self.vocab_size = target_blocks, vocab_size
        self.stats = SpecStats()
        self.k_in_use = cfg.num_speculative_tokens

    def plain_step(self, num_running: int, num_waiting: int) -> bool:
        """Does the next step run as the plain engine's step, untouched? Only when the adaptive controller holds plain
        decoding at this batch size and nothing waits (``KController.plain_step``); the step counts as k = 0."""
        if self.adaptive is None or num_waiting or not self.adaptive.plain_step(num_running):
            return False
        self.k_in_use = 0
        self.stats.k_counts[0] += 1
        return True

    def propose(self, seqs: list[Sequence], num_new: list[int], token_budget: int, waiting: int = 1) -> SpecStep:
        """Drafts for the decoding rows of a scheduled step (``num_new == 1`` and prompt complete), with target KV
        slots reserved for them; ``[]`` for other rows (``SpecStep.drafts`` is None when nothing speculates).
        ``waiting``: requests queued for a slot (the n-gram controller reads it: ``features/adaptive_ngram.py``)."""
        ctl = self.adaptive
        if ctl is not None and sum(num_new) == len(seqs):
            # the fast path: a pure-decode step at a batch size whose plain decision is held, recognised without
            # looking at each sequence
            held = ctl.held_step(len(seqs))
            if held is not None:
                return SpecStep(self.record_choice(len(seqs), held))
        decoding = [i for i, (s, n) in enumerate(zip(seqs, num_new))
                    if n == 1 and s.num_computed_tokens + 1 == s.num_tokens and not s.params.reads_history]
        if not decoding:  # a step of prompt chunks only: nothing to speculate on, and not a step to count
            return SpecStep(StepRecord())
        b = len(decoding)
        if ctl is not None:
            held = ctl.held_step(b)  # held, in a step with prompt chunks or excluded sequences
            if held is not None:
                return SpecStep(self.record_choice(b, held))
        if ctl is not None and isinstance(self.proposer, NgramProposer):
            return self._propose_looked_up(seqs, decoding, token_budget, waiting)
        lag = 1.0
        computed = getattr(self.proposer, "computed", None)
        if computed is not None:  # tokens the draft still has to read, per sequence
            lag = sum(seqs[i].num_tokens - computed.get(seqs[i].request_id, 0) for i in decoding) / b
        k_max = self.cfg.num_speculative_tokens
        decision = ctl.decide(DecodeBatch(seqs, decoding, lag), waiting) if ctl else Decision(k_max)
        record = self.record_choice(b, decision)
        if decision.k == 0:
            return SpecStep(record)
        ks = [0] * len(seqs)
        for i in decoding[:1] if decision.probe else decoding:
            seq = seqs[i]
            # never more than the request may still emit, the step's token budget, or the free blocks
            want = min(decision.k, seq.max_tokens - len(seq.output_token_ids) - 1, token_budget)
            if want > 0 and self.target_blocks.can_append(seq.request_id, seq.num_tokens + want):
                self.target_blocks.append_slots(seq.request_id, seq.num_tokens + want)
                ks[i] = want
                token_budget -= want
        t0 = time.perf_counter()
        drafts = self.proposer.propose(seqs, ks, self.vocab_size)
        record.draft_s = record.propose_s = time.perf_counter() - t0
        if not decision.probe:
            record.asked = sum(1 for k_i in ks if k_i)
            record.got = sum(1 for k_i, d in zip(ks, drafts) if k_i and d.tokens)
            record.expected = ctl.expected_emitted(b, drafts) if ctl else None
        return SpecStep(record, list(seqs), drafts)

    def _propose_looked_up(self, seqs: list[Sequence], decoding: list[int], token_budget: int,
                           waiting: int) -> SpecStep:
        """``propose`` for adaptive n-gram speculation: the drafts are found before k is chosen."""
        t0 = time.perf_counter()
        decision = self.adaptive.decide(DecodeBatch(seqs, decoding, lookup=self.proposer.lookup), waiting)
        record = self.record_choice(len(decoding), decision)
        step = SpecStep(record)
        if decision.drafts:
            drafts = [Draft([]) for _ in seqs]
            for i, (tokens, n) in decision.drafts.items():
                seq = seqs[i]
                tokens = tokens[:max(token_budget, 0)]
                if tokens and self.target_blocks.can_append(seq.request_id, seq.num_tokens + len(tokens)):
                    self.target_blocks.append_slots(seq.request_id, seq.num_tokens + len(tokens))
                    drafts[i] = NgramProposer.draft(seq, tokens, n, self.vocab_size)
                    token_budget -= len(tokens)
            record.draft_s = time.perf_counter() - t0
            if not decision.probe:
                record.expected = self.adaptive.expected_emitted(len(decoding), drafts)
            step = SpecStep(record, list(seqs), drafts)
        record.propose_s = time.perf_counter() - t0
        return step

    def record_choice(self, b: int, decision: Decision) -> StepRecord:
        """This step's choice, in ``stats`` and in a fresh record: ``b`` decoding sequences, ``decision.k`` drafts each
        (a probe counts as k = 0: it is plain decoding plus one sequence's measurement)."""
        self.k_in_use = 0 if decision.probe else decision.k
        self.stats.k_counts[self.k_in_use] += 1
        self.stats.num_probes += decision.probe
        return StepRecord(decodes=b, k=self.k_in_use, probe=decision.probe, held=decision.held)

    def observe(self, step: SpecStep, forward_tokens: int, forward_s: float, pure_decode: bool, emitted: int,
                seconds: float) -> None:
        """The step ran: its target forward covered ``forward_tokens`` in ``forward_s``, and the whole step emitted
        ``emitted`` tokens in ``seconds``. The adaptive controller learns from it; a fixed-k speculator has nothing
        to learn."""
        if self.adaptive is None:
            return
        r = step.record
        r.forward_tokens, r.forward_s, r.pure_decode, r.emitted, r.seconds = (forward_tokens, forward_s, pure_decode,
                                                                              emitted, seconds)
        self.adaptive.observe(r)

    def verify(self, step: SpecStep, seqs: list[Sequence],
               logits: torch.Tensor) -> list[tuple[list[int], torch.Tensor]]:
        """``step``: what ``propose`` returned; ``seqs``: the rows that got logits, in order; ``logits``: ``1 + k_i``
        rows each. Returns, per sequence, the emitted tokens and the logits rows they were drawn from (for logprobs).
        Each verified sequence's acceptance goes into ``step.record`` for the controller."""
        by_id = {id(s): d for s, d in zip(step.seqs, step.drafts_of)}
        drafts = [by_id.get(id(s), Draft([])) for s in seqs]
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
            drawn = self.sampler([seqs[r] for r in plain], logits[[offsets[r] for r in plain]])
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
            out = self.verifier.greedy([drafts[r].tokens for r in greedy], top[index])
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
            out = self.verifier.sample([drafts[r].tokens for r in sampled], q, p, [seqs[r].generator for r in sampled])
            for r, toks in zip(sampled, out):
                emitted[r] = toks
        for r, toks in enumerate(emitted):
            if ks[r]:
                self._count_verified(step.record, ks[r], len(toks) - 1, drafts[r].match_len)
            if self.custom_rollback is not None:
                self.verified[seqs[r].request_id] = (drafts[r].tokens, len(toks) - 1)
        return [(toks, logits[offsets[r] : offsets[r] + len(toks)]) for r, toks in enumerate(emitted)]

    def _count_verified(self, record: StepRecord, k: int, accepted: int, match_len: int) -> None:
        """One verified sequence: ``k`` drafts, the first ``accepted`` kept (then one token of the target's own)."""
        s = self.stats
        s.num_proposed += k
        s.num_accepted += accepted
        s.num_rejections += accepted < k
        s.num_verifies += 1
        s.num_emitted += accepted + 1
        record.acceptances.append((accepted, accepted < k, match_len))
        if match_len:
            s.match_accepted[match_len] += accepted
            s.match_rejections[match_len] += accepted < k

    def rollback(self, seq: Sequence) -> None:
        """After the tokens are appended: the target holds valid KV for ``num_computed_tokens``; free any
        block beyond (rejected drafts), and let the draft keep only what matches the sequence."""
        if self.custom_rollback is not None:
            self.custom_rollback(self, seq, *self.verified.pop(seq.request_id, ([], 0)))
            return
        if self.target_blocks.has_seq(seq.request_id):
            self.target_blocks.truncate(seq.request_id, seq.num_computed_tokens)
        self.proposer.rollback(seq, seq.num_tokens - 1)

    def release(self, request_id: object) -> None:
        self.verified.pop(request_id, None)
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


def build_speculator(cfg: SpeculativeConfig, draft_model: LlamaForCausalLM | None, target_runner: ModelRunner,
                     target_blocks: KVBlockAllocator, vocab_size: int, num_blocks: int, block_size: int, *,
                     proposer: DraftProposer | None = None, verifier: Verifier | None = None,
                     sampler: Sampler | None = None, rollback: Rollback | None = None,
                     eagle_forward: EagleForward | None = None) -> Speculator:
    """The proposer ``cfg`` asks for (or ``proposer``, handed in), wired to the target's runner; calibrated now when
    adaptive. ``eagle_forward`` replaces the EAGLE head's forward (method ``"eagle"`` only)."""
    if eagle_forward is not None and (cfg.method != "eagle" or proposer is not None):
        raise ValueError("eagle_forward is the forward of the EAGLE head that speculative_config method 'eagle' "
                         f"builds; this engine speculates with {'a proposer handed in' if proposer else cfg.method!r}")
    if proposer is None and cfg.method == "draft_model":
        if draft_model is None:
            raise ValueError("method 'draft_model' needs the draft model")
        proposer = DraftModelProposer(draft_model, num_blocks, block_size)
    elif proposer is None and cfg.method == "eagle":
        if draft_model is None:
            raise ValueError("method 'eagle' needs the EAGLE head")
        from minifer.features.eagle import EagleProposer

        proposer = EagleProposer(draft_model, target_runner, num_blocks, block_size, eagle_forward)
    elif proposer is None:
        proposer = NgramProposer(cfg)
    draft_runner = getattr(proposer, "runner", None)  # a draft model's: its forwards are timed too
    adaptive = None
    if cfg.adaptive:
        from minifer.features.adaptive_k import AdaptiveK
        from minifer.features.adaptive_ngram import NgramAdaptiveK

        controller = NgramAdaptiveK if isinstance(proposer, NgramProposer) else AdaptiveK
        adaptive = controller(cfg, target_runner, draft_runner, getattr(proposer, "cost", None))
        adaptive.calibrate()
    return Speculator(cfg, proposer, target_blocks, vocab_size, adaptive, verifier, sampler, rollback)
