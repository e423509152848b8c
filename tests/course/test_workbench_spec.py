"""Chapter 04's pieces beside the engine (``minifer_course.workbench_spec``): the learner's EAGLE forward goes in as an
``EagleHead`` subclass through ``Components.model_registry`` and runs every drafting forward, the engine-level checks
(no leaked block; the EAGLE head's acceptance rate) can fail, and the rollback, which has no engine seam, never
reaches the engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from minifer import LLM, SamplingParams
from minifer_course import workbench
from minifer_course.grading.spec_step import reference_rollback
from minifer_course.workbench_spec import ALPHA_TOLERANCE, EAGLE_SPEC, EAGLE_WORKLOAD
from minifer.core.kv_cache_manager import KVCacheManager
from minifer.engine.components import Components
from minifer.models.llama_eagle import EagleHead

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _serve(components: Components | None, spec: dict) -> tuple[LLM, list[list[int]]]:
    llm = LLM("tinystories-target", share_weights_with=workbench.reference_llm(), components=components,
              speculative_config=spec)
    return llm, [o.outputs[0].token_ids for o in llm.generate(workbench.PROMPTS, PARAMS, use_tqdm=False)]


def _head_forward(forward) -> Components:
    return workbench.components_from({"eagle_forward": forward}, EAGLE_SPEC)


@pytest.fixture(scope="module")
def reference_eagle():
    return _serve(None, EAGLE_SPEC)


def test_the_leak_check_fails_when_a_block_is_still_held():
    blocks = KVCacheManager(8, 4)
    blocks.allocate("r", [1, 2, 3, 4, 5])
    served = {"llm": SimpleNamespace(engine=SimpleNamespace(kv_cache_manager=blocks,
                                                            speculator=SimpleNamespace(proposer=object())))}
    (label, check), _ = EAGLE_WORKLOAD.engine_checks(served)
    with pytest.raises(AssertionError, match="2 of the target's 8 KV blocks are still allocated"):
        check()
    blocks.free("r")
    check()


def test_the_learners_eagle_forward_runs_every_drafting_forward(reference_eagle):
    calls = []

    def counted(head, features, input_ids, positions, attn):
        calls.append(features.shape[0])
        return EagleHead.forward(head, features, input_ids, positions, attn)

    llm, tokens = _serve(_head_forward(counted), EAGLE_SPEC)
    assert type(llm.draft_model).__name__ == "LearnersEagleHead"
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

    llm, tokens = _serve(_head_forward(embedding_first), EAGLE_SPEC)
    assert tokens == reference_eagle[1]
    ref = reference_eagle[0].engine.speculator.stats.alpha
    assert llm.engine.speculator.stats.alpha < ref - ALPHA_TOLERANCE
    served = {"llm": llm, "reference": lambda: reference_eagle[0]}
    alpha_check = EAGLE_WORKLOAD.engine_checks(served)[-1][1]
    with pytest.raises(AssertionError, match="the drafts are worse"):
        alpha_check()


def test_components_from_plugs_each_piece_into_the_engines_it_fits():
    pieces = {"rollback": reference_rollback, "eagle_forward": EagleHead.forward}
    assert workbench.components_from(pieces).given() == {}  # n-grams: no EAGLE head to run; the rollback: no seam
    registry = workbench.components_from(pieces, EAGLE_SPEC).model_registry
    assert set(registry) == {"EagleHead"} and registry["EagleHead"].forward is EagleHead.forward
