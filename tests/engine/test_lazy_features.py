"""A plain engine loads none of the features it was not asked for: a benchmark's result fingerprints the modules it
imported (``minifer.bench.provenance``), so a change to speculation must not make a plain throughput result stale."""

from __future__ import annotations

import json
import subprocess
import sys

FEATURES = ("minifer.engine.speculative", "minifer.engine.spec_step", "minifer.engine.adaptive_k",
            "minifer.spec_decode.eagle", "minifer.spec_decode.draft_model", "minifer.sample.rejection_sampler",
            "minifer.beam_search", "minifer.engine.data_parallel")


def _loaded(code: str) -> set[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('minifer'))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_plain_engine_imports_no_feature_it_did_not_ask_for():
    loaded = _loaded("from minifer import LLM, SamplingParams\n"
                     "llm = LLM('tinystories-target', max_num_seqs=2)\n"
                     "llm.generate(['Once'], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)")
    assert "minifer.engine.llm_engine" in loaded
    assert loaded.isdisjoint(FEATURES), sorted(loaded.intersection(FEATURES))
    assert not [m for m in loaded if m.startswith("minifer.features")], sorted(loaded)  # none of the optional ones


def test_asking_for_speculation_and_beam_search_loads_them():
    loaded = _loaded("from minifer import LLM, SamplingParams\nfrom minifer.sampling_params import BeamSearchParams\n"
                     "llm = LLM('tinystories-target', max_num_seqs=2, speculative_config={'method': 'ngram', "
                     "'num_speculative_tokens': 2, 'prompt_lookup_max': 2})\n"
                     "llm.generate(['Once upon'], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)\n"
                     "llm.beam_search(['Once'], BeamSearchParams(beam_width=2, max_tokens=2))")
    assert {"minifer.engine.speculative", "minifer.engine.spec_step", "minifer.beam_search"} <= loaded
    assert "minifer.spec_decode.eagle" not in loaded  # an n-gram run asks for no EAGLE head
    assert "minifer.engine.adaptive_k" not in loaded  # fixed k, the default, asks for no adaptive policy


def test_asking_for_adaptive_k_loads_it():
    loaded = _loaded("from minifer import LLM\n"
                     "LLM('tinystories-target', max_num_seqs=2, speculative_config={'method': 'ngram', "
                     "'num_speculative_tokens': 2, 'adaptive': True})")
    assert {"minifer.engine.adaptive_k", "minifer.engine.adaptive_k"} <= loaded
