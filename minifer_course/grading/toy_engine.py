"""A model-free engine for grading exercise 03's engine step and preemption: minifer's real ``Scheduler``,
``KVCacheManager``, ``Request`` and sampler around a toy model whose KV cache is a table of token ids.

The toy runner writes each scheduled token into its cache slot (through the sequence's block table, as the real
runner does) and derives a sequence's next-token logits from the context it reads back through that table. So a
step or a preemption that gets the bookkeeping wrong changes the tokens, as it would on the real model: reading
blocks that were freed and rewritten, running a sequence whose blocks were not reserved, or calling a preempted
sequence's KV computed when its blocks are gone. It runs in milliseconds and the same on every machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minifer.core.kv_cache_manager import KVCacheManager
from minifer.core.sched.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from minifer.engine.core import StepParts
from minifer.request import Request
from minifer.sampling_params import SamplingParams
from minifer.worker.model_runner import ModelRunner

VOCAB = 64


class ToyRunner:
    """``execute(batch) -> (rows, logits)`` with the real runner's contract, over a KV cache of token ids."""

    def __init__(self, blocks: KVCacheManager) -> None:
        self.blocks = blocks
        self.kv: dict[int, int] = {}  # slot -> the token whose "keys and values" it holds

    def slot(self, seq_id: str, position: int) -> int:
        table, bs = self.blocks.block_table(seq_id), self.blocks.block_size
        if position // bs >= len(table):
            raise AssertionError(f"the forward pass reached position {position} of {seq_id!r}, past its blocks: the "
                                 "scheduler reserves them in schedule(); run only what it scheduled")
        return table[position // bs] * bs + position % bs

    def execute(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor]:
        rows, logits = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, tokens = seq.num_computed_tokens, seq.all_token_ids
            for p in range(start, start + n):
                self.kv[self.slot(seq.request_id, p)] = tokens[p]
            if start + n == len(tokens):  # its whole context is computed: it samples
                context = [self.kv.get(self.slot(seq.request_id, p), -1) for p in range(start + n)]
                rows.append(i)
                logits.append(self.logits(context))
        return rows, torch.stack(logits) if logits else torch.zeros(0, VOCAB)

    @staticmethod
    def logits(context: list[int]) -> torch.Tensor:
        """A deterministic function of the whole context (so a wrong KV entry anywhere changes the next token)."""
        h = 17
        for t in context:
            h = (h * 1_000_003 + t + 1) % 2_147_483_647
        gen = torch.Generator().manual_seed(h)
        return torch.randn(VOCAB, generator=gen) * 3


@dataclass
class World:
    """One engine's state: its scheduler, allocator, runner, sequences, and the parts a step receives."""

    scheduler: Scheduler
    blocks: KVCacheManager
    runner: ToyRunner
    seqs: list[Request]

    @property
    def parts(self) -> StepParts:
        return StepParts(self.scheduler, self.runner.execute, _sampler, self.blocks, None)


def _sampler(seqs: list[Request], logits: torch.Tensor):
    """minifer's sampler, refusing the classic mismatch with a hint rather than an index error deep inside it."""
    if len(seqs) != logits.shape[0]:
        raise AssertionError(f"the sampler got {len(seqs)} sequences and {logits.shape[0]} rows of logits\nhint: "
                             "sample only the sequences of `rows` ([batch.seqs[i] for i in rows]): a prompt chunk "
                             "before its last one has no logits")
    return ModelRunner.sample(seqs, logits)


def build_world(prompts: list[list[int]], max_tokens: list[int], num_blocks: int, block_size: int = 4,
                max_num_seqs: int = 8, token_budget: int = 64, sampled: bool = False, eos: int | None = None,
                scheduler: type[Scheduler] = Scheduler, prefix_caching: bool = True) -> World:
    """Requests queued in a fresh toy engine (``sampled``: temperature 1 with a seed per request, else greedy)."""
    blocks = KVCacheManager(num_blocks, block_size, prefix_caching)
    sched = scheduler(SchedulerConfig(max_num_seqs, token_budget), blocks)
    seqs = []
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(temperature=1.0 if sampled else 0.0, max_tokens=m, seed=i if sampled else None,
                                ignore_eos=eos is None)
        gen = torch.Generator().manual_seed(i) if sampled else None
        seq = Request(request_id=f"r{i}", prompt=None, prompt_token_ids=list(prompt), params=params, max_tokens=m,
                       eos_token_ids=frozenset() if eos is None else frozenset({eos}), generator=gen)
        sched.add(seq)
        seqs.append(seq)
    return World(sched, blocks, ToyRunner(blocks), seqs)


def snapshot(world: World) -> dict[str, object]:
    """What a step may change, by name, for comparing two engines after each step."""
    s = world.scheduler
    return {"tokens": {q.request_id: list(q.output_token_ids) for q in world.seqs},
            "num_computed_tokens": {q.request_id: q.num_computed_tokens for q in world.seqs},
            "finished": sorted(q.request_id for q in world.seqs if q.is_finished),
            "running": [q.request_id for q in s.running], "waiting": [q.request_id for q in s.waiting],
            "free_blocks": world.blocks.num_free_blocks, "cached_blocks": world.blocks.num_cached_blocks,
            "preemptions": s.num_preemptions}


def run_to_end(world: World, step: Callable[[StepParts], list[Request]], max_steps: int = 400
               ) -> list[dict[str, object]]:
    """Step until every request finished; the snapshot after each step."""
    history = []
    for _ in range(max_steps):
        if not world.scheduler.has_unfinished():
            return history
        step(world.parts)
        history.append(snapshot(world))
    raise AssertionError(f"the requests were not finished after {max_steps} steps")
