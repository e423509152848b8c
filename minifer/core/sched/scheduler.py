"""Iteration-level (continuous) batching: decide, before every forward pass, which tokens of which
requests it computes.

Static batching admits a batch, runs it until its longest request ends, and only then admits the next.
Continuous batching (Orca, OSDI 2022) re-decides at *every step*: a finished request's slot is refilled
at the next step. Before every forward pass, ``schedule()`` decides:

1. every running request gets its next token(s): one decode token, or the next chunk of a prompt;
2. if the KV blocks for that run out, the *newest* running request is preempted — its blocks are freed
   and it goes back to the front of the waiting queue, to be recomputed later (vLLM's "recompute"
   preemption: nothing is lost, its tokens so far become its prompt);
3. waiting requests are admitted first-come-first-served while ``max_num_seqs`` sequences and
   ``max_num_batched_tokens`` tokens allow. With chunked prefill a long prompt is split across steps
   and shares them with decodes instead of stalling them. The completions of one ``n > 1`` request take at
   most half the slots while another request waits.

After it, ``update_from_output()`` (the scheduler's other half, as in vLLM) counts the scheduled tokens as
computed, appends the sampled tokens, publishes full computed blocks to the prefix cache and frees the requests
that finished.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from minifer.core.kv_cache_manager import KVBlockAllocator, cdiv
from minifer.request import Request, RequestStatus

if TYPE_CHECKING:
    from minifer.sample.sampler import SampleResult


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class ScheduledBatch:
    seqs: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class SchedulerPolicy(Protocol):
    """The seam between the engine and the policy that decides who runs each step (chapter 03); ``Scheduler`` below is
    the reference (first come first served, chunked prefill, preemption by recomputation). The engine builds one
    (``LLMEngine``'s ``scheduler``: a callable ``(SchedulerConfig, KVBlockAllocator)``, ``Scheduler`` by default).

    ``add(seq)`` queues a new sequence, ``add_front(seqs)`` queues sequences ahead of the others (siblings of a
    request whose prompt is computed). ``schedule()`` returns the step's ``ScheduledBatch``: the sequences that run,
    how many new tokens each brings (at most ``config.max_num_batched_tokens`` in all, at most
    ``config.max_num_seqs`` sequences), with their KV slots already reserved in the allocator, and the sequences it
    preempted (their blocks freed, to be recomputed later). ``update_from_output(batch, sampled, result, tokenizer)``
    runs after the forward pass: the scheduled tokens are computed, ``sampled`` get ``result``'s tokens, finished
    sequences leave; it returns ``sampled``. ``finish(seq)`` and ``abort(seq)`` take a sequence out and free its
    blocks. ``check_fits(seq)`` raises ``ValueError`` for a request that could never be scheduled.
    ``running``, ``waiting`` and ``num_preemptions`` are read for statistics; ``has_unfinished()`` says whether any
    sequence is still queued or running. Every admitted sequence must eventually be scheduled: a step that schedules
    nothing while sequences wait makes the engine raise."""

    config: SchedulerConfig
    waiting: Any
    running: list[Request]
    num_preemptions: int

    def check_fits(self, seq: Request) -> None: ...

    def add(self, seq: Request) -> None: ...

    def add_front(self, seqs: list[Request]) -> None: ...

    def has_unfinished(self) -> bool: ...

    def abort(self, seq: Request) -> None: ...

    def finish(self, seq: Request) -> None: ...

    def schedule(self) -> ScheduledBatch: ...

    def update_from_output(self, batch: ScheduledBatch, sampled: list[Request], result: SampleResult,
                           tokenizer: Any = None) -> list[Request]: ...


def preempt_by_recompute(running: list[Request], waiting: deque[Request], blocks: KVBlockAllocator) -> Request:
    """Preempt the newest running sequence by recomputation (vLLM's default) and return it.

    The newest has the least work to lose, and the oldest, which have waited longest, keep making progress: the
    queue stays first come first served and nothing starves. Its blocks are freed outright (nothing is swapped out),
    so its KV must be computed again: ``num_computed_tokens`` goes back to 0 and its tokens so far, generated ones
    included, become the prompt it is re-admitted with (``all_token_ids``); nothing it generated is lost. It goes to
    the *front* of the waiting queue: it arrived before every request still waiting."""
    victim = running.pop()
    blocks.free(victim.request_id)
    victim.status, victim.num_computed_tokens = RequestStatus.WAITING, 0
    waiting.appendleft(victim)
    return victim


Preemption = Callable[[list[Request], "deque[Request]", KVBlockAllocator], Request]


class Scheduler:
    # Who is preempted and how, when a running sequence's blocks run out (a class attribute, so that a subclass, such
    # as a course's, replaces only this): ``preempt(running, waiting, blocks)`` takes one sequence out of ``running``,
    # frees its blocks, requeues it, and returns it.
    preempt: Preemption = staticmethod(preempt_by_recompute)

    def __init__(self, config: SchedulerConfig, blocks: KVBlockAllocator) -> None:
        self.config, self.blocks = config, blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def check_fits(self, seq: Request) -> None:
        """Reject up front a request that could never run, instead of letting it wait forever."""
        need = cdiv(len(seq.prompt_token_ids) + seq.max_tokens, self.blocks.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request {seq.request_id!r} needs up to {need} KV blocks "
                             f"({len(seq.prompt_token_ids)} prompt + {seq.max_tokens} output tokens) but the whole "
                             f"cache has {self.blocks.num_blocks}: lower max_tokens or give the cache more memory")
        if not self.config.enable_chunked_prefill and len(seq.prompt_token_ids) > self.config.max_num_batched_tokens:
            raise ValueError(f"request {seq.request_id!r} has a {len(seq.prompt_token_ids)}-token prompt, more than "
                             f"max_num_batched_tokens={self.config.max_num_batched_tokens} without chunked prefill")

    def add(self, seq: Request) -> None:
        self.check_fits(seq)
        seq.status = RequestStatus.WAITING
        self.waiting.append(seq)

    def add_front(self, seqs: list[Request]) -> None:
        """Queue ``seqs`` ahead of every waiting request, in their order (siblings of a request already
        admitted: parallel sampling's completions, ``ParentRequest``)."""
        for seq in seqs:
            self.check_fits(seq)
        for seq in reversed(seqs):
            seq.status = RequestStatus.WAITING
            self.waiting.appendleft(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Request) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.blocks.has_seq(seq.request_id):
            self.blocks.free(seq.request_id)

    def finish(self, seq: Request) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)

    def preempt_newest(self, batch: ScheduledBatch) -> Request:
        """Preempt one running sequence through ``preempt`` (the newest, by default), and count it."""
        victim = self.preempt(self.running, self.waiting, self.blocks)
        if victim in self.running:  # it would be chosen again and again: the step would never end
            raise RuntimeError(f"preempt returned {victim.request_id!r} but left it running")
        victim.num_preemptions += 1
        self.num_preemptions += 1
        batch.preempted.append(victim)
        return victim

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self._yield_half(batch)
        # 1. running requests, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.can_append(seq.request_id, seq.num_computed_tokens + n):
                victim = self.preempt_newest(batch)
                if victim is seq:
                    break
            if seq.status is not RequestStatus.RUNNING:
                break  # it preempted itself: nothing newer is left to run
            self.blocks.append_slots(seq.request_id, seq.num_computed_tokens + n)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            i += 1
        # 2. admit waiting requests first-come-first-served (never past a preemption in this step)
        i = 0  # the first waiting request not passed over
        while (i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs
               and not batch.preempted):
            seq = self.waiting[i]
            if self._over_half(seq):
                i += 1  # its request's other completions hold half the slots, and another request waits
                continue
            tokens = seq.all_token_ids
            use_cache = not seq.needs_prompt_logprobs
            if not self.blocks.can_allocate(tokens, use_cache):
                break
            if not self.config.enable_chunked_prefill and len(tokens) > budget:
                break
            del self.waiting[i]
            cached = self.blocks.allocate(seq.request_id, tokens, use_cache)
            seq.num_computed_tokens = cached
            n = min(len(tokens) - cached, budget)
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _yield_half(self, batch: ScheduledBatch) -> None:
        """Every slot is taken, a request waits, and one request's completions hold more than half the slots (they
        were admitted while nobody else waited): preempt its newest completions down to half, so that the waiting
        request is admitted at the next step instead of after them. They recompute when their turn comes."""
        half = max(1, self.config.max_num_seqs // 2)
        if len(self.running) < self.config.max_num_seqs or not self.waiting:
            return
        counts = Counter(s.parent_id for s in self.running if s.parent_id is not None)
        for parent, count in counts.items():
            if count > half and any(w.parent_id != parent for w in self.waiting):
                for seq in [s for s in reversed(self.running) if s.parent_id == parent][:count - half]:
                    self.running.remove(seq)
                    self.running.append(seq)  # the newest now: ``preempt`` takes the newest
                    self.preempt_newest(batch)

    def _over_half(self, seq: Request) -> bool:
        """Whether ``seq`` is a completion of an ``n > 1`` request whose completions already run in half the slots
        while another request waits: one request's choices never crowd the others out (the waiting one is admitted
        past them; the rest of the completions follow as slots free up)."""
        if seq.parent_id is None:
            return False
        mine = sum(s.parent_id == seq.parent_id for s in self.running)
        return mine >= max(1, self.config.max_num_seqs // 2) and any(s.parent_id != seq.parent_id for s in self.waiting)

    def update_from_output(self, batch: ScheduledBatch, sampled: list[Request], result: SampleResult,
                           tokenizer: Any = None) -> list[Request]:
        """After the forward pass over ``batch``: ``sampled`` (the sequences whose whole context is now computed, in
        the batch's order) drew ``result``'s tokens. Returns ``sampled``.

        The order matters. The scheduled tokens' KV is in the cache, so they count as computed first (or the next
        step would compute them again); each sampled token is appended, and ``append_token`` decides whether its
        sequence finished (stop token, stop string through ``tokenizer``, length). Full computed blocks join the
        prefix cache before a finished sequence frees them, so a later request with the same prefix reuses them."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        for seq, token, logprob, entry in zip(sampled, result.token_ids, result.sampled_logprob, result.logprobs):
            seq.append_token(token, logprob, entry, tokenizer)
        for seq in batch.seqs:
            self.blocks.register_computed(seq.request_id, seq.token_slice(0, seq.num_computed_tokens))
        for seq in sampled:
            if seq.is_finished:
                self.finish(seq)
        return sampled
