"""The engine's seams (``LLMEngine``'s docstring lists them): each takes another implementation through ``LLM``, the
engine calls it, and handing in a wrapper around the reference changes nothing in the output. The lossy verifier
of ``tests/spec/test_speculative.py`` goes through the same seam. ``LLM(components=...)`` hands in several at once,
with the RMSNorm and RoPE the model's layers call."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minifer import LLM, SamplingParams
from minifer.core.kv_cache_manager import KVCacheManager
from minifer.engine.components import Components
from minifer.spec_decode.ngram_proposer import NgramProposer
from minifer.worker.model_runner import ModelRunner
from minifer.core.sched.scheduler import Scheduler
from minifer.layers.layernorm import rms_norm
from minifer.layers.rotary_embedding import apply_rotary
from minifer.quantization.formats import quant_linear_reference
from minifer.sample.rejection_sampler import RejectionVerifier

pytestmark = pytest.mark.core  # the fast tier (tests/README.md)

PROMPTS = ["Once upon a time", "The little dog"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tinystories-target")
    return llm, _tokens(llm)


def test_a_block_allocator_and_a_scheduler_handed_in_are_the_ones_used(reference):
    built = []

    class CountingAllocator(KVCacheManager):
        def allocate(self, seq_id, token_ids, use_cache=True):
            built.append(("allocate", seq_id))
            return super().allocate(seq_id, token_ids, use_cache)

    class CountingScheduler(Scheduler):
        def schedule(self):
            built.append(("schedule",))
            return super().schedule()

    llm = LLM("tinystories-target", share_weights_with=reference[0],
              components=Components(block_allocator=CountingAllocator, scheduler=CountingScheduler))
    assert isinstance(llm.engine.kv_cache_manager, CountingAllocator)
    assert isinstance(llm.engine.scheduler, CountingScheduler)
    assert _tokens(llm) == reference[1]
    assert any(c[0] == "allocate" for c in built) and any(c[0] == "schedule" for c in built)


def test_a_sampler_handed_in_draws_every_token(reference):
    calls = []

    def sampler(seqs, logits):
        calls.append(len(seqs))
        return ModelRunner.sample(seqs, logits)

    llm = LLM("tinystories-target", share_weights_with=reference[0], components=Components(sampler=sampler))
    assert _tokens(llm) == reference[1]
    assert sum(calls) == len(PROMPTS) * GREEDY.max_tokens  # one call per step, one token per sequence


def test_a_proposer_and_a_verifier_handed_in_speculate(reference):
    proposed, verified = [], []

    class Proposer(NgramProposer):
        def propose(self, seqs, ks, vocab_size):
            proposed.append(sum(ks))
            return super().propose(seqs, ks, vocab_size)

    class Verifier(RejectionVerifier):
        def greedy(self, draft_tokens, target_argmax):
            verified.append(len(draft_tokens))
            return super().greedy(draft_tokens, target_argmax)

    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    proposer = Proposer(LLM("tinystories-target", share_weights_with=reference[0],
                            speculative_config=spec).engine.speculator.cfg)
    llm = LLM("tinystories-target", share_weights_with=reference[0], speculative_config=spec,
              components=Components(proposer=proposer, verifier=Verifier()))
    assert llm.engine.speculator.proposer is proposer
    assert _tokens(llm) == reference[1]  # greedy speculation emits what plain decoding does
    assert proposed and verified


def test_a_quant_kernel_handed_in_runs_every_quantized_layer(reference):
    calls = []

    def kernel(x, qw, bias):
        calls.append(qw.shape)
        return quant_linear_reference(x, qw, bias)

    llm = LLM("tinystories-target", quantization="int8", components=Components(quant_kernel=kernel))
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    layers = llm.model_config.num_hidden_layers
    assert len(calls) >= 4 * layers and len(set(calls)) == 4  # qkv, o, gate_up, down in every layer


def test_seams_that_cannot_apply_are_refused(reference):
    with pytest.raises(ValueError, match="proposer and verifier are parts of speculative decoding"):
        LLM("tinystories-target", share_weights_with=reference[0], components=Components(verifier=RejectionVerifier()))
    with pytest.raises(ValueError, match="sampler plug into the continuous engine"):
        LLM("tinystories-target", share_weights_with=reference[0], batching="static",
            components=Components(sampler=ModelRunner.sample))


def test_an_attention_backend_handed_in_is_the_one_the_model_attends_through(reference):
    from minifer.attention.backends.paged import PagedKVCache

    calls = []

    class CountingBackend(PagedKVCache):
        def attend(self, layer, q, k, v):
            calls.append(layer)
            return super().attend(layer, q, k, v)

    llm = LLM("tinystories-target", share_weights_with=reference[0],
              components=Components(attention_backend=CountingBackend))
    assert isinstance(llm.engine.kv_cache, CountingBackend)
    assert _tokens(llm) == reference[1]
    assert set(calls) == set(range(llm.model_config.num_hidden_layers))


def _counting(fn, calls: list, name: str):
    def wrapped(*args):
        calls.append(name)
        return fn(*args)
    return wrapped


def test_the_layers_call_the_rms_norm_and_rope_handed_in(reference):
    calls: list[str] = []
    mine = Components(rms_norm=_counting(rms_norm, calls, "rms_norm"),
                      apply_rotary=_counting(apply_rotary, calls, "apply_rotary"))
    llm = LLM("tinystories-target", share_weights_with=reference[0], components=mine)
    assert _tokens(llm) == reference[1]
    layers = llm.model_config.num_hidden_layers
    forwards = calls.count("rms_norm") // (2 * layers + 1)  # two norms per layer and the final one
    assert forwards >= GREEDY.max_tokens and calls.count("rms_norm") == forwards * (2 * layers + 1)
    assert calls.count("apply_rotary") == forwards * 2 * layers  # queries and keys of every layer


def test_the_rope_frequencies_handed_in_build_every_forward_s_rotation(reference):
    from minifer.layers.rotary_embedding import RotaryEmbedding, rope_inv_freq

    calls: list[str] = []
    mine = LLM("tinystories-target", share_weights_with=reference[0],
               components=Components(rope_inv_freq=_counting(rope_inv_freq, calls, "rope_inv_freq")))
    assert _tokens(mine) == reference[1]  # the same frequencies, the same arithmetic: the same tokens
    assert calls.count("rope_inv_freq") >= GREEDY.max_tokens  # once per forward, not once at load

    def reversed_order(head_dim, theta):  # the slowest rotation on the first pair: must show in the tokens
        return rope_inv_freq(head_dim, theta).flip(0)

    wrong = LLM("tinystories-target", share_weights_with=reference[0],
                components=Components(rope_inv_freq=reversed_order))
    assert _tokens(wrong) != reference[1]
    scaled = RotaryEmbedding(8, 16, 10000.0, {"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="scales RoPE"):
        scaled.from_frequencies(torch.arange(3), torch.float32, rope_inv_freq)


def test_a_decoder_layer_handed_in_runs_every_layer_with_the_ops_it_is_given(reference):
    from minifer.models.llama import DecoderLayer

    layers: list[int] = []

    def decoder_layer(layer, x, cos, sin, attn, ops):
        layers.append(layer.self_attn.layer_idx)
        return DecoderLayer.forward(layer, x, cos, sin, attn, replace(ops, decoder_layer=None))

    llm = LLM("tinystories-target", share_weights_with=reference[0], components=Components(decoder_layer=decoder_layer))
    assert _tokens(llm) == reference[1]
    assert set(layers) == set(range(llm.model_config.num_hidden_layers))


def test_components_do_not_leak_into_an_engine_sharing_the_weights(reference):
    calls: list[str] = []
    LLM("tinystories-target", share_weights_with=reference[0],
        components=Components(rms_norm=_counting(rms_norm, calls, "rms_norm")))
    assert _tokens(reference[0]) == reference[1] and not calls  # the override rides on one engine's forwards only


def test_every_seam_in_components_is_the_one_used(reference):
    calls: list[str] = []
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}

    class Verifier(RejectionVerifier):
        def greedy(self, draft_tokens, target_argmax):
            calls.append("verifier")
            return super().greedy(draft_tokens, target_argmax)

    mine = Components(rms_norm=rms_norm, apply_rotary=apply_rotary,
                      sampler=_counting(ModelRunner.sample, calls, "sampler"), verifier=Verifier())
    llm = LLM("tinystories-target", share_weights_with=reference[0], speculative_config=spec, components=mine)
    assert _tokens(llm) == reference[1]
    assert {"sampler", "verifier"} <= set(calls)
    assert llm.components.given().keys() == {"rms_norm", "apply_rotary", "sampler", "verifier"}


def test_a_seam_given_as_an_option_or_where_it_cannot_apply_is_refused(reference):
    # components is the one way to hand in a seam: as a keyword it is no option, and the error says where it goes
    with pytest.raises(TypeError, match=r"engine seam 'sampler'.*components=Components\(sampler=\.\.\.\)"):
        LLM("tinystories-target", share_weights_with=reference[0], sampler=ModelRunner.sample)
    with pytest.raises(ValueError, match="plug into the continuous engine"):
        LLM("tinystories-target", share_weights_with=reference[0], batching="static",
            components=Components(rms_norm=rms_norm))
    with pytest.raises(TypeError, match="components must be"):
        LLM("tinystories-target", share_weights_with=reference[0], components={"rms_norm": rms_norm})
