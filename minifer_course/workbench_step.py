"""Exercise 03's pieces in the engine: the learner's preemption as the scheduler's, their engine step as the engine's.

Both exercises have the engine's own signatures (``preempt(running, waiting, blocks)`` is
``minifer.core.sched.scheduler.preempt_by_recompute``'s, ``engine_step(parts)`` is ``minifer.engine.core.engine_step``'s),
so the adapters only put them where the engine looks: a ``Scheduler`` whose ``preempt`` is theirs, and
``Components.step``. A given step runs only where the engine does not speculate (speculation's step is the engine's
own), so the capstone hands it to its plain batch and not to the speculative ones (``pieces_for``).
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


SPECULATION = ("verify_greedy", "rejection_sample", "ngram_propose", "rollback", "eagle_forward")


def pieces_for(pieces: dict[str, Any], speculative: bool | None) -> dict[str, Any]:
    """The pieces an engine can run: one that speculates runs its own step, not the learner's; one that does not has
    no use for a proposer or a verifier (``LLM`` refuses them). ``None``: every piece (each serves its own workload)."""
    unused = {True: ("engine_step",), False: SPECULATION, None: ()}[speculative]
    return {name: piece for name, piece in pieces.items() if name not in unused}


def step_seams(pieces: dict[str, Any], scheduler_with: Callable[..., type[Scheduler]]) -> dict[str, Any]:
    """The ``Components`` fields exercise 03's pieces fill: the scheduler (the learner's ``schedule_step`` over their
    preemption, either alone, or neither) and the step."""
    base = scheduler_with_preemption(pieces["preempt"]) if pieces.get("preempt") else None
    if pieces.get("schedule_step"):
        scheduler = scheduler_with(pieces["schedule_step"], base or Scheduler)
    else:
        scheduler = base
    return {"scheduler": scheduler, "step": pieces.get("engine_step")}
