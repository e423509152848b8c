"""Exercise 03's pieces: a learner's preemption (``Scheduler.preempt``), in the real engine and in the toy one the
graders use (``grading.toy_engine``), and their engine step, which has no engine seam (vLLM has none): the capstone
never hands it to the engine.

A preemption that would hang the engine or leak its blocks is refused with the reason, never left to loop.
"""

from __future__ import annotations

import pytest

from minifer import LLM, SamplingParams
from minifer_course import workbench
from minifer_course.grading import batching
from minifer_course.grading.toy_engine import build_world, run_to_end
from minifer.core.sched.scheduler import Scheduler, preempt_by_recompute
from minifer.engine.core import engine_step

PROMPTS = workbench.PROMPTS
SMALL = {"num_kv_blocks": 12, "max_num_batched_tokens": 64}  # 8 requests of 32 tokens: it preempts


@pytest.fixture(scope="module")
def weights():
    return LLM("tinystories-target", **SMALL)


@pytest.fixture
def ref(weights):
    """A fresh reference engine (its statistics count this test's requests only) on the shared weights."""
    return LLM("tinystories-target", share_weights_with=weights, **SMALL)


def _tokens(llm, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_a_preemption_that_keeps_its_victim_running_is_refused_not_looped():
    class KeepsVictim(Scheduler):
        preempt = staticmethod(lambda running, waiting, blocks: running[-1])

    world = build_world([[1] * 7, [2] * 6, [3] * 5], [9, 9, 9], num_blocks=7, scheduler=KeepsVictim)
    with pytest.raises(RuntimeError, match="left it running"):
        run_to_end(world, engine_step)


def test_schedule_step_preempt_and_update_from_output_together_all_run(ref):
    calls, updates = [], []

    def counted(running, waiting, blocks):
        calls.append(running[-1].request_id)
        return preempt_by_recompute(running, waiting, blocks)

    def update(self, batch, sampled, result, tokenizer=None):
        updates.append(len(sampled))
        return Scheduler.update_from_output(self, batch, sampled, result, tokenizer)

    components = workbench.components_from({"schedule_step": batching._schedule_with_minifer, "preempt": counted,
                                            "update_from_output": update})
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    mine = LLM("tinystories-target", share_weights_with=ref, components=components, **SMALL)
    assert _tokens(mine, params) == _tokens(ref, params)
    # every preemption went through the learner's preempt (schedule_step's plan, which models no prefix cache, may
    # preempt a different number of times than minifer's scheduler)
    assert len(calls) == mine.engine.stats()["num_preemptions"] > 0
    assert sum(updates) == len(PROMPTS) * 32  # every token went through the learner's update_from_output


def test_the_capstone_leaves_out_what_an_engine_cannot_run():
    pieces = {"rollback": lambda *a: None, "ngram_propose": lambda *a: []}
    assert workbench.components_from(pieces).given().keys() == {"proposer"}  # the rollback has no seam
    assert workbench.components_from(pieces, speculative=True).given().keys() == {"proposer"}
    assert workbench.components_from(pieces, speculative=False).given().keys() == set()
