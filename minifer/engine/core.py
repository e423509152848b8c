"""The engine step (vLLM's ``EngineCore.step``): schedule, run the model, sample, update the scheduler.

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
    ``logprobs``); ``scheduler.update_from_output(batch, sampled, result, tokenizer)`` appends them and frees the
    finished; ``blocks`` is the KV cache manager (speculation rolls drafts back in it); ``tokenizer`` is what
    ``Request.append_token`` checks stop strings with."""

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
    sampled = [batch.seqs[i] for i in rows]  # a prompt chunk before the last one samples nothing
    result = parts.sampler(sampled, logits)
    return parts.scheduler.update_from_output(batch, sampled, result, parts.tokenizer)  # append, cache, free
