"""``EngineArgs`` (``minifer.engine.arg_utils``): one definition of every engine option, which ``LLM`` takes by name
or through ``**kwargs``, the server builds from its flags and the data-parallel replicas are started with."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import minifer
from minifer import LLM
from minifer.engine.arg_utils import EngineArgs
from minifer.engine.llm_engine import CacheConfig
from minifer.core.sched.scheduler import SchedulerConfig

pytestmark = pytest.mark.core


def test_defaults_are_the_configs_own_and_llms():
    args = EngineArgs("tinystories-draft")
    assert args.create_cache_config() == CacheConfig()
    assert args.create_scheduler_config() == SchedulerConfig()
    assert (args.dtype, args.device, args.seed, args.batching, args.max_model_len) == ("auto", None, 0, "continuous",
                                                                                       None)
    # LLM's named options are EngineArgs fields with EngineArgs' defaults: one default per option
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    named = {n: p.default for n, p in inspect.signature(LLM.__init__).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in ("components", "share_weights_with")}
    assert named and all(defaults[n] == d for n, d in named.items()), named
    assert len(inspect.signature(LLM.__init__).parameters) - 2 <= 15  # less self and **kwargs


@pytest.mark.parametrize("field, value, match", [
    ("max_num_seqs", 0, "max_num_seqs must be a positive integer, got 0"),
    ("block_size", 16.0, "block_size must be a positive integer"),
    ("num_kv_blocks", 0, "num_kv_blocks must be a positive integer or None"),
    ("max_model_len", 1, "max_model_len must be an integer >= 2 or None, got 1"),
    ("max_logprobs", -1, "max_logprobs must be an integer >= 0"),
    ("data_parallel_size", True, "data_parallel_size must be a positive integer, got True"),
    ("gpu_memory_utilization", 0, r"gpu_memory_utilization must be in \(0, 1\]"),
    ("enable_prefix_caching", "yes", "enable_prefix_caching must be True or False"),
    ("batching", "dynamic", "batching must be 'static' or 'continuous'"),
    ("load_format", "pt", "load_format must be"),
    ("kv_cache_dtype", "int4", "kv_cache_dtype must be one of"),
    ("kv_cache_scales", "layer", "kv_cache_scales must be one of"),
    ("quantization", "int3", "unknown quantization 'int3'"),
])
def test_a_bad_value_is_refused_naming_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs("tinystories-draft", **{field: value})


def test_options_that_need_the_continuous_engine_are_refused_with_static_batching():
    with pytest.raises(ValueError, match="kv_cache_dtype applies to the paged cache"):
        EngineArgs("tinystories-draft", batching="static", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="speculative decoding runs inside the continuous engine"):
        EngineArgs("tinystories-draft", batching="static", speculative_config={"method": "ngram"})


def test_an_unknown_keyword_names_the_closest_option():
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument 'max_num_seq'; "
                                        r"did you mean 'max_num_seqs'\?"):
        LLM("tinystories-draft", max_num_seq=4)
    with pytest.raises(TypeError, match="'share_weight_with'; did you mean 'share_weights_with'"):  # LLM's own
        LLM("tinystories-draft", share_weight_with=None)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'qqq' \(the options: \['batching'"):
        EngineArgs.from_kwargs(model="tinystories-draft", qqq=1)


def test_llm_forwards_its_keyword_arguments_to_engine_args():
    llm = LLM("tinystories-draft", device="cpu", load_format="dummy", max_num_seqs=3, block_size=8, num_kv_blocks=40,
              max_num_batched_tokens=64, enable_prefix_caching=False, kv_cache_dtype="int8", max_logprobs=2)
    args = llm.engine_args
    assert isinstance(args, EngineArgs) and args.model == "tinystories-draft" and args.block_size == 8
    engine = llm.engine
    assert (engine.kv_cache_manager.block_size, engine.kv_cache_manager.num_blocks) == (8, 40)
    assert not engine.kv_cache_manager.enable_prefix_caching and engine.kv_cache.kv_cache_dtype == "int8"
    assert (engine.scheduler.config.max_num_seqs, engine.scheduler.config.max_num_batched_tokens) == (3, 64)
    assert llm.max_logprobs == 2
    assert minifer.EngineArgs is EngineArgs


def test_replicas_are_started_with_the_engine_args(monkeypatch):
    import minifer.entrypoints.llm as llm_module

    started = []
    monkeypatch.setattr(llm_module, "start_replicas", lambda *a: started.append(a))
    llm = LLM("tinystories-draft", device="cpu", load_format="dummy", block_size=8, data_parallel_size=2)
    (make_llm, options, size, shared), = started
    assert make_llm is LLM and size == 2 and shared is None
    want = {**llm.engine_args.to_kwargs(), "components": None, "share_weights_with": None}
    del want["data_parallel_size"]  # each replica is one engine
    assert options == want and options["block_size"] == 8


def test_the_command_line_becomes_engine_args():
    from minifer.entrypoints.openai.serve import make_arg_parser

    ns = make_arg_parser().parse_args(["tinystories-draft", "--port", "0", "--num-gpu-blocks-override", "12",
                                       "--no-enable-chunked-prefill", "--kv-cache-dtype", "fp8", "--seed", "3"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.model, args.num_kv_blocks, args.enable_chunked_prefill, args.kv_cache_dtype, args.seed) == (
        "tinystories-draft", 12, False, "fp8", 3)
    assert args.max_num_seqs == EngineArgs.max_num_seqs  # a flag not given keeps the default
