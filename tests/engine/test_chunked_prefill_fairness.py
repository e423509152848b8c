"""Chunked prefill keeps decode streams moving (issue 48: eight 1,000-token prompts paused another stream 3.6 s):
with a per-step token budget (``max_num_batched_tokens``, vLLM's name), every running decode request gets a token
in every step while long prompts prefill a chunk at a time, and no step exceeds the budget. Counted in steps, not
seconds."""

from __future__ import annotations

import random

from minifer import LLM, SamplingParams

BUDGET = 64


def test_running_decodes_get_a_token_in_every_step_while_eight_long_prompts_prefill():
    llm = LLM("tinystories-draft", max_num_seqs=16, max_num_batched_tokens=BUDGET, max_model_len=1024)
    engine = llm.engine
    decodes = [f"decode{i}" for i in range(2)]
    for rid in decodes:
        engine.add_request(rid, "Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True))
    engine.step()  # both prompts fit one step: from now on they decode
    rng = random.Random(0)  # distinct prompts: the prefix cache cannot shorten their prefill
    for i in range(8):
        engine.add_request(f"long{i}", {"prompt_token_ids": [rng.randrange(3, 2000) for _ in range(1000)]},
                           SamplingParams(max_tokens=1))
    steps = 0
    while any(f"long{i}" in engine.requests for i in range(8)):
        outputs = {o.request_id: o for o in engine.step()}
        steps += 1
        assert engine.step_tokens <= BUDGET
        assert [len(outputs[rid].outputs[0].new_token_ids) if rid in outputs else 0 for rid in decodes] == [1, 1], \
            f"step {steps}: a decode stream got no token"
    assert steps >= 8 * 1000 // BUDGET  # the prompts did prefill in chunks, beside the decodes
    assert all(rid in engine.requests for rid in decodes)
