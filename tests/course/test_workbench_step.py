"""Exercise 03's seams: a caller's engine step (``Components(step=...)``, ``minifer.engine.core``) and a learner's
preemption (``Scheduler.preempt``), in the real engine and in the toy one the graders use (``grading.toy_engine``).

A step or a preemption that would hang the engine or leak its blocks is refused with the reason, never left to loop.
"""

from __future__ import annotations

import pytest

from minifer import LLM, SamplingParams
from minifer_course import workbench
from minifer_course.grading import batching
from minifer_course.grading.toy_engine import build_world, run_to_end
from minifer.engine.components import Components
from minifer.core.sched.scheduler import Scheduler, preempt_by_recompute
from minifer.engine.core import engine_step, run_checked

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


@pytest.mark.slow
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
    [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=i, ignore_eos=True) for i in range(len(PROMPTS))],
    SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=5, ignore_eos=True),  # parallel sampling: a group each
], ids=["greedy", "seeded", "n=3"])
def test_the_reference_step_as_a_component_serves_the_engines_tokens(ref, params):
    mine = LLM("tinystories-target", share_weights_with=ref, components=Components(step=engine_step), **SMALL)
    assert _tokens(mine, params) == _tokens(ref, params)
    assert mine.engine.stats()["num_preemptions"] == ref.engine.stats()["num_preemptions"] > 0
    assert mine.engine.stats()["kv_blocks_free"] == ref.engine.stats()["kv_blocks_free"]  # everything freed


def test_a_step_with_speculation_is_refused(ref):
    with pytest.raises(ValueError, match="speculative decoding's step is the engine's own"):
        LLM("tinystories-target", share_weights_with=ref, components=Components(step=engine_step),
            speculative_config=workbench.NGRAM_SPEC)


def _world():
    return build_world([[1, 2, 3], [4, 5]], [2, 3], num_blocks=8)


def test_a_finished_sequence_left_running_is_named():
    def never_frees(parts):
        batch = parts.scheduler.schedule()
        rows, logits = parts.execute(batch)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        sampled = [batch.seqs[i] for i in rows]
        result = parts.sampler(sampled, logits)
        for seq, t, lp, e in zip(sampled, result.token_ids, result.sampled_logprob, result.logprobs):
            seq.append_token(t, lp, e, None)
        return sampled

    world = _world()
    run_checked(never_frees, world.parts)
    with pytest.raises(RuntimeError, match="left the finished request 'r0' running.*scheduler.finish"):
        run_checked(never_frees, world.parts)


def test_a_step_that_returns_no_list_or_advances_nothing_is_refused():
    with pytest.raises(TypeError, match="must return the list of sequences"):
        run_checked(lambda parts: None, _world().parts)
    with pytest.raises(RuntimeError, match="advanced no request"):
        run_checked(lambda parts: [], _world().parts)


def test_a_preemption_that_keeps_its_victim_running_is_refused_not_looped():
    class KeepsVictim(Scheduler):
        preempt = staticmethod(lambda running, waiting, blocks: running[-1])

    world = build_world([[1] * 7, [2] * 6, [3] * 5], [9, 9, 9], num_blocks=7, scheduler=KeepsVictim)
    with pytest.raises(RuntimeError, match="left it running"):
        run_to_end(world, engine_step)


def test_schedule_step_and_preempt_together_both_run(ref):
    calls = []

    def counted(running, waiting, blocks):
        calls.append(running[-1].request_id)
        return preempt_by_recompute(running, waiting, blocks)

    components = workbench.components_from({"schedule_step": batching._schedule_with_minifer, "preempt": counted})
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    mine = LLM("tinystories-target", share_weights_with=ref, components=components, **SMALL)
    assert _tokens(mine, params) == _tokens(ref, params)
    # every preemption went through the learner's preempt (schedule_step's plan, which models no prefix cache, may
    # preempt a different number of times than minifer's scheduler)
    assert len(calls) == mine.engine.stats()["num_preemptions"] > 0


def test_the_capstone_leaves_out_what_an_engine_cannot_run():
    pieces = {"engine_step": engine_step, "ngram_propose": lambda *a: []}
    assert workbench.components_from(pieces).given().keys() == {"step", "proposer"}  # each piece's own workload
    assert workbench.components_from(pieces, speculative=True).given().keys() == {"proposer"}
    assert workbench.components_from(pieces, speculative=False).given().keys() == {"step"}
