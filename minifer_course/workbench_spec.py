"""Chapter 04's speculative pieces beside the engine: the rollback's picture of the KV, and the EAGLE head's workload.

* ``KVView``, the exercise's picture of one model's paged KV for one sequence: the learner's
  ``rollback(token_ids, k, accepted, target, draft)`` cuts it. The engine has no seam for a rollback (vLLM has none:
  it is part of the proposer and the KV cache manager), so the rollback is graded on its own
  (``grading.spec_step.check_rollback``, against minifer's rule on fixed and random steps);
* the EAGLE head's workload (``EagleWorkload``: the shipped head, whose class the engine builds from the learner's
  forward, ``workbench.model_registry``), and the checks only a served engine can make: no KV block is left allocated
  once every request has finished, and the learner's head accepts as many drafts as minifer's.

The engine core never imports this module; ``workbench`` and the graders do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EAGLE_SPEC = {"method": "eagle", "model": "tinystories-target-eagle", "num_speculative_tokens": 4, "adaptive": False}
# How far the learner's head's acceptance rate may sit from minifer's on the same greedy requests. The two heads
# compute the same function; float32 rounding in another order can flip a near-tie argmax, and a flip changes the
# drafts of the rest of that step only: a handful of drafts in the ~400 a run verifies.
ALPHA_TOLERANCE = 0.02


@dataclass
class KVView:
    """One model's paged KV cache for one sequence, as the rollback exercise sees it: ``num_tokens`` positions hold
    KV, in the blocks of ``block_table`` (``block_size`` slots each, the last one possibly part-full); a block the
    sequence no longer needs goes back to the pool by being appended to ``free_blocks``."""

    num_tokens: int
    block_table: list[int]
    block_size: int
    free_blocks: list[int]


@dataclass(frozen=True)
class SpecWorkload:
    """Greedy requests served with ``speculative_config`` (``spec``: its items, so the workload stays hashable and
    the reference engine's tokens are computed once); the same interface as ``workbench.Workload``."""

    spec: tuple[tuple[str, Any], ...]
    max_tokens: int = 16
    sampled: bool = False
    speculative: bool = True  # as ``workbench.Workload``'s: the engine speculates

    def params(self):
        from minifer import SamplingParams

        return SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)

    @property
    def speculative_config(self) -> dict[str, Any]:
        return dict(self.spec)

    def options(self) -> dict[str, Any]:
        return {"speculative_config": self.speculative_config}

    def describe(self) -> str:
        s = self.speculative_config
        return (f"8 requests, {self.max_tokens} tokens each, greedy, speculating with {s['model']} "
                f"(k = {s['num_speculative_tokens']})")

    def engine_checks(self, served: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
        """What only the served engine shows: every KV block back in its pool once the requests are done."""
        def no_leaks() -> None:
            engine = served["llm"].engine
            pools = [("target", engine.kv_cache_manager)]
            draft_blocks = getattr(engine.speculator.proposer, "blocks", None)
            if draft_blocks is not None:
                pools.append(("draft", draft_blocks))
            for which, blocks in pools:
                held = blocks.num_blocks - blocks.num_free_blocks
                if held:
                    raise AssertionError(f"{held} of the {which}'s {blocks.num_blocks} KV blocks are still allocated "
                                         f"after every request finished")

        return [("every KV block is free again when the requests are done (no leak)", no_leaks)]


@dataclass(frozen=True)
class EagleWorkload(SpecWorkload):
    """``SpecWorkload`` with the shipped EAGLE head; its extra check: the learner's head accepts as many drafts as
    minifer's on the same requests (the tokens alone cannot show a wrong head: verification is lossless)."""

    def engine_checks(self, served: dict[str, Any]) -> list[tuple[str, Callable[[], None]]]:
        def same_alpha() -> None:
            mine, ref = served["llm"].engine.speculator.stats.alpha, reference_alpha(self, served)
            if not abs(mine - ref) <= ALPHA_TOLERANCE:
                raise AssertionError(f"your head's drafts are accepted at a rate of {mine:.3f}; minifer's head, on the "
                                     f"same requests, {ref:.3f}: the tokens are right (the target verifies), the "
                                     f"drafts are worse\nhint: compare your forward's output with the head's on the "
                                     f"grader's fixed inputs (check_eagle_forward)")

        return super().engine_checks(served) + [
            (f"its drafts are accepted as often as minifer's head's (within {ALPHA_TOLERANCE})", same_alpha)]


EAGLE_WORKLOAD = EagleWorkload(tuple(EAGLE_SPEC.items()))
# The capstone's last batch: every piece of the learner's at once, drafting with their EAGLE head (the n-gram
# proposer stands aside: one engine has one drafter).
CAPSTONE_EAGLE = (EAGLE_WORKLOAD,)


_reference_alpha: dict[SpecWorkload, float] = {}


def reference_alpha(workload: SpecWorkload, served: dict[str, Any]) -> float:
    """The acceptance rate of minifer's own drafter on ``workload`` (fixed k, greedy: the same every run), from the
    reference engine ``served["reference"]()`` builds and runs; computed once per workload."""
    if workload not in _reference_alpha:
        _reference_alpha[workload] = served["reference"]().engine.speculator.stats.alpha
    return _reference_alpha[workload]
