"""Property test of the whole engine: random arrivals, lengths, aborts and forced preemptions over many
steps, with and without speculative decoding (whose rollbacks free blocks too), requests of one or several
completions (``n``, which share their prompt's blocks). Invariants: block reference counts always match the block
tables, nothing leaks, every request that was not aborted finishes with exactly the tokens it produces alone (each
of its greedy completions), and streaming deltas add up."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minifer import LLM, SamplingParams


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tinystories-target", batching="static", max_num_seqs=64)
    cache: dict[tuple, list[int]] = {}

    def solo(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        key = (prompt, max_tokens)
        if key not in cache:
            out = llm.generate([{"prompt_token_ids": list(prompt)}],
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
            cache[key] = out[0].outputs[0].token_ids
        return cache[key]

    return solo


SPECULATION = {
    "plain": None,
    # fixed k, so every step speculates and rolls back; a tiny cache, so preemption meets speculation
    "draft": {"method": "draft_model", "model": "tinystories-draft", "num_speculative_tokens": 3, "adaptive": False},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False},
}


@pytest.fixture(scope="module", params=list(SPECULATION))
def engine_llm(request):
    return LLM("tinystories-target", block_size=4, num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=24,
               speculative_config=SPECULATION[request.param])


request = st.tuples(
    st.lists(st.integers(1, 2047), min_size=1, max_size=20),  # prompt (BOS added)
    st.integers(1, 16),  # max_tokens
    st.integers(0, 12),  # arrival step
    st.one_of(st.none(), st.integers(0, 20)),  # abort at this step (None: never)
    st.sampled_from([1, 1, 2, 3]),  # n: completions of the prompt
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=10), shared_prefix=st.booleans())
def test_random_workload(engine_llm, reference, requests, shared_prefix):
    engine = engine_llm.engine
    prefix = [0] + list(range(500, 512)) if shared_prefix else [0]
    pending = sorted(enumerate(requests), key=lambda r: r[1][2])
    finished: dict[str, list[list[int]]] = {}
    streamed: dict[tuple[str, int], str] = {}
    aborted: set[str] = set()
    live: set[str] = set()
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _, _, n) = pending.pop(0)
            engine.add_request(f"q{i}", {"prompt_token_ids": prefix + prompt},
                               SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True))
            live.add(f"q{i}")
        for i, (_, _, arrival, abort_at, _) in enumerate(requests):
            rid = f"q{i}"
            if abort_at is not None and abort_at == step and rid in live:
                engine.abort_request(rid)
                live.discard(rid)
                aborted.add(rid)
        for out in engine.step():
            assert out.request_id in live
            for c in out.outputs:
                key = (out.request_id, c.index)
                streamed[key] = streamed.get(key, "") + c.delta_text
                if c.finished():
                    finished.setdefault(out.request_id, [None] * requests[int(out.request_id[1:])][4])[c.index] = \
                        c.token_ids
                    assert c.text == streamed[key]
            if out.finished:
                live.discard(out.request_id)
                assert None not in finished[out.request_id]
        engine.kv_cache_manager.check_invariants()
        if engine.speculator is not None and hasattr(engine.speculator.proposer, "blocks"):
            engine.speculator.proposer.blocks.check_invariants()
        step += 1
        assert step < 2000, "engine made no progress"
    assert {r for r in finished if r not in aborted} | aborted == {f"q{i}" for i in range(len(requests))}
    for i, (prompt, max_tokens, _, _, n) in enumerate(requests):
        if f"q{i}" in finished and f"q{i}" not in aborted:
            assert finished[f"q{i}"] == [reference(tuple(prefix + prompt), max_tokens)] * n, f"request q{i} differs"
    stats = engine_llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert all(b.ref_count == 0 for b in engine.kv_cache_manager.block_pool.blocks)
    proposer = getattr(engine.speculator, "proposer", None)
    if hasattr(proposer, "blocks"):  # the draft's cache: every block back, no state left for any request
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
        assert not proposer.computed
