"""Exercise 03's pieces in the engine: the learner's preemption, ``update_from_output`` and ``schedule_step`` as the
scheduler's.

``preempt(running, waiting, blocks)`` and ``update_from_output(self, batch, sampled, result, tokenizer)`` have the
engine's own signatures (``minifer.core.sched.scheduler``'s ``preempt_by_recompute`` and
``Scheduler.update_from_output``), so the adapter only puts them where the engine looks: a ``Scheduler`` subclass
whose ``preempt`` or ``update_from_output`` is theirs.
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


def scheduler_with_update(update_from_output: Callable[..., Any], base: type[Scheduler] = Scheduler
                          ) -> type[Scheduler]:
    """``base``, updated after every forward pass by the learner's ``update_from_output`` (a method: its first
    parameter is the scheduler)."""

    class LearnersUpdate(base):  # type: ignore[valid-type, misc]
        pass

    LearnersUpdate.update_from_output = update_from_output  # type: ignore[method-assign]
    return LearnersUpdate


SPECULATION = ("verify_greedy", "rejection_sample", "ngram_propose", "eagle_forward")


def pieces_for(pieces: dict[str, Any], speculative: bool | None) -> dict[str, Any]:
    """The pieces an engine can run: one that does not speculate has no use for a proposer or a verifier (``LLM``
    refuses them). ``None`` or True: every piece (each serves its own workload)."""
    return {name: piece for name, piece in pieces.items() if speculative is not False or name not in SPECULATION}


def scheduler_seam(pieces: dict[str, Any], scheduler_with: Callable[..., type[Scheduler]]) -> type[Scheduler] | None:
    """The ``Components.scheduler`` exercise 03's pieces fill: the learner's ``schedule_step`` over their
    ``update_from_output`` over their preemption, any of them alone, or none (None)."""
    base = scheduler_with_preemption(pieces["preempt"]) if pieces.get("preempt") else None
    if pieces.get("update_from_output"):
        base = scheduler_with_update(pieces["update_from_output"], base or Scheduler)
    if pieces.get("schedule_step"):
        return scheduler_with(pieces["schedule_step"], base or Scheduler)
    return base
