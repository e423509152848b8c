"""Chapter 04's pieces in the engine: the speculative step's rollback and the EAGLE head's forward.

``minifer_course.workbench`` carries the learner's pieces into ``LLM(components=...)``; this module holds what the two
speculative pieces of exercise 04 need there:

* ``KVView``, the exercise's picture of one model's paged KV for one sequence, and ``rollback_with``, which turns the
  learner's ``rollback(token_ids, k, accepted, target, draft)`` into the engine's ``Rollback`` seam
  (``minifer.engine.speculative``). The learner's function decides how many tokens each cache keeps and which blocks
  go back to the pool; the engine's allocators carry that out (their reference counts and prefix-cache entries are
  theirs), and the adapter checks after every step that the allocator's table is the one the learner computed, so a
  disagreement stops the engine with a message instead of corrupting the cache;
* the chapter's speculative workloads (``SpecWorkload``: a draft model for the rollback, which has a draft cache to
  cut; the shipped EAGLE head for its forward), and the checks that only a served engine can make: no KV block is
  left allocated once every request has finished, and the learner's head accepts as many drafts as minifer's.

The engine core never imports this module; ``workbench`` and the graders do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from minifer.spec_decode.draft_model import DraftModelProposer
from minifer.engine.speculative import Rollback, Speculator

DRAFT_SPEC = {"method": "draft_model", "model": "tinystories-draft", "num_speculative_tokens": 4, "adaptive": False}
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


def _view(blocks: Any, seq_id: object, num_tokens: int) -> KVView:
    return KVView(num_tokens, list(blocks.block_table(seq_id)), blocks.block_size, [])


def _apply(blocks: Any, seq_id: object, view: KVView, which: str) -> None:
    """Carry the learner's cut out on the engine's allocator, then check it left the table the learner computed."""
    before = list(blocks.block_table(seq_id))
    blocks.truncate(seq_id, max(view.num_tokens, 1))  # a table keeps its first block while the sequence lives
    after = list(blocks.block_table(seq_id))
    freed = before[len(after):]
    if view.block_table != after or sorted(view.free_blocks) != sorted(freed):
        raise AssertionError(f"your rollback keeps {view.num_tokens} tokens of the {which}'s KV in blocks "
                             f"{view.block_table} and frees {view.free_blocks}, but those tokens fill blocks {after} "
                             f"and free {freed}: free exactly the blocks past ceil(num_tokens / block_size)")


def rollback_with(rollback: Callable[..., None]) -> Rollback:
    """The engine's ``Rollback`` seam around the exercise's ``rollback(token_ids, k, accepted, target, draft)``.

    The engine calls the seam after it has appended what the verification emitted (the ``accepted`` drafts and the
    target's own token), so the adapter rebuilds the state the exercise starts from: the sequence as it stood with
    all ``k`` drafts in it, the target's KV written for all of them, and the draft model's (when one drafts) for all
    but the last."""

    def seam(spec: Speculator, seq: Any, drafts: list[int], accepted: int) -> None:
        rid, kept = seq.request_id, list(seq.all_token_ids[:-1])  # the target's own token: appended after rollback
        n = len(kept) - accepted
        token_ids = kept[:n] + list(drafts)
        target = _view(spec.target_blocks, rid, n + len(drafts))
        proposer = spec.proposer
        has_draft = isinstance(proposer, DraftModelProposer) and proposer.blocks.has_seq(rid)
        draft = _view(proposer.blocks, rid, proposer.computed[rid]) if has_draft else None
        rollback(token_ids, len(drafts), accepted, target, draft)
        if token_ids != kept:
            raise AssertionError(f"after {accepted} of {len(drafts)} drafts were accepted your rollback left "
                                 f"{len(token_ids)} tokens; the sequence keeps {len(kept)}: the context and the "
                                 f"accepted drafts")
        _apply(spec.target_blocks, rid, target, "target")
        if draft is not None:
            proposer.computed[rid] = draft.num_tokens
            _apply(proposer.blocks, rid, draft, "draft")
        elif not has_draft:
            proposer.rollback(seq, seq.num_tokens - 1)  # a proposer with a cache of its own (EAGLE) trims it itself

    return seam


@dataclass(frozen=True)
class SpecWorkload:
    """Greedy requests served with ``speculative_config`` (``spec``: its items, so the workload stays hashable and
    the reference engine's tokens are computed once); the same interface as ``workbench.Workload``."""

    spec: tuple[tuple[str, Any], ...]
    max_tokens: int = 16
    sampled: bool = False
    speculative: bool = True  # as ``workbench.Workload``'s: the engine speculates (the learner's step does not run)

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
                                         f"after every request finished: a rollback lost track of them")

        return [("every KV block is free again when the requests are done (no leak)", no_leaks)]


ROLLBACK_WORKLOAD = SpecWorkload(tuple(DRAFT_SPEC.items()))


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
