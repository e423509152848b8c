"""Exercise 03's pieces in the engine: the learner's preemption and ``schedule_step`` as the scheduler's.

``preempt(running, waiting, blocks)`` has the engine's own signature (``minifer.core.sched.scheduler.preempt_by_recompute``'s),
so the adapter only puts it where the engine looks: a ``Scheduler`` whose ``preempt`` is theirs. The exercise's
``engine_step`` has the engine's signature too, but the engine has no seam for its step (vLLM has none): it is graded
on its own, step by step against minifer's in the toy engine (``grading.toy_engine``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minifer.core.sched.scheduler import Scheduler


def scheduler_with_preemption(preempt: Callable[..., Any]) -> type[Scheduler]:
    """minifer's ``Scheduler``, preempting through the learner's ``preempt`` whenever a running request's blocks run
    out (``Scheduler.preempt_newest`` counts each one)."""

    class LearnersPreemption(Scheduler):
        pass

    LearnersPreemption.preempt = staticmethod(preempt)
    return LearnersPreemption


SPECULATION = ("verify_greedy", "rejection_sample", "ngram_propose", "eagle_forward")


def pieces_for(pieces: dict[str, Any], speculative: bool | None) -> dict[str, Any]:
    """The pieces an engine can run: one that does not speculate has no use for a proposer or a verifier (``LLM``
    refuses them). ``None`` or True: every piece (each serves its own workload)."""
    return {name: piece for name, piece in pieces.items() if speculative is not False or name not in SPECULATION}


def scheduler_seam(pieces: dict[str, Any], scheduler_with: Callable[..., type[Scheduler]]) -> type[Scheduler] | None:
    """The ``Components.scheduler`` exercise 03's pieces fill: the learner's ``schedule_step`` over their preemption,
    either alone, or neither (None)."""
    base = scheduler_with_preemption(pieces["preempt"]) if pieces.get("preempt") else None
    if pieces.get("schedule_step"):
        return scheduler_with(pieces["schedule_step"], base or Scheduler)
    return base
