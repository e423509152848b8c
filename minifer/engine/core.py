"""The engine step, written from the engine's public parts: schedule, run, sample, append, free.

``LLMEngine.step`` runs this very function every step and adds only what a caller needs around it: the outputs,
the merging of a request's ``n`` completions, the step's timing. Speculation runs it too, through its ``execute``
and ``sampler`` (``engine/spec_step.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minifer.core.kv_cache_manager import KVBlockAllocator
from minifer.core.sched.scheduler import ScheduledBatch, SchedulerPolicy
from minifer.request import Request
from minifer.sample.sampler import Sampler


@dataclass(frozen=True)
class StepParts:
    """What one step works with, all public: ``scheduler.schedule()`` gives the step's ``ScheduledBatch`` (its KV
    slots reserved) and ``scheduler.finish(seq)`` frees a finished sequence's blocks; ``execute(batch)`` runs the
    model and returns ``(rows, logits)``: ``rows`` the indices in ``batch.seqs`` of the sequences whose whole context
    is now computed (a prompt chunk that is not the last one samples nothing), one row of ``logits`` each;
    ``sampler(seqs, logits)`` draws their tokens (``SampleResult``: ``token_ids``, ``sampled_logprob``,
    ``logprobs``); ``blocks.register_computed(seq_id, tokens)`` publishes full computed blocks to the prefix cache;
    ``tokenizer`` is what ``Request.append_token`` checks stop strings with."""

    scheduler: SchedulerPolicy
    execute: Callable[[ScheduledBatch], tuple[list[int], torch.Tensor]]
    sampler: Sampler
    blocks: KVBlockAllocator
    tokenizer: Any = None


def engine_step(parts: StepParts) -> list[Request]:
    """One step: the sequences that got a new token, in the batch's order (empty when nothing was scheduled)."""
    batch = parts.scheduler.schedule()  # who runs, how many tokens each; their blocks reserved, victims preempted
    if not batch.seqs:
        return []
    rows, logits = parts.execute(batch)  # one forward pass over every scheduled token
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n  # their KV is in the cache now
    sampled = [batch.seqs[i] for i in rows]  # a prompt chunk before the last one samples nothing
    result = parts.sampler(sampled, logits)
    for seq, token, logprob, entry in zip(sampled, result.token_ids, result.sampled_logprob, result.logprobs):
        seq.append_token(token, logprob, entry, parts.tokenizer)  # and checks whether it finished
    for seq in batch.seqs:  # full computed blocks join the prefix cache, before a finished one frees them
        parts.blocks.register_computed(seq.request_id, seq.token_slice(0, seq.num_computed_tokens))
    for seq in sampled:
        if seq.is_finished:
            parts.scheduler.finish(seq)  # out of `running`, its blocks back to the allocator
    return sampled
