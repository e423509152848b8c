"""``LLMEngine.step`` runs ``engine_step`` (``engine/core.py``, the function chapter 03 shows) for every step, plain
and speculating (``engine/spec_step.py`` runs it through its hooks), instead of a copy of its own that could drift."""

from __future__ import annotations

import pytest

from minifer import LLM, SamplingParams
from minifer.engine import llm_engine, spec_step
from minifer.engine.core import engine_step

pytestmark = pytest.mark.core  # the fast tier (tests/README.md)

PROMPTS = ["Once upon a time, a cat and a dog", "The sun was hot. The sun was hot. The sun was"]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}],
                         ids=["plain", "ngram k=3"])
def test_every_engine_step_is_engine_step(draft_llm, monkeypatch, spec):
    calls = []

    def counted(parts):
        calls.append(len(parts.scheduler.running))
        return engine_step(parts)

    monkeypatch.setattr(llm_engine, "engine_step", counted)
    monkeypatch.setattr(spec_step, "engine_step", counted)
    llm = LLM("tinystories-draft", dtype="float32", device="cpu", share_weights_with=draft_llm,
              speculative_config=spec)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    steps, tokens = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert len(calls) == steps > 0
    assert all(len(t) == 24 for t in tokens.values()) and len(tokens) == len(PROMPTS)
    if spec is not None:  # the drafts went through engine_step too: fewer steps than tokens
        assert engine.stats()["spec_num_accepted"] > 0 and steps < 24
    plain = LLM("tinystories-draft", dtype="float32", device="cpu", share_weights_with=draft_llm)
    want = plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == [o.outputs[0].token_ids for o in want]
