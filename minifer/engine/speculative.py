"""Speculative decoding inside continuous batching (chapter 04): fixed k, the reference.

Decode is memory-bandwidth-bound: at small batches a forward over ``k + 1`` new tokens per sequence costs about as
much as one. So each step every decoding sequence brings ``k`` guessed tokens (``num_speculative_tokens``); the
target scores its last token plus the guesses in one forward over the paged cache, and :mod:`minifer.sample.rejection_sampler`
keeps the longest acceptable prefix plus one token of the target's own: 1 to ``k + 1`` tokens, exactly what plain
decoding would give (greedy: the same tokens; sampled: the same distribution). The KV of rejected guesses is rolled
back (``KVCacheManager.truncate``), in the target's cache and the draft's. A step is five moves: propose, verify in one
target forward, accept or reject, roll back, append (``spec_step.py`` runs them inside ``engine_step``).

The proposers (``speculative_config["method"]``, vLLM's names): ``"draft_model"``, a small model with the same
tokenizer and its own paged cache, and ``"ngram"``, prompt lookup (``spec_decode/``); ``"eagle"``, a head reading
the target's hidden states (``spec_decode/eagle.py``).

Because k is fixed, a seeded sampled request draws the same tokens whatever shares its batch: its drafts and its
verification read only its own generator. Adaptive k (``"adaptive": True``, opt-in) chooses k each step from
measured costs; it subclasses ``Speculator`` in ``engine/adaptive_k.py`` and nothing of it runs here.

Limits: requests whose distribution reads their history (penalties, ``min_tokens``: ``SamplingParams.reads_history``)
decode without speculation.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch

from minifer.core.kv_cache_manager import KVBlockAllocator
from minifer.engine.core import StepParts
from minifer.engine.spec_step import speculative_step
from minifer.models.llama import LlamaForCausalLM
from minifer.request import Request
from minifer.sample.rejection_sampler import RejectionVerifier, Verifier, probs_from_logits
from minifer.sample.sampler import Sampler, greedy_argmax
from minifer.spec_decode.draft_model import DraftModelProposer
from minifer.spec_decode.eagle import EagleProposer
from minifer.spec_decode.metadata import Draft, DraftProposer
from minifer.spec_decode.ngram_proposer import NgramProposer
from minifer.worker.model_runner import ModelRunner

METHODS = ("draft_model", "ngram", "eagle")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: Any = None  # draft or EAGLE head: bundled name, local folder (a draft: also a hub id or a built model)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    adaptive: bool = False  # opt-in: choose k each step from measured costs (engine/adaptive_k.py)
    margin: float = 1.1  # adaptive only: speculate only if predicted (and measured) >= margin x plain

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        if set(d) - known:
            raise ValueError(f"speculative_config has unknown keys {sorted(set(d) - known)}; known: {sorted(known)}")
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
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config['adaptive'] must be True or False, got {self.adaptive!r}")
        if not self.margin >= 1:
            raise ValueError(f"margin must be >= 1, got {self.margin}")


@dataclass
class SpecStats:
    num_proposed: int = 0  # draft tokens the target verified
    num_accepted: int = 0
    num_rejections: int = 0  # verifications that stopped at a rejected draft token
    num_verifies: int = 0  # (sequence, step) pairs that speculated
    num_emitted: int = 0  # tokens those verifications emitted
    num_probes: int = 0  # adaptive k only: plain steps in which one sequence speculated (counted in k_counts[0])
    k_counts: Counter[int] = field(default_factory=Counter)  # steps by the k they used (a server runs for days)

    @property
    def alpha(self) -> float:
        """Per-token acceptance, the maximum-likelihood estimate under Leviathan's i.i.d. model: each accepted token
        is a success, each stop at a rejection one failure (drafts after a rejection are never tested, so dividing by
        all proposed tokens would bias it low)."""
        tried = self.num_accepted + self.num_rejections
        return self.num_accepted / tried if tried else float("nan")


@dataclass
class Proposal:
    """What ``propose`` made for a scheduled batch: its sequences and one ``Draft`` per row (no tokens for a row
    that does not speculate), handed to ``verify`` after the forward."""

    seqs: list[Request]
    drafts_of: list[Draft]

    @property
    def drafts(self) -> list[list[int]]:
        """Each row's draft tokens, the extra tokens the target's forward scores (``ModelRunner.execute_model``)."""
        return [d.tokens for d in self.drafts_of]


def decoding_rows(seqs: list[Request], num_new: list[int]) -> list[int]:
    """The rows that may speculate: one new token (their prompt is computed) and a distribution that does not read
    their history (penalties would have to be recomputed after every draft token)."""
    return [i for i, (s, n) in enumerate(zip(seqs, num_new))
            if n == 1 and s.num_computed_tokens + 1 == s.num_tokens and not s.params.reads_history]


class Speculator:
    """Proposes ``k`` drafts for each decoding sequence of a step, verifies them against the target's logits and
    rolls back what was rejected. ``proposer``: a ``DraftProposer``; ``verifier``: a ``Verifier``
    (``RejectionVerifier`` by default); ``sampler``: how rows that may not speculate sample (``ModelRunner.sample``
    by default)."""

    def __init__(self, cfg: SpeculativeConfig, proposer: DraftProposer, target_blocks: KVBlockAllocator,
                 vocab_size: int, verifier: Verifier | None = None, sampler: Sampler | None = None) -> None:
        self.cfg, self.proposer, self.target_blocks, self.vocab_size = cfg, proposer, target_blocks, vocab_size
        self.verifier: Verifier = verifier or RejectionVerifier()
        self.sampler: Sampler = sampler or ModelRunner.sample
        self.stats = SpecStats()
        self.k_in_use = cfg.num_speculative_tokens

    def step(self, parts: StepParts, waiting: Callable[[], int]) -> list[Request]:
        """One engine step with speculation (``spec_step.speculative_step``). ``waiting()``, the requests queued for
        a slot, is for a policy that weighs them (adaptive k); fixed k speculates whatever waits."""
        return speculative_step(parts, self)

    def propose(self, seqs: list[Request], num_new: list[int], token_budget: int) -> Proposal | None:
        """Drafts for the decoding rows of a scheduled step, their target KV slots reserved; None when no row may
        speculate (a step of prompt chunks only). ``token_budget``: tokens the step's forward may still add."""
        rows = decoding_rows(seqs, num_new)
        if not rows:
            return None
        k = self.cfg.num_speculative_tokens
        self.stats.k_counts[k] += 1
        ks = self.reserve(seqs, rows, k, token_budget)
        return Proposal(list(seqs), self.proposer.propose(seqs, ks, self.vocab_size))

    def reserve(self, seqs: list[Request], rows: list[int], k: int, token_budget: int) -> list[int]:
        """Target KV slots for up to ``k`` drafts of each of ``rows``; returns the drafts each row may have: never more
        than the request may still emit, the step's token budget, or the free blocks allow."""
        ks = [0] * len(seqs)
        for i in rows:
            seq = seqs[i]
            want = min(k, seq.max_tokens - len(seq.output_token_ids) - 1, token_budget)
            if want > 0 and self.target_blocks.can_append(seq.request_id, seq.num_tokens + want):
                self.target_blocks.append_slots(seq.request_id, seq.num_tokens + want)
                ks[i] = want
                token_budget -= want
        return ks

    def verify(self, proposal: Proposal, seqs: list[Request],
               logits: torch.Tensor) -> list[tuple[list[int], torch.Tensor]]:
        """``seqs``: the rows that got logits, in order; ``logits``: ``1 + k_i`` rows each. Returns, per sequence, the
        emitted tokens and the logits rows they were drawn from (for logprobs)."""
        by_id = {id(s): d for s, d in zip(proposal.seqs, proposal.drafts_of)}
        drafts = [by_id.get(id(s), Draft([])) for s in seqs]
        ks = [len(d.tokens) for d in drafts]
        max_k, offsets = max(ks), [0, *accumulate(k + 1 for k in ks)]  # row r's logits: offsets[r] .. offsets[r + 1]
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
            for r, toks in zip(greedy, self.verifier.greedy([drafts[r].tokens for r in greedy], top[index])):
                emitted[r] = toks
        if sampled:  # target distributions p [rows, max_k + 1, V] against the drafts' q [rows, max_k, V]
            padded = logits.new_zeros(len(seqs), max_k + 1, logits.shape[-1])
            for r in sampled:
                padded[r, : ks[r] + 1] = logits[offsets[r] : offsets[r + 1]]
            p = probs_from_logits(padded[sampled], [seqs[r].params for r in sampled])
            q = torch.zeros(len(sampled), max(max_k, 1), logits.shape[-1], device=logits.device)
            for j, r in enumerate(sampled):
                if ks[r]:
                    q[j, : ks[r]] = drafts[r].probs
            out = self.verifier.sample([drafts[r].tokens for r in sampled], q, p, [seqs[r].generator for r in sampled])
            for r, toks in zip(sampled, out):
                emitted[r] = toks
        for r, toks in enumerate(emitted):
            if ks[r]:
                self._count_verified(ks[r], len(toks) - 1)
        return [(toks, logits[offsets[r] : offsets[r] + len(toks)]) for r, toks in enumerate(emitted)]

    def _count_verified(self, k: int, accepted: int) -> None:
        """One verified sequence: ``k`` drafts, the first ``accepted`` kept (then one token of the target's own)."""
        s = self.stats
        s.num_proposed += k
        s.num_accepted += accepted
        s.num_rejections += accepted < k
        s.num_verifies += 1
        s.num_emitted += accepted + 1

    def rollback(self, seq: Request) -> None:
        """After the tokens are appended: the target holds valid KV for ``num_computed_tokens``; free any block beyond
        (rejected drafts), and let the proposer keep only what matches the sequence."""
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


def build_proposer(cfg: SpeculativeConfig, draft_model: LlamaForCausalLM | None, target_runner: ModelRunner,
                   num_blocks: int, block_size: int, proposer: DraftProposer | None = None) -> DraftProposer:
    """The proposer ``cfg`` asks for (or ``proposer``, handed in), wired to the target's runner."""
    if proposer is None and cfg.method in ("draft_model", "eagle") and draft_model is None:
        raise ValueError(f"method {cfg.method!r} needs the {'EAGLE head' if cfg.method == 'eagle' else 'draft model'}")
    if proposer is None and cfg.method == "draft_model":
        proposer = DraftModelProposer(draft_model, num_blocks, block_size)
    elif proposer is None and cfg.method == "eagle":
        proposer = EagleProposer(draft_model, target_runner, num_blocks, block_size)
    elif proposer is None:
        proposer = NgramProposer(cfg)
    return proposer
