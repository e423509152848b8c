"""EAGLE-3's fusion (``"method": "eagle3"``): the target exposes the inputs of the low, middle and high layers a head
names (vLLM's ``eagle_aux_hidden_state_layer_ids``) only when one asks, its last hidden state unchanged; the fused
head reads their concatenation through one linear map; the engine keeps its guarantees with it (greedy tokens
identical to the target alone in a mixed continuous batch, its own paged cache rolled back and freed; preemption,
prefix caching and the chi-squared test of the sampled distribution are test_eagle.py's, run for both methods); a
head of the other kind is refused by name; the training script's ``--eagle3`` runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from test_eagle import EAGLE3, _assert_nothing_leaked
from spec_helpers import GREEDY, mixed_prompts, story_prompts, tokens

from minifer import LLM, SamplingParams
from minifer.attention.layer import causal_backend
from minifer.model_loader import resolve_model
from minifer.models.llama_eagle import AUX_KEY, EagleHead, eagle3_aux_layers, load_eagle_head

@pytest.fixture(scope="module")
def plain():
    return LLM("tinystories-target", max_num_seqs=32)


def test_eagle3_default_layers_are_low_middle_and_high():
    assert eagle3_aux_layers(12) == (2, 6, 9)  # vLLM's (2, L // 2, L - 3)
    assert json.loads((resolve_model("tinystories-target-eagle3") / "config.json").read_text())[AUX_KEY] == [2, 6, 9]


@pytest.mark.parametrize("ids", [[], [2, 2], [12], [-1]])
def test_bad_layer_ids_are_refused(plain, ids):
    with pytest.raises(ValueError, match=AUX_KEY):
        EagleHead(plain.model, aux_layers=ids)


def test_the_target_exposes_the_layers_only_when_asked(target_llm):
    """The inputs of layers 2, 6 and 9 are the residual stream after layers 1, 5 and 8, computed here layer by
    layer; asking for them leaves the last hidden state bit-identical, and not asking leaves nothing behind."""
    model = target_llm.model
    ids = torch.tensor([0, 412, 77, 901, 15, 1300, 5])
    attn, positions = causal_backend(model, 1, len(ids))
    plain_out = model(ids, positions, attn)
    assert model.model.aux_hidden_states is None
    model.model.aux_hidden_state_layers = (2, 6, 9)
    try:
        attn, positions = causal_backend(model, 1, len(ids))
        out = model(ids, positions, attn)
        aux = model.model.aux_hidden_states
    finally:
        model.model.aux_hidden_state_layers, model.model.aux_hidden_states = (), None
    assert torch.equal(out, plain_out)
    attn, positions = causal_backend(model, 1, len(ids))
    x = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary(positions, x.dtype)
    want = []
    for i, layer in enumerate(model.model.layers):
        if i in (2, 6, 9):
            want.append(x)
        x = layer(x, cos, sin, attn)
    assert len(aux) == 3 and all(torch.allclose(a, w, atol=1e-5) for a, w in zip(aux, want))
    assert not torch.allclose(aux[0], aux[2])  # three different depths, not one state thrice


@pytest.mark.parametrize("config", [EAGLE3, {**EAGLE3, "adaptive": True}], ids=["k4", "adaptive"])
def test_greedy_tokens_identical_in_a_mixed_batch(plain, heldout_stories, config):
    prompts = story_prompts(heldout_stories, 20) + mixed_prompts(12, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=8 + (i * 5) % 31, ignore_eos=True) for i in range(len(prompts))]
    want = tokens(plain.generate(prompts, params, use_tqdm=False))
    llm = LLM("tinystories-target", max_num_seqs=32, speculative_config=config, share_weights_with=plain)
    proposer = llm.engine.speculator.proposer
    assert proposer.head.aux_layers == (2, 6, 9) and proposer.head.feature_size == 3 * 256
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    _assert_nothing_leaked(llm)
    if not config.get("adaptive"):
        assert llm.stats()["spec_num_proposed"] > 0


def test_the_shipped_fused_head_agrees_with_the_target(plain, heldout_stories):
    record = json.loads((resolve_model("tinystories-target-eagle3") / "training.json").read_text())
    assert record["recipe"]["aux_layers"] == [2, 6, 9]
    assert record["heldout_top1_agreement_per_draft_position"][0] > 0.5
    llm = LLM("tinystories-target", max_num_seqs=8, share_weights_with=plain,
              speculative_config={**EAGLE3, "adaptive": False})
    llm.generate(story_prompts(heldout_stories, 8), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                 use_tqdm=False)
    assert llm.stats()["spec_alpha"] > 0.3


@pytest.mark.parametrize("method, model, match", [
    ("eagle3", "tinystories-target-eagle", "method 'eagle'"),
    ("eagle", "tinystories-target-eagle3", "method 'eagle3'"),
    ("eagle3", None, "needs speculative_config\\['model'\\]")])
def test_a_head_of_the_other_kind_is_refused(plain, method, model, match):
    config = {"method": method, "num_speculative_tokens": 2, **({"model": model} if model else {})}
    with pytest.raises(ValueError, match=match):
        LLM("tinystories-target", speculative_config=config, share_weights_with=plain)


def test_save_and_load_keep_the_fusion(plain, tmp_path):
    head = EagleHead(plain.model, draft_vocab=torch.arange(0, 2048, 3), intermediate_size=64, aux_layers=(1, 4))
    head.save(tmp_path, {"hidden_size": 256, "vocab_size": 2048, "intermediate_size": 64})
    back = load_eagle_head(tmp_path, plain.model, torch.float32, fused=True)
    assert back.aux_layers == (1, 4) and back.combine.in_features == 2 * 256
    assert torch.equal(back.combine.weight, head.combine.weight.to(torch.bfloat16).float())


def test_a_forward_that_did_not_expose_the_layers_is_an_error(plain):
    """A CUDA graph replays the target without running its Python forward: the proposer must not read the layers
    a previous forward left."""
    llm = LLM("tinystories-target", share_weights_with=plain, speculative_config={**EAGLE3, "adaptive": False})
    proposer = llm.engine.speculator.proposer
    proposer.target.aux_hidden_states = None
    with pytest.raises(RuntimeError, match="enforce_eager"):
        proposer.observe(["r"], [0], [[1, 2]], torch.zeros(2, 256))


@pytest.mark.slow
def test_training_script_eagle3_smoke(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train_eagle.py"), "--smoke", "--threads", "1",
                           "--aux-layers", "1,5,10", "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "config.json").read_text())[AUX_KEY] == [1, 5, 10]
    llm = LLM("tinystories-target", speculative_config={**EAGLE3, "model": str(tmp_path), "adaptive": False})
    out = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == GREEDY.max_tokens
