"""Bad input fails early with a clear error that names the field or the thing at fault."""

from __future__ import annotations

import json
import shutil

import pytest

import minifer
from minifer import ModelLoadError, SamplingParams, UnsupportedModelError

pytestmark = pytest.mark.core  # the fast tier (tests/README.md)

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
    # values that used to pass here and then fail inside a step (failing every request of its batch)
    (dict(logprobs=True), "logprobs"),
    (dict(prompt_logprobs=True), "prompt_logprobs"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(min_tokens=True), "min_tokens"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=10**20), "top_k"),
    (dict(top_k=2**31), "top_k"),
    (dict(seed=True), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop=5), "stop"),
    (dict(stop={"x": 1}), "stop"),
    (dict(ignore_eos="false"), "ignore_eos"),
    (dict(ignore_eos=0), "ignore_eos"),
    (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(skip_special_tokens="false"), "skip_special_tokens"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(temperature=1e39), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="1"), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(repetition_penalty=1e-50), "repetition_penalty"),
    (dict(repetition_penalty=1e50), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(repetition_penalty="1.2"), "repetition_penalty"),
    (dict(top_p="0.5"), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p="0.1"), "min_p"),
    (dict(logit_bias={True: 1}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(max_tokens=1), dict(temperature=0), dict(top_p=1.0), dict(top_k=-1),
                                    dict(top_k=0), dict(min_p=0.0), dict(min_p=1.0), dict(max_tokens=None),
                                    dict(n=1), dict(n=8), dict(top_k=2**31 - 1), dict(seed=2**63 - 1),
                                    dict(seed=-(2**63)), dict(repetition_penalty=0.01), dict(repetition_penalty=100),
                                    dict(temperature=3e38), dict(stop_token_ids=(1, 2)), dict(stop=("a", "b"))])
def test_boundary_sampling_params_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(top_k=2**31 - 1, temperature=1.0), dict(seed=2**63 - 1, n=2),
                                    dict(repetition_penalty=0.01), dict(repetition_penalty=100, temperature=1.0),
                                    dict(temperature=3e38, top_k=3), dict(temperature=0.01, logit_bias={5: 100})])
def test_extreme_accepted_values_run(target_llm, kwargs):
    """The bounds are where a step still works: each of these generates (and a greedy row next to it is unchanged)."""
    params = SamplingParams(max_tokens=4, ignore_eos=True, **kwargs)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = target_llm.generate(["Tom"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    outs = target_llm.generate(["Tom", "Tom"], [params, greedy], use_tqdm=False)
    assert all(len(c.token_ids) == 4 for c in outs[0].outputs) and outs[1].outputs[0].token_ids == want


# --- prompts ----------------------------------------------------------------------------------------


def test_empty_prompt(target_llm):
    """"" is a prompt when the tokenizer adds a BOS token (vLLM accepts it); one that tokenizes to nothing is not."""
    out = target_llm.generate("", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt_token_ids == [0] and out.outputs[0].token_ids
    no_bos = minifer.LLM("tinystories-target", share_weights_with=target_llm)
    no_bos.tokenizer = lambda text: {"input_ids": []}
    with pytest.raises(ValueError, match="prompt 0 is empty: it tokenizes to no tokens"):
        no_bos.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 1.*prompt_token_ids.*non-empty"):
        target_llm.generate(["Tom", {"prompt_token_ids": []}], use_tqdm=False)


def test_the_online_engine_names_the_prompt_it_is_given(target_llm):
    engine = minifer.LLM("tinystories-target", share_weights_with=target_llm).engine
    with pytest.raises(ValueError, match="prompt 0: prompt_token_ids must be"):
        engine.add_request("a", {"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(ValueError, match="prompt 2: prompt_token_ids must be"):
        engine.add_request("b", {"prompt_token_ids": []}, SamplingParams(), prompt_index=2)


def test_masking_every_token_until_min_tokens_is_refused(target_llm):
    every = list(range(target_llm.model_config.vocab_size))
    with pytest.raises(ValueError, match="prompt 0: stop_token_ids and EOS cover the whole vocabulary.*min_tokens=2"):
        target_llm.generate("Tom", SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=every), use_tqdm=False)
    out = target_llm.generate("Tom", SamplingParams(temperature=1.0, min_tokens=2, max_tokens=3,
                                                    stop_token_ids=every[1:], ignore_eos=True),
                              use_tqdm=False)  # EOS (0), ignored, is left to sample
    assert out[0].outputs[0].token_ids[:2] == [0, 0]


def test_a_failed_step_leaves_the_llm_usable(target_llm, monkeypatch):
    """A step that raises must not leave its requests in the engine for the next ``generate`` to trip over."""
    llm = minifer.LLM("tinystories-target", share_weights_with=target_llm)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate(["Tom", "Lily"], params, use_tqdm=False)
    real = llm.engine.sampler

    def broken(*args, **kwargs):
        raise RuntimeError("injected sampling fault")

    monkeypatch.setattr(llm.engine, "sampler", broken)  # the engine's sampler seam
    with pytest.raises(RuntimeError, match="injected sampling fault"):
        llm.generate(["Tom", "Lily"], params, use_tqdm=False)
    monkeypatch.setattr(llm.engine, "sampler", real)
    assert not llm.engine.requests
    got = llm.generate(["Tom", "Lily"], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


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
    import minifer.entrypoints.llm as llm_mod

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
