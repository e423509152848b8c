"""The engine step with speculation: ``engine_step`` itself, run through two hooks, then the accepted drafts.

Before the forward, the scheduled batch gets drafts (``Speculator.propose``) that the target scores in the same
pass. After it, each sequence emits 1 to ``k + 1`` tokens: the first comes from the row plain decoding samples
from, so ``engine_step`` appends it as its own; the accepted drafts after it are appended here, and the KV of the
rejected ones is rolled back. ``engine_step`` runs unchanged: the engine serves with the very step chapter 03 shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minifer.engine.scheduler import ScheduledBatch
from minifer.engine.sequence import Sequence
from minifer.engine.speculative import SpecStep, Speculator
from minifer.engine.step import StepParts, engine_step
from minifer.sampling import SampleResult, token_logprobs


@dataclass
class SpeculativeStepResult:
    """What the step did, for the engine's outputs and the adaptive controller's ``observe``: the sequences that
    got tokens, and (None when nothing was scheduled) the step's plan, the tokens its forward covered, whether it
    was pure decode and how many tokens verification emitted."""

    sampled: list[Sequence]
    plan: SpecStep | None = None
    forward_tokens: int = 0
    pure_decode: bool = False
    emitted: int = 0


def speculative_step(parts: StepParts, spec: Speculator, waiting: Callable[[], int]) -> SpeculativeStepResult:
    """One step of ``engine_step`` whose ``execute`` also runs each sequence's drafts (``parts.execute(batch,
    drafts)``) and whose sampler verifies them. ``waiting()``: the requests queued for a slot once the batch is
    scheduled (the adaptive controller weighs them). While adaptive k holds plain decoding, the step is
    ``engine_step`` itself, only a check and a clock around it: a held step costs what a plain engine's does."""
    scheduler = parts.scheduler
    running = len(scheduler.running)
    if spec.plain_step(running, waiting()):
        start = time.perf_counter()
        sampled = engine_step(parts)
        if len(scheduler.running) != running:  # some finished (nothing waited to join): their draft state goes too
            for seq in sampled:
                if seq.is_finished:
                    spec.release(seq.request_id)
        spec.adaptive.observe_plain(time.perf_counter() - start)
        return SpeculativeStepResult(sampled)
    out = SpeculativeStepResult([])
    emitted: list[list[tuple]] = []

    def execute(batch: ScheduledBatch) -> tuple[list[int], torch.Tensor]:
        for seq in batch.preempted:  # a preempted sequence recomputes from scratch: its drafts' state goes
            spec.release(seq.request_id)
        new_tokens = sum(batch.num_new_tokens)
        budget = parts.scheduler.config.max_num_batched_tokens - new_tokens
        out.plan = spec.propose(batch.seqs, batch.num_new_tokens, budget, waiting())
        drafts = out.plan.drafts
        out.forward_tokens = new_tokens + (sum(len(d) for d in drafts) if drafts else 0)
        out.pure_decode = new_tokens == len(batch.num_new_tokens)  # every row brings one token (each brings >= 1)
        return parts.execute(batch, drafts)

    def first_tokens(seqs: list[Sequence], logits: torch.Tensor) -> SampleResult:
        if out.plan.drafts is None:  # plain decoding: one token each, nothing for after the step to append
            r = parts.sampler(seqs, logits)
            out.emitted = len(r.token_ids)
            return r
        emitted.extend(_verified_entries(seqs, spec.verify(out.plan, seqs, logits)))
        return SampleResult([e[0][0] for e in emitted], [e[0][2] for e in emitted], [e[0][1] for e in emitted])

    out.sampled = engine_step(StepParts(scheduler=scheduler, execute=execute, sampler=first_tokens, blocks=parts.blocks,
                                        tokenizer=parts.tokenizer))
    if out.plan is None or out.plan.drafts is None:  # plain decoding: one token each, nothing to append or roll back
        for seq in out.sampled:
            if seq.is_finished:
                spec.release(seq.request_id)
        return out
    out.emitted = sum(len(tokens) for tokens in emitted)
    for seq, tokens in zip(out.sampled, emitted):
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
    return out


def _verified_entries(sampled: list[Sequence], verified: list[tuple[list[int], torch.Tensor]]) -> list[list[tuple]]:
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
