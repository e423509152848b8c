"""Parallel sampling (``SamplingParams.n > 1``): n completions of one prompt that share its KV blocks.

The oracle for the tokens: completion ``i`` of a seeded request is exactly the request run alone with seed
``seed + i`` (vLLM's rule), in the continuous engine, in the static baseline, under preemption and with prefix
caching off. The oracle for the memory: the block tables themselves (siblings' prompt blocks are the first
completion's physical blocks) and the prefix-cache counters.
"""

from __future__ import annotations

import pytest

from minifer import LLM, SamplingParams
from minifer.request import ParentRequest

BS = 16
PROMPT = {"prompt_token_ids": [0] + [(37 * i) % 1900 + 50 for i in range(99)]}  # 100 tokens: 6 full blocks + 4
SHARED = (100 - 1) // BS  # full blocks a sibling finds cached (the last prompt token is always computed)


def sampled(n: int, seed: int = 11, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def continuous(**kw) -> LLM:
    return LLM("tinystories-target", block_size=BS, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return continuous(num_kv_blocks=128)


def alone(llm: LLM, seed: int, max_tokens: int = 12) -> list[int]:
    return llm.generate([PROMPT], sampled(1, seed, max_tokens), use_tqdm=False)[0].outputs[0].token_ids


def test_each_completion_is_the_request_alone_with_seed_plus_index(llm):
    prompts = [PROMPT, "Once upon a time"]
    outs = llm.generate(prompts, sampled(4), use_tqdm=False)
    assert len(outs) == 2 and all(o.finished for o in outs)
    for o in outs:
        assert [c.index for c in o.outputs] == [0, 1, 2, 3]
        assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in o.outputs)
    assert [c.token_ids for c in outs[0].outputs] == [alone(llm, 11 + i) for i in range(4)]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # different seeds, different samples
    static = LLM("tinystories-target", batching="static", max_num_seqs=8, share_weights_with=None)
    for a, b in zip(outs, static.generate(prompts, sampled(4), use_tqdm=False)):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    llm.engine.kv_cache_manager.check_invariants()


def test_unseeded_completions_differ_and_greedy_ones_agree(llm):
    free = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in free.outputs}) > 1
    greedy = llm.generate([PROMPT], SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0]
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert [c.token_ids for c in greedy.outputs] == [want] * 3


def test_siblings_wait_for_the_prompt_then_share_its_blocks():
    llm = continuous(num_kv_blocks=64)
    engine, bm = llm.engine, llm.engine.kv_cache_manager
    group = engine.add_request("g", PROMPT, sampled(4))
    assert isinstance(group, ParentRequest) and [s.request_id for s in group.seqs] == ["0_g", "1_g", "2_g", "3_g"]
    assert len(group.pending) == 3 and list(engine.scheduler.waiting) == [group.seqs[0]]
    assert llm.stats()["num_waiting"] == 4  # the held siblings count as waiting (stats, speculation's k)
    first, *siblings = group.seqs
    engine.step()  # the first completion computes the whole prompt and samples its first token
    assert group.pending == [] and list(engine.scheduler.waiting) == siblings
    hits = bm.prefix_cache_stats.hits
    engine.step()  # the siblings join: their prompt's full blocks come from the cache, not from a forward
    assert bm.prefix_cache_stats.hits - hits == 3 * SHARED
    shared = bm.block_table("0_g")[:SHARED]
    for s in siblings:
        assert bm.block_table(s.request_id)[:SHARED] == shared
    assert all(bm.block_pool.blocks[b].ref_count == 4 for b in shared)
    in_use = len({b for s in group.seqs for b in bm.block_table(s.request_id)})
    unshared = sum(len(bm.block_table(s.request_id)) for s in group.seqs)
    assert unshared - in_use == 3 * SHARED
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.output_token_ids for s in group.seqs] == [alone(llm, 11 + i) for i in range(4)]
    bm.check_invariants()


def test_without_prefix_caching_nothing_waits_and_tokens_are_the_same(llm):
    cold = continuous(num_kv_blocks=128, enable_prefix_caching=False)
    group = cold.engine.add_request("g", PROMPT, sampled(3))
    assert group.pending == [] and len(cold.engine.scheduler.waiting) == 3
    cold.engine.abort_request("g")
    out = cold.generate([PROMPT], sampled(3), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [alone(llm, 11 + i) for i in range(3)]
    assert cold.stats()["prefix_cache_hit_rate"] == 0.0


def test_preemption_recomputes_completions_to_the_same_tokens(llm):
    want = [[c.token_ids for c in o.outputs] for o in llm.generate([PROMPT, PROMPT], sampled(4, max_tokens=40),
                                                                     use_tqdm=False)]
    tight = continuous(num_kv_blocks=16, max_num_batched_tokens=64)  # 8 completions of 140 tokens: 9 blocks each
    got = [[c.token_ids for c in o.outputs] for o in tight.generate([PROMPT, PROMPT], sampled(4, max_tokens=40),
                                                                      use_tqdm=False)]
    assert got == want
    assert tight.stats()["num_preemptions"] > 0
    assert tight.stats()["kv_blocks_free"] == tight.stats()["kv_blocks_total"]
    tight.engine.kv_cache_manager.check_invariants()


def test_step_reports_one_output_per_request_and_deltas_add_up(llm):
    engine = llm.engine
    engine.add_request("solo", "Tom had a ball", sampled(1))
    engine.add_request("many", PROMPT, sampled(3))
    seen: dict[str, dict[int, list[int]]] = {"solo": {}, "many": {}}
    finished = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert len({o.request_id for o in outs}) == len(outs)  # a group's completions come merged
        for o in outs:
            for c in o.outputs:
                seen[o.request_id].setdefault(c.index, []).extend(c.new_token_ids)
            if o.finished:
                finished.append(o.request_id)
                assert o.metrics.finished_time >= o.metrics.first_token_time >= o.metrics.arrival_time
    assert sorted(finished) == ["many", "solo"]
    assert [seen["many"][i] for i in range(3)] == [alone(llm, 11 + i) for i in range(3)]
    assert list(seen["solo"]) == [0] and len(seen["solo"][0]) == 12


def test_abort_stops_every_completion_and_frees_their_blocks(llm):
    engine = llm.engine
    engine.add_request("doomed", PROMPT, sampled(4, max_tokens=30))
    engine.add_request("other", "Lily saw a cat", sampled(1))
    engine.step()
    engine.abort_request("doomed")  # its first completion runs, three wait
    with pytest.raises(KeyError, match="doomed"):
        engine.abort_request("doomed")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert {o.request_id for o in outs} == {"other"} and outs[-1].finished
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    engine.kv_cache_manager.check_invariants()


def test_clear_errors_for_ids_that_collide_and_streams_of_several(llm):
    engine = llm.engine
    engine.add_request("1_x", "Tom", sampled(1, max_tokens=2))
    with pytest.raises(ValueError, match=r"completion 1 would be sequence '1_x'"):
        engine.add_request("x", PROMPT, sampled(2))
    assert "x" not in engine.requests and len(engine.scheduler.waiting) == 1  # nothing half-added
    with pytest.raises(ValueError, match=r"stream\(\) follows one completion.*n=2"):
        next(engine.stream("y", PROMPT, sampled(2)))
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match=r"SamplingParams\.n"):
        SamplingParams(n=0)


def test_speculative_engine_serves_parallel_greedy_completions(llm):
    spec = continuous(num_kv_blocks=128, share_weights_with=llm,
                      speculative_config={"method": "draft_model", "model": "tinystories-draft",
                                          "num_speculative_tokens": 4})
    params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    got = spec.generate([PROMPT], params, use_tqdm=False)[0]
    want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert [c.token_ids for c in got.outputs] == [want, want]
    assert spec.stats()["kv_blocks_free"] == spec.stats()["kv_blocks_total"]


def test_first_completion_finishing_at_its_first_token_still_releases_its_siblings(llm):
    out = llm.generate([PROMPT], sampled(4, max_tokens=1), use_tqdm=False)[0]
    assert out.finished and [len(c.token_ids) for c in out.outputs] == [1, 1, 1, 1]
    assert [c.token_ids for c in out.outputs] == [alone(llm, 11 + i, max_tokens=1) for i in range(4)]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_abort_while_the_first_completion_is_in_chunked_prefill():
    llm = continuous(num_kv_blocks=64, max_num_batched_tokens=32)  # the 100-token prompt takes 4 steps
    engine = llm.engine
    group = engine.add_request("g", PROMPT, sampled(3))
    engine.step()
    assert group.seqs[0].num_computed_tokens == 32 and len(group.pending) == 2
    engine.abort_request("g")
    assert not engine.has_unfinished_requests() and not engine.requests
    assert all(s.finish_reason == "abort" for s in group.seqs)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
    engine.kv_cache_manager.check_invariants()
    assert llm.generate([PROMPT], sampled(2), use_tqdm=False)[0].finished  # the engine is fine afterwards
