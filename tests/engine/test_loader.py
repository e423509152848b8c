"""Loading: sharded checkpoints, dummy weights from a config alone, parameter counts, the bundled pair."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import MODELS_DIR, TINY_VOCAB, hf_classes, hf_config, minifer_forward

import minifer
from minifer import ModelConfig, ModelLoadError
from minifer.model_loader import ASSETS, SHIPPED_CONFIGS

IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]


def llm_at(path, **kw) -> minifer.LLM:
    return minifer.LLM(str(path), dtype="float32", device="cpu", **kw)


# --- sharded checkpoints ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory):
    hf, folder = tiny_checkpoint("llama")
    dest = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(dest, safe_serialization=True, max_shard_size="20KB")
    return folder, dest


def test_sharded_checkpoint_loads_identically(sharded):
    single, shards = sharded
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in shards.glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    a, b = llm_at(single), llm_at(shards)
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(minifer_forward(a, IDS), minifer_forward(b, IDS))


def test_sharded_checkpoint_with_missing_shard(sharded, tmp_path):
    _, shards = sharded
    dest = tmp_path / "broken"
    shutil.copytree(shards, dest)
    victim = sorted(dest.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"shards listed in the index are missing: {victim.name}"):
        llm_at(dest)


def test_tied_checkpoint_that_also_stores_lm_head(tiny_checkpoint, tmp_path):
    """Some tied checkpoints (e.g. Qwen3-0.6B) still store lm_head.weight; it must not break loading."""
    from safetensors.torch import load_file, save_file

    hf, folder = tiny_checkpoint("qwen2")
    dest = tmp_path / "with-head"
    shutil.copytree(folder, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    llm = llm_at(dest)
    assert llm.model.lm_head.weight is llm.model.model.embed_tokens.weight
    assert torch.equal(minifer_forward(llm, IDS), minifer_forward(llm_at(folder), IDS))


def test_tied_embeddings_share_storage(tiny_checkpoint):
    _, folder = tiny_checkpoint("qwen2")
    model = llm_at(folder).model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_load_format_safetensors_equals_auto(tiny_checkpoint):
    _, folder = tiny_checkpoint("qwen3")
    a, b = llm_at(folder), llm_at(folder, load_format="safetensors")
    assert torch.equal(minifer_forward(a, IDS), minifer_forward(b, IDS))


# --- dummy weights from a config, and parameter counts ----------------------------------------------

TINY_VARIANTS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen3-attention-bias": ("qwen3", dict(attention_bias=True)),
    "llama-attention-and-mlp-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
}


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_dummy_load_from_config_and_parameter_count(variant, tmp_path):
    kind, overrides = TINY_VARIANTS[variant]
    hf_config(kind, **overrides).save_pretrained(tmp_path)  # the folder holds only config.json
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    _, model_cls = hf_classes(kind)
    with torch.device("meta"):
        hf_count = sum(p.numel() for p in model_cls(hf_config(kind, **overrides)).parameters())
    for where in (tmp_path, tmp_path / "config.json"):
        llm = llm_at(where, load_format="dummy")
        real = sum(p.numel() for p in llm.model.parameters())  # parameters() counts a tied matrix once
        assert real == hf_count, "the built architecture differs from transformers'"
        assert llm.model_config.num_parameters() == real, f"{variant}: num_parameters() != the model's"
        assert llm.tokenizer is None
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, minifer.SamplingParams(temperature=0, max_tokens=3,
                                                                                   ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3 and all(0 <= t < TINY_VOCAB for t in out[0].outputs[0].token_ids)


def test_dummy_weights_are_seeded_and_config_only_needs_dummy(tmp_path):
    hf_config("qwen3").save_pretrained(tmp_path)
    a, b = llm_at(tmp_path, load_format="dummy", seed=1), llm_at(tmp_path, load_format="dummy", seed=1)
    c = llm_at(tmp_path, load_format="dummy", seed=2)
    assert torch.equal(minifer_forward(a, IDS), minifer_forward(b, IDS))
    assert not torch.equal(minifer_forward(a, IDS), minifer_forward(c, IDS))
    with pytest.raises(ModelLoadError, match="no \\*\\.safetensors|config only"):
        llm_at(tmp_path)
    with pytest.raises(ModelLoadError, match="config only.*load_format='dummy'"):
        llm_at(tmp_path / "config.json")


EXPECTED_SHIPPED = {  # hub id -> published parameter count (tied matrices counted once)
    "Qwen/Qwen3-0.6B": 596_049_920,
    "Qwen/Qwen3-1.7B": 1_720_574_976,
    "meta-llama/Llama-3.2-1B": 1_235_814_400,
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
}


def _shipped_path(name):
    path = ASSETS / "configs" / (name.replace("/", "--") + ".json")
    if not path.is_file():
        pytest.skip(f"{path.name} is not shipped in minifer/assets/configs")
    return path


@pytest.mark.parametrize("name", list(EXPECTED_SHIPPED))
def test_shipped_config_parameter_counts(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _shipped_path(name)
    assert SHIPPED_CONFIGS[name] == path
    cfg = ModelConfig.from_file(path)
    raw = json.loads(path.read_text())
    hf_cfg = AutoConfig.for_model(raw.pop("model_type"), **raw)
    with torch.device("meta"):
        hf_count = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_cfg).parameters())
    assert cfg.num_parameters() == hf_count
    assert abs(cfg.num_parameters() - EXPECTED_SHIPPED[name]) / EXPECTED_SHIPPED[name] < 0.001


@pytest.mark.slow
def test_dummy_qwen3_0_6b_offline(monkeypatch, tmp_path):
    path = _shipped_path("Qwen/Qwen3-0.6B")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    llm = minifer.LLM("Qwen/Qwen3-0.6B", load_format="dummy", dtype="float32", device="cpu", max_model_len=64,
                      num_kv_blocks=8)
    assert llm.model_path == path and llm.tokenizer is None
    cfg = llm.model_config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.head_dim, cfg.qk_norm) == ("Qwen3ForCausalLM", 28, 128, True)
    assert sum(p.numel() for p in llm.model.parameters()) == cfg.num_parameters() == 596_049_920
    out = llm.generate({"prompt_token_ids": [9707, 11, 1879]}, minifer.SamplingParams(temperature=0, max_tokens=2),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 2 and all(0 <= t < cfg.vocab_size for t in out.token_ids)


# --- the bundled pair -------------------------------------------------------------------------------


def test_bundled_pair_loads_by_name(target_llm, draft_llm):
    for llm, name, layers, tied in ((target_llm, "tinystories-target", 12, False),
                                    (draft_llm, "tinystories-draft", 2, True)):
        assert llm.model_path == MODELS_DIR / name
        cfg = llm.model_config
        assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.tie_word_embeddings) == (2048, layers, tied)
        assert sum(p.numel() for p in llm.model.parameters()) == cfg.num_parameters()
        assert 0 in llm.eos_token_ids


def test_bundled_tokenizer_round_trips(target_llm, draft_llm, heldout_stories):
    tok = target_llm.get_tokenizer()
    for text in heldout_stories[:5] + ["Once upon a time, Tom's dog said: \"Hi!\"\n  Then 42 cats ran."]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id == 0
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert draft_llm.get_tokenizer()(text)["input_ids"] == ids, "the pair must share one tokenizer"
    assert len(tok) == 2048


def test_bundled_pair_generates_text(target_llm, draft_llm):
    for llm in (target_llm, draft_llm):
        out = llm.generate("Once upon a time", minifer.SamplingParams(temperature=0, max_tokens=12),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.text.split()) >= 5 and out.text.isascii()


def test_every_token_of_the_bundled_pair_has_a_trained_embedding(target_llm, draft_llm):
    """The first training left the target's ``<|endoftext|>`` row (every prompt's BOS) at zero through
    ``nn.Embedding(padding_idx=0)``; ``scripts/repair_bos_row.py`` trained it (its record is in the target's
    ``training.json``). A zero row would make position 0's logits all zero and ``""`` generate nothing."""
    for llm in (target_llm, draft_llm):
        rows = llm.model.model.embed_tokens.weight.abs().sum(dim=1)
        assert bool((rows > 0).all()), f"{llm.model_path.name}: untrained embedding rows {rows.eq(0).nonzero()}"
        first = llm.generate("", minifer.SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0].outputs[0]
        assert first.token_ids[0] not in llm.eos_token_ids, f"{llm.model_path.name} cannot start a story from BOS"
    # The empty prompt (BOS alone) starts a story: a few sentences, not an immediate end of text.
    story = target_llm.generate("", minifer.SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert len(story.token_ids) >= 32 and story.text.count(" ") >= 16, story.text


def test_dtype_auto_on_cpu_is_float32():
    llm = minifer.LLM("tinystories-draft", device="cpu")
    assert llm.dtype == torch.float32
    assert {p.dtype for p in llm.model.parameters()} == {torch.float32}
    bf16 = minifer.LLM("tinystories-draft", device="cpu", dtype="bfloat16")
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}


def test_checkpoint_weights_arrive_unchanged(tiny_checkpoint):
    """Every transformers tensor lands in minifer's fused parameters in the right place."""
    hf, folder = tiny_checkpoint("qwen2")
    ours = llm_at(folder).model.state_dict()
    theirs = hf.state_dict()
    layer = "model.layers.1."
    qkv = torch.cat([theirs[layer + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(ours[layer + "self_attn.qkv_proj.weight"], qkv)
    assert torch.equal(ours[layer + "self_attn.qkv_proj.bias"],
                       torch.cat([theirs[layer + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
    gate_up = torch.cat([theirs[layer + "mlp.gate_proj.weight"], theirs[layer + "mlp.up_proj.weight"]])
    assert torch.equal(ours[layer + "mlp.gate_up_proj.weight"], gate_up)
    assert torch.equal(ours["model.norm.weight"], theirs["model.norm.weight"])
