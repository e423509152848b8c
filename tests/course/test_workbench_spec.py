"""Chapter 04's pieces inside the engine (``minifer_course.workbench_spec``): the ``rollback`` and ``eagle_forward``
seams run what they are given, the rollback adapter stops a cut the allocator disagrees with, the engine-level checks
(no leaked block; the EAGLE head's acceptance rate) can fail, and the seams refuse an engine they do not apply to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minifer import LLM, SamplingParams
from minifer_course import workbench
from minifer_course.grading.spec_step import reference_eagle_forward, reference_rollback
from minifer_course.workbench_spec import (
    ALPHA_TOLERANCE,
    DRAFT_SPEC,
    EAGLE_SPEC,
    EAGLE_WORKLOAD,
    ROLLBACK_WORKLOAD,
    rollback_with,
)
from minifer.core.kv_cache_manager import KVCacheManager
from minifer.engine.components import Components

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _serve(components: Components | None, spec: dict) -> tuple[LLM, list[list[int]]]:
    llm = LLM("tinystories-target", share_weights_with=workbench.reference_llm(), components=components,
              speculative_config=spec)
    return llm, [o.outputs[0].token_ids for o in llm.generate(workbench.PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference_draft():
    return _serve(None, DRAFT_SPEC)


@pytest.fixture(scope="module")
def reference_eagle():
    return _serve(None, EAGLE_SPEC)


def test_the_rollback_seam_runs_the_given_function_every_verified_step(reference_draft):
    calls = []

    def counted(token_ids, k, accepted, target, draft):
        calls.append((k, accepted, draft is not None))
        reference_rollback(token_ids, k, accepted, target, draft)

    llm, tokens = _serve(Components(rollback=rollback_with(counted)), DRAFT_SPEC)
    assert tokens == reference_draft[1]
    stats = llm.engine.speculator.stats
    # every verified (sequence, step) but those in which the sequence finished (nothing is left to roll back then)
    verified = sum(1 for k, _, _ in calls if k)
    assert stats.num_verifies - len(workbench.PROMPTS) <= verified <= stats.num_verifies
    assert sum(a for _, a, _ in calls) <= stats.num_accepted
    assert all(has_draft for k, _, has_draft in calls if k)  # the draft model's cache went through it too
    engine = llm.engine
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert engine.speculator.proposer.blocks.num_free_blocks == engine.speculator.proposer.blocks.num_blocks


def test_a_rollback_that_keeps_its_emptied_blocks_is_stopped_in_the_engine():
    def keeps_blocks(token_ids, k, accepted, target, draft):
        del token_ids[len(token_ids) - k + accepted:]
        target.num_tokens = len(token_ids)  # right length, but the emptied blocks stay in the table

    with pytest.raises(AssertionError, match="free exactly the blocks past"):
        _serve(Components(rollback=rollback_with(keeps_blocks)), DRAFT_SPEC)


def test_the_leak_check_fails_when_a_block_is_still_held():
    blocks = KVCacheManager(8, 4)
    blocks.allocate("r", [1, 2, 3, 4, 5])
    served = {"llm": SimpleNamespace(engine=SimpleNamespace(kv_cache_manager=blocks,
                                                            speculator=SimpleNamespace(proposer=object())))}
    (label, check), = ROLLBACK_WORKLOAD.engine_checks(served)
    with pytest.raises(AssertionError, match="2 of the target's 8 KV blocks are still allocated"):
        check()
    blocks.free("r")
    check()


def test_the_eagle_forward_seam_runs_the_given_forward(reference_eagle):
    calls = []

    def counted(head, *args):
        calls.append(args[0].shape[0])
        return reference_eagle_forward(head, *args)

    llm, tokens = _serve(Components(eagle_forward=counted), EAGLE_SPEC)
    assert tokens == reference_eagle[1]
    assert len(calls) == llm.engine.speculator.proposer.num_forwards > 0
    assert llm.engine.speculator.stats.alpha == reference_eagle[0].engine.speculator.stats.alpha


def test_a_wrong_head_keeps_the_tokens_but_fails_the_acceptance_check(reference_eagle):
    """Lossless whatever the head does, so only the acceptance rate can show it in the engine: a head that reads
    [embedding, feature] drafts far worse than the tolerance the engine check allows. (A head without its final norm
    does not: the LM head's argmax hardly depends on the scale of a row, so its acceptance rate on these requests is
    within noise of the reference's; ``check_eagle_forward`` catches it on fixed inputs, before the engine.)"""
    def embedding_first(head, features, input_ids, positions, attn):
        x = head.fc(torch.cat([head.embed_tokens(input_ids), features], dim=-1))
        return head.norm(head.layer(x, *head.rotary(positions, x.dtype), attn))

    llm, tokens = _serve(Components(eagle_forward=embedding_first), EAGLE_SPEC)
    assert tokens == reference_eagle[1]
    ref = reference_eagle[0].engine.speculator.stats.alpha
    assert llm.engine.speculator.stats.alpha < ref - ALPHA_TOLERANCE
    served = {"llm": llm, "reference": lambda: reference_eagle[0]}
    alpha_check = EAGLE_WORKLOAD.engine_checks(served)[-1][1]
    with pytest.raises(AssertionError, match="the drafts are worse"):
        alpha_check()


def test_the_seams_refuse_an_engine_they_do_not_apply_to():
    with pytest.raises(ValueError, match="eagle_forward is the forward of the EAGLE head"):
        _serve(Components(eagle_forward=reference_eagle_forward), {**DRAFT_SPEC})
    with pytest.raises(ValueError, match="parts of speculative decoding"):
        LLM("tinystories-target", share_weights_with=workbench.reference_llm(),
            components=Components(rollback=rollback_with(reference_rollback)))


def test_components_from_plugs_each_piece_into_the_engines_it_fits():
    pieces = {"rollback": reference_rollback, "eagle_forward": reference_eagle_forward}
    assert set(workbench.components_from(pieces).given()) == {"rollback"}  # n-grams: no EAGLE head to run
    assert set(workbench.components_from(pieces, EAGLE_SPEC).given()) == {"rollback", "eagle_forward"}
