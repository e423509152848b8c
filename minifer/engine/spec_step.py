"""The engine step with speculation: ``engine_step`` itself, run through two hooks, then the accepted drafts.

Before the forward, the scheduled batch gets drafts (``Speculator.propose``) that the target scores in the same
pass. After it, each sequence emits 1 to ``k + 1`` tokens: the first comes from the row plain decoding samples
from, so ``engine_step`` appends it as its own; the accepted drafts after it are appended here, and the KV of the
rejected ones is rolled back. ``engine_step`` runs unchanged: the engine serves with the very step chapter 03 shows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minifer.core.sched.scheduler import ScheduledBatch
from minifer.engine.core import StepParts, engine_step
from minifer.request import Request
from minifer.sample.sampler import SampleResult, token_logprobs

if TYPE_CHECKING:
    from minifer.engine.speculative import Proposal, Speculator


def speculative_step(parts: StepParts, spec: Speculator) -> list[Request]:
    """One step of ``engine_step`` whose ``execute`` also runs each sequence's drafts (``parts.execute(batch,
    drafts)``) and whose sampler verifies them. Returns the sequences that got tokens."""
    proposal: Proposal | None = None
    emitted: list[list[tuple]] = []

    def execute(batch: ScheduledBatch) -> tuple[list[int], torch.Tensor]:
        nonlocal proposal
        for seq in batch.preempted:  # a preempted sequence recomputes from scratch: its drafts' state goes
            spec.release(seq.request_id)
        budget = parts.scheduler.config.max_num_batched_tokens - sum(batch.num_new_tokens)
        proposal = spec.propose(batch.seqs, batch.num_new_tokens, budget)
        return parts.execute(batch, proposal.drafts if proposal else None)

    def first_tokens(seqs: list[Request], logits: torch.Tensor) -> SampleResult:
        if proposal is None:  # nothing speculated: one token each, nothing for after the step to append
            return parts.sampler(seqs, logits)
        emitted.extend(_verified_entries(seqs, spec.verify(proposal, seqs, logits)))
        return SampleResult([e[0][0] for e in emitted], [e[0][2] for e in emitted], [e[0][1] for e in emitted])

    sampled = engine_step(StepParts(scheduler=parts.scheduler, execute=execute, sampler=first_tokens,
                                    blocks=parts.blocks, tokenizer=parts.tokenizer))
    if proposal is None:  # nothing speculated: engine_step did everything but forget the finished ones' drafts
        for seq in sampled:
            if seq.is_finished:
                spec.release(seq.request_id)
        return sampled
    for seq, tokens in zip(sampled, emitted):
        if seq.is_finished:  # on its first token: engine_step freed its blocks
            spec.release(seq.request_id)
            continue
        for token, logprob, entry in tokens[1:]:
            seq.num_computed_tokens += 1  # the token before this one was an accepted draft: its KV is in the cache
            seq.append_token(token, logprob, entry, parts.tokenizer)
            if seq.is_finished:
                break
        if not seq.is_finished:
            spec.rollback(seq)  # free the blocks that held rejected drafts
        if len(tokens) > 1:  # the accepted drafts' full blocks join the prefix cache too
            parts.blocks.register_computed(seq.request_id, seq.token_slice(0, seq.num_computed_tokens))
        if seq.is_finished:
            parts.scheduler.finish(seq)
            spec.release(seq.request_id)
    return sampled


def _verified_entries(sampled: list[Request], verified: list[tuple[list[int], torch.Tensor]]) -> list[list[tuple]]:
    """Per sequence, (token, logprob, logprobs entry) of each token its verification emitted, computed in one call
    for the whole batch (a log-softmax per sequence costs more than the verification at large batches)."""
    r = token_logprobs(torch.cat([rows for _, rows in verified]), [t for toks, _ in verified for t in toks],
                       [seq.params for seq, (toks, _) in zip(sampled, verified) for _ in toks])
    entries = list(zip(r.token_ids, r.sampled_logprob, r.logprobs))
    emitted, at = [], 0
    for toks, _ in verified:
        emitted.append(entries[at : at + len(toks)])
        at += len(toks)
    return emitted
