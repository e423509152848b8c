"""The EAGLE head's reduced draft vocabulary (EAGLE-3's ``draft_vocab_size``, ``d2t`` and ``t2d`` as vLLM loads
them): a draft id maps back to the right target id, the logits put each draft logit at its target id and ``-inf``
everywhere else, a saved head round-trips, malformed vocabularies are refused by name, and a head whose vocabulary
misses tokens the target emits never proposes them yet stays lossless (greedy-identical, the target's sampled
distribution by a chi-squared test)."""

from __future__ import annotations

import json

import pytest
import torch
from test_eagle import EAGLE
from spec_helpers import (
    PROMPT,
    _second_token_test,
    mixed_prompts,
    story_prompts,
    tokens,
)

from minifer import LLM, SamplingParams
from minifer.model_loader import resolve_model
from minifer.models.llama_eagle import EagleHead, draft_to_target_offsets, load_eagle_head


@pytest.fixture(scope="module")
def plain():
    return LLM("tinystories-target", max_num_seqs=32)


def _subset(vocab: int, size: int, seed: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size]


def test_d2t_is_eagle3s_offset_map_and_maps_each_draft_id_back(plain):
    target = plain.model
    vocab = target.lm_head.weight.shape[0]
    ids = _subset(vocab, 300, seed=0)  # unsorted on purpose: the offsets may be negative, the map still exact
    head = EagleHead(target, draft_vocab=ids)
    assert torch.equal(head.d2t, ids - torch.arange(300))  # EAGLE-3: target = draft + d2t[draft]
    assert torch.equal(head.to_target(torch.arange(300)), ids)
    assert torch.equal(head.t2d.nonzero()[:, 0], ids.sort().values)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[ids].float())  # starts as the target's rows
    feats = torch.randn(5, target.config.hidden_size)
    with torch.inference_mode():
        draft, full = head.draft_logits(feats), head.logits(feats)
    assert full.shape == (5, vocab)
    assert torch.equal(full[:, ids], draft)
    assert bool(torch.isneginf(full[:, ~head.t2d]).all())  # never proposed
    assert torch.equal(full.argmax(-1), head.to_target(draft.argmax(-1)))  # a proposal is the right target id


def test_the_whole_vocabulary_is_the_identity_map(plain):
    head = EagleHead(plain.model)
    assert bool((head.d2t == 0).all()) and bool(head.t2d.all())
    feats = torch.randn(3, plain.model.config.hidden_size)
    with torch.inference_mode():
        assert torch.equal(head.logits(feats), plain.model.lm_head(feats))


@pytest.mark.parametrize("ids, match", [([], "empty"), ([3, 3, 4], "repeats"), ([0, 5000], "target ids in"),
                                        ([-1, 2], "target ids in")])
def test_a_malformed_draft_vocabulary_is_refused(ids, match):
    with pytest.raises(ValueError, match=match):
        draft_to_target_offsets(torch.tensor(ids, dtype=torch.long), 2048)


def test_save_and_load_keep_the_map(plain, tmp_path):
    target = plain.model
    ids = _subset(target.lm_head.weight.shape[0], 512, seed=1).sort().values
    head = EagleHead(target, draft_vocab=ids)
    head.save(tmp_path, {"target": "tinystories-target", "hidden_size": 256, "num_hidden_layers": 1,
                         "vocab_size": 2048, "draft_vocab_size": 512})
    back = load_eagle_head(tmp_path, target, torch.float32)
    assert back.draft_vocab_size == 512 and torch.equal(back.to_target(torch.arange(512)), ids)
    assert torch.equal(back.t2d, head.t2d)


def test_a_head_whose_t2d_disagrees_with_d2t_is_refused(plain, tmp_path):
    from safetensors.torch import load_file, save_file

    head = EagleHead(plain.model, draft_vocab=torch.arange(100, 400))
    head.save(tmp_path, {"target": "tinystories-target", "hidden_size": 256, "num_hidden_layers": 1})
    state = load_file(str(tmp_path / "model.safetensors"))
    state["t2d"][100] = False
    state["t2d"][5] = True
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="t2d does not mark"):
        load_eagle_head(tmp_path, plain.model, torch.float32)


def test_a_head_for_another_vocabulary_is_refused(plain, tmp_path):
    EagleHead(plain.model).save(tmp_path, {"target": "x", "hidden_size": 256, "num_hidden_layers": 1,
                                           "vocab_size": 4096})
    with pytest.raises(ValueError, match="4096-token vocabulary"):
        load_eagle_head(tmp_path, plain.model, torch.float32)


@pytest.fixture(scope="module")
def missing(plain, tmp_path_factory, heldout_stories):
    """The shipped head cut to a vocabulary without the target's 40 most frequent greedy tokens on these stories
    (so the target emits them often and the head can never draft them), saved as a head of its own."""
    prompts = story_prompts(heldout_stories, 12)
    out = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    counts = torch.bincount(torch.tensor([t for o in out for t in o.outputs[0].token_ids]), minlength=2048)
    banned = counts.argsort(descending=True)[:40]
    shipped = load_eagle_head(resolve_model("tinystories-target-eagle"), plain.model, torch.float32)
    keep = shipped.draft_ids[~torch.isin(shipped.draft_ids, banned)]
    cut = EagleHead(plain.model, draft_vocab=keep, intermediate_size=shipped.config.intermediate_size)
    state = {k: v for k, v in shipped.state_dict().items() if k not in ("d2t", "t2d", "lm_head.weight")}
    cut.load_state_dict({**state, "d2t": cut.d2t, "t2d": cut.t2d,
                         "lm_head.weight": shipped.lm_head.weight[~torch.isin(shipped.draft_ids, banned)]})
    path = tmp_path_factory.mktemp("eagle_missing")
    cut.save(path, {**json.loads((resolve_model("tinystories-target-eagle") / "config.json").read_text()),
                    "draft_vocab_size": len(keep)})
    return path, set(banned.tolist()), prompts


def test_a_vocabulary_that_misses_tokens_never_proposes_them_and_stays_greedy_identical(plain, missing):
    path, banned, stories = missing
    prompts = stories + mixed_prompts(6, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=8 + (i * 5) % 21, ignore_eos=True) for i in range(len(prompts))]
    want = tokens(plain.generate(prompts, params, use_tqdm=False))
    assert banned & {t for seq in want for t in seq}, "the target never emitted a missing token: nothing is tested"
    llm = LLM("tinystories-target", max_num_seqs=32, share_weights_with=plain,
              speculative_config={**EAGLE, "model": str(path), "adaptive": False})
    proposer = llm.engine.speculator.proposer
    proposed: list[int] = []
    inner = proposer.propose

    def propose(seqs, ks, vocab_size):
        drafts = inner(seqs, ks, vocab_size)
        proposed.extend(t for d in drafts for t in d.tokens)
        return drafts

    proposer.propose = propose
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == want
    assert proposed and not banned & set(proposed)
    assert llm.stats()["spec_num_accepted"] > 0


@pytest.mark.slow
def test_a_vocabulary_that_misses_tokens_samples_the_targets_distribution(target_llm, missing):
    path = missing[0]
    llm = LLM("tinystories-target", max_num_seqs=64, speculative_config={**EAGLE, "model": str(path),
                                                                          "num_speculative_tokens": 3,
                                                                          "adaptive": False})
    p = _second_token_test(llm, target_llm, PROMPT, SamplingParams(temperature=1.0), n=1200)
    assert p > 0.01, f"a reduced draft vocabulary changed the distribution (chi-squared p = {p:.2g})"
