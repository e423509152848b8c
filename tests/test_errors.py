"""Bad input fails early with a clear error that names the field or the thing at fault."""

from __future__ import annotations

import json
import shutil

import pytest

import minifer
from minifer import ModelLoadError, SamplingParams, UnsupportedModelError

# --- SamplingParams ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=-2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(n=0), "n"),
    (dict(n=1.5), "n"),
    (dict(n=True), "n"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(max_tokens=1), dict(temperature=0), dict(top_p=1.0), dict(top_k=-1),
                                    dict(top_k=0), dict(min_p=0.0), dict(min_p=1.0), dict(max_tokens=None),
                                    dict(n=1), dict(n=8)])
def test_boundary_sampling_params_are_accepted(kwargs):
    SamplingParams(**kwargs)


# --- prompts ----------------------------------------------------------------------------------------


def test_empty_prompt(target_llm):
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        target_llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1.*prompt_token_ids.*non-empty"):
        target_llm.generate(["Tom", {"prompt_token_ids": []}], use_tqdm=False)


def test_prompt_longer_than_max_model_len():
    llm = minifer.LLM("tinystories-target", dtype="float32", device="cpu", max_model_len=16)
    with pytest.raises(ValueError, match=r"prompt 1 has 20 tokens.*max_model_len=16"):
        llm.generate([{"prompt_token_ids": [5] * 3}, {"prompt_token_ids": [5] * 20}], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=16"):  # equal length leaves no room for output
        llm.generate({"prompt_token_ids": [5] * 16}, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5] * 15}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"  # clipped to what max_model_len leaves


@pytest.mark.parametrize("bad", [2048, -1, 10**9])
def test_token_id_out_of_vocabulary(target_llm, bad):
    with pytest.raises(ValueError, match=rf"token id {bad}.*vocabulary \(size 2048\)"):
        target_llm.generate({"prompt_token_ids": [1, bad, 2]}, use_tqdm=False)


def test_wrong_number_of_sampling_params(target_llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        target_llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_sampling_params_of_wrong_type(target_llm):
    with pytest.raises(TypeError, match="SamplingParams"):
        target_llm.generate(["a"], [{"temperature": 0}], use_tqdm=False)


def test_prompt_of_wrong_type(target_llm):
    with pytest.raises(ValueError, match="prompt 0 must be a string or a dict"):
        target_llm.generate([123], use_tqdm=False)


def test_validation_happens_before_any_work(target_llm, monkeypatch):
    import minifer.engine.llm as llm_mod

    def boom(*a, **k):
        raise AssertionError("generation started before all prompts were validated")

    monkeypatch.setattr(llm_mod, "generate_static", boom)
    with pytest.raises(ValueError, match="prompt 2"):
        target_llm.generate(["Tom", "Sue", {"prompt_token_ids": [4096]}], use_tqdm=False)


# --- models -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["no-such-model", "./no/such/dir", "/definitely/not/here"])
def test_unknown_model(name):
    with pytest.raises(ModelLoadError, match="not found"):
        minifer.LLM(name, device="cpu")


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json"):
        minifer.LLM(str(tmp_path), device="cpu")


@pytest.fixture
def tiny_copy(tiny_checkpoint, tmp_path):
    """A writable copy of the tiny llama checkpoint."""
    _, folder = tiny_checkpoint("llama")
    dest = tmp_path / "ckpt"
    shutil.copytree(folder, dest)
    return dest


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def test_corrupt_safetensors(tiny_copy):
    (tiny_copy / "model.safetensors").write_bytes(b"\x13\x37 definitely not a safetensors header" * 10)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read safetensors"):
        minifer.LLM(str(tiny_copy), device="cpu")


def test_folder_without_weights(tiny_copy):
    (tiny_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        minifer.LLM(str(tiny_copy), device="cpu")


def test_shape_mismatch(tiny_copy):
    _edit_config(tiny_copy, intermediate_size=64)  # the checkpoint has 128
    with pytest.raises(ModelLoadError, match=r"mlp\.(gate_up|down)_proj\.weight has shape \((256, 96|96, 128)\), "
                                             r"config\.json implies \((128, 96|96, 64)\)"):
        minifer.LLM(str(tiny_copy), device="cpu")


def test_missing_tensors(tiny_copy):
    _edit_config(tiny_copy, num_hidden_layers=3)  # the checkpoint has 2 layers
    with pytest.raises(ModelLoadError, match=r"does not match.*missing.*layers\.2\."):
        minifer.LLM(str(tiny_copy), device="cpu")


def test_unsupported_architecture(tiny_copy):
    _edit_config(tiny_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'GPT2LMHeadModel'"):
        minifer.LLM(str(tiny_copy), device="cpu")


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_scaling(tiny_copy, style):
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    if style == "rope_parameters":
        _edit_config(tiny_copy, rope_parameters={"rope_theta": 10000.0, **yarn})
    else:
        _edit_config(tiny_copy, rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="unsupported rope scaling 'yarn'"):
        minifer.LLM(str(tiny_copy), device="cpu")


@pytest.mark.parametrize("changes, what", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_key_value_heads=4), "num_key_value_heads"),   # 6 heads are not a multiple of 4
    (dict(hidden_size=0), "hidden_size"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(sliding_window=16), "sliding"),
])
def test_other_unsupported_configs(tiny_copy, changes, what):
    _edit_config(tiny_copy, **changes)
    with pytest.raises(UnsupportedModelError, match=what):
        minifer.LLM(str(tiny_copy), device="cpu")


def test_invalid_config_json(tiny_copy):
    (tiny_copy / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="not valid JSON"):
        minifer.LLM(str(tiny_copy), device="cpu")


def test_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no cached snapshot can answer
    import huggingface_hub.constants as hub_constants

    # huggingface_hub reads the variables at import, which already happened: set what it read, too
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(ModelLoadError, match=r"(?s)could not download 'Qwen/Qwen3-0\.6B'.*offline.*local checkpoint "
                                             r"directory") as info:
        minifer.LLM("Qwen/Qwen3-0.6B", device="cpu")
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained hub traceback


def test_max_model_len_above_model_limit():
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 1024\].*got 4096"):
        minifer.LLM("tinystories-target", device="cpu", max_model_len=4096)
    with pytest.raises(ValueError, match="max_model_len"):
        minifer.LLM("tinystories-target", device="cpu", max_model_len=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dtype="float8"), "unsupported dtype 'float8'"),
    (dict(load_format="pt"), "load_format must be"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(batching="dynamic"), "batching must be"),
])
def test_bad_llm_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        minifer.LLM("tinystories-target", device="cpu", **kwargs)


def test_text_prompt_without_tokenizer(tiny_checkpoint):
    _, folder = tiny_checkpoint("llama")
    llm = minifer.LLM(str(folder), device="cpu")
    with pytest.raises(ValueError, match="no tokenizer.*prompt_token_ids"):
        llm.generate("hello", use_tqdm=False)
