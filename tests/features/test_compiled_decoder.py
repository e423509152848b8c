"""The compiled decoder (``compilation_config={"level": 3}``, ``features.compiled_decoder``) against the eager model a learner
reads: the same greedy float32 tokens on a continuous batch of varied lengths, log-probabilities within a tight bound,
and a bounded number of graphs however the step's token count varies (speed is measured by ``python -m minifer.bench
cpu_peer``, never here). A tiny two-layer checkpoint keeps the compilation short."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import minifer
from minifer import SamplingParams
from minifer.compilation.compiled_decoder import CompiledDecoder


def _prompts(n: int = 7) -> list[dict]:
    # lengths 3..27 (varied prefill chunks beside decodes), token ids inside the tiny vocabulary
    return [{"prompt_token_ids": [(5 * i + 3 * j) % 90 + 1 for j in range(3 + 4 * i)]} for i in range(n)]


def _run(llm, prompts):
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=1)
              for i in range(len(prompts))]
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("qwen3")[1]  # per-head q/k norms: the most code inside the compiled graph


def test_compiled_decoder_gives_the_eager_tokens_with_few_graphs(tiny):
    eager = minifer.LLM(tiny, dtype="float32", device="cpu", max_num_seqs=4)
    fused = minifer.LLM(tiny, dtype="float32", device="cpu", max_num_seqs=4, compilation_config={"level": 3})
    assert isinstance(fused.model.compiled, CompiledDecoder) and eager.model.compiled is None
    assert fused.compilation_config == {"level": 3}
    prompts = _prompts()
    graphs_before = counters["stats"]["unique_graphs"]
    ref, out = _run(eager, prompts), _run(fused, prompts)
    out += _run(fused, prompts[:1])  # batch 1: single-token decode steps
    ref += _run(eager, prompts[:1])
    # 4 slots over 7 requests of 3..27 prompt tokens and 6..24 outputs: steps of 1 to ~80 tokens, some of every kind
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    for o, r in zip(out, ref):
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-4
    # one graph for a single token (dynamo specialises size 1), one for any other count: not one per step
    assert 1 <= counters["stats"]["unique_graphs"] - graphs_before <= 2


def test_two_compiled_models_keep_their_own_graphs(tiny_checkpoint):
    # the graphs skip dynamo's guards on the modules: a second model of the same shape must not reach the first's
    folders = [tiny_checkpoint("qwen3", seed=s)[1] for s in (1, 2)]
    fused = [minifer.LLM(f, dtype="float32", device="cpu", compilation_config={"level": 3}) for f in folders]
    eager = [minifer.LLM(f, dtype="float32", device="cpu") for f in folders]
    prompts = _prompts(3)
    tokens = [[o.outputs[0].token_ids for o in _run(llm, prompts)] for llm in fused + eager]
    assert tokens[0] == tokens[2] and tokens[1] == tokens[3]
    assert tokens[0] != tokens[1]  # different weights: the check above could have failed


def test_enforce_eager_keeps_the_eager_model(tiny):
    llm = minifer.LLM(tiny, dtype="float32", device="cpu", compilation_config={"mode": 3}, enforce_eager=True)
    assert llm.model.compiled is None
    assert llm.compilation_config == {}


@pytest.mark.parametrize("config, message", [({"level": 2}, "level/mode must be one of"),
                                             ({"level": 3, "mode": 3}, "not both"),
                                             ({"levels": 3}, "unknown key"),
                                             ({"level": 3, "pack_weights": True}, "do not combine")])
def test_bad_compilation_config_is_named(tiny, config, message):
    with pytest.raises(ValueError, match=message):
        minifer.LLM(tiny, dtype="float32", device="cpu", compilation_config=config)


def test_quantized_weights_are_refused(tiny):
    with pytest.raises(ValueError, match="float weights"):
        minifer.LLM(tiny, dtype="float32", device="cpu", quantization="int8", compilation_config={"level": 3})


def test_a_forward_that_tracks_gradients_runs_eagerly():
    compiled = CompiledDecoder(torch.nn.Identity())
    assert not compiled.applies()
    with torch.inference_mode():
        assert compiled.applies()
