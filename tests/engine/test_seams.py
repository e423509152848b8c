"""The engine's seams (``LLMEngine``'s docstring lists them): each takes another implementation through ``LLM``, the
engine calls it, and handing in a wrapper around the reference changes nothing in the output. The lossy verifier
of ``tests/spec/test_speculative.py`` goes through the same seam. ``LLM(components=...)`` hands in several at once,
with the model classes to build (``model_registry``: a model of other layer classes, as vLLM's out-of-tree models)."""

from __future__ import annotations

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


def _counted_model(calls: list[str]) -> type:
    """minifer's model built from layer classes that count their calls."""
    from minifer.layers.layernorm import RMSNorm
    from minifer.models.llama import Attention, DecoderLayer, LlamaForCausalLM

    class Norm(RMSNorm):
        def forward(self, x):
            calls.append("rms_norm")
            return rms_norm(x, self.weight, self.eps)

    class Rotating(Attention):
        apply_rotary = staticmethod(_counting(apply_rotary, calls, "apply_rotary"))

    class Layer(DecoderLayer):
        def forward(self, x, cos, sin, attn):
            calls.append(f"layer {self.self_attn.layer_idx}")
            return super().forward(x, cos, sin, attn)

    return type("CountedLlama", (LlamaForCausalLM,), {"norm_cls": Norm, "attention_cls": Rotating, "layer_type": Layer})


def test_a_model_class_registered_for_the_architecture_is_built_from_its_layer_classes(reference):
    calls: list[str] = []
    model_cls = _counted_model(calls)
    llm = LLM("tinystories-target", components=Components(model_registry={"LlamaForCausalLM": model_cls}))
    assert type(llm.model) is model_cls
    assert _tokens(llm) == reference[1]  # the same weights, loaded by name into the same parameters
    layers = llm.model_config.num_hidden_layers
    forwards = calls.count("rms_norm") // (2 * layers + 1)  # two norms per layer and the final one
    assert forwards >= GREEDY.max_tokens and calls.count("rms_norm") == forwards * (2 * layers + 1)
    assert calls.count("apply_rotary") == forwards * 2 * layers  # queries and keys of every layer
    assert {c for c in calls if c.startswith("layer")} == {f"layer {i}" for i in range(layers)}
    assert type(reference[0].model).__name__ == "LlamaForCausalLM"  # registered for this engine only


def test_a_rotary_class_computes_the_table_from_its_own_frequencies(reference):
    from minifer.layers.rotary_embedding import RotaryEmbedding, rope_inv_freq
    from minifer.models.llama import LlamaForCausalLM

    class Same(RotaryEmbedding):
        def _compute_inv_freq(self):
            return rope_inv_freq(self.head_dim, self.theta)

    class Reversed(RotaryEmbedding):  # the slowest rotation on the first pair: must show in the tokens
        def _compute_inv_freq(self):
            return rope_inv_freq(self.head_dim, self.theta).flip(0)

    def llm(rotary):
        model_cls = type("Llama", (LlamaForCausalLM,), {"rotary_cls": rotary})
        return LLM("tinystories-target", components=Components(model_registry={"LlamaForCausalLM": model_cls}))

    assert _tokens(llm(Same)) == reference[1]  # the same frequencies, the same arithmetic: the same tokens
    assert _tokens(llm(Reversed)) != reference[1]


def test_a_registered_model_class_is_refused_where_it_cannot_apply(reference, tmp_path):
    from minifer.model_loader.quantized import save_quantized
    from minifer.models.llama import LlamaForCausalLM

    registry = {"LlamaForCausalLM": type("Llama", (LlamaForCausalLM,), {})}
    with pytest.raises(ValueError, match="share_weights_with: .* LlamaForCausalLM, this one is to be a Llama"):
        LLM("tinystories-target", share_weights_with=reference[0], components=Components(model_registry=registry))
    with pytest.raises(TypeError, match=r"model_registry\['LlamaForCausalLM'\] must be a subclass of LlamaForCausalLM"):
        LLM("tinystories-target", components=Components(model_registry={"LlamaForCausalLM": torch.nn.Linear}))
    saved = save_quantized(LLM("tinystories-target", quantization="int8"), tmp_path / "int8")
    with pytest.raises(ValueError, match="quantized checkpoint, loaded into minifer's own modules"):
        LLM(str(saved), components=Components(model_registry=registry))  # its layout fixes the modules


def test_every_seam_in_components_is_the_one_used(reference):
    calls: list[str] = []
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}

    class Verifier(RejectionVerifier):
        def greedy(self, draft_tokens, target_argmax):
            calls.append("verifier")
            return super().greedy(draft_tokens, target_argmax)

    mine = Components(model_registry={"LlamaForCausalLM": _counted_model(calls)},
                      sampler=_counting(ModelRunner.sample, calls, "sampler"), verifier=Verifier())
    llm = LLM("tinystories-target", speculative_config=spec, components=mine)
    assert _tokens(llm) == reference[1]
    assert {"sampler", "verifier", "rms_norm", "apply_rotary"} <= set(calls)
    assert llm.components.given().keys() == {"model_registry", "sampler", "verifier"}


def test_a_seam_given_as_an_option_or_where_it_cannot_apply_is_refused(reference):
    # components is the one way to hand in a seam: as a keyword it is no option, and the error says where it goes
    with pytest.raises(TypeError, match=r"engine seam 'sampler'.*components=Components\(sampler=\.\.\.\)"):
        LLM("tinystories-target", share_weights_with=reference[0], sampler=ModelRunner.sample)
    with pytest.raises(ValueError, match="plug into the continuous engine"):
        LLM("tinystories-target", share_weights_with=reference[0], batching="static",
            components=Components(sampler=ModelRunner.sample))
    with pytest.raises(TypeError, match="components must be"):
        LLM("tinystories-target", share_weights_with=reference[0], components={"sampler": ModelRunner.sample})
