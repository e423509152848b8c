"""``EngineArgs``: every option of an engine in one dataclass, each with its default and its check (vLLM's
``vllm/engine/arg_utils.py``).

``LLM`` names the options most runs set and passes every other keyword here, so its signature stays short enough
to read while each option is defined once. The server's command line (``from_cli_args``) and the data-parallel
replicas (``to_kwargs``) build their engines from the same value, so an option added here reaches all of them.

What the value alone decides is checked here, before any weights load. What depends on the machine or the
checkpoint (``dtype="auto"``, ``device=None``, ``max_model_len``'s upper bound) ``LLM`` resolves once it has
them, as vLLM's ``create_engine_config`` does; ``speculative_config`` and ``compilation_config`` are checked key by
key by what they build (``SpeculativeConfig.from_dict``, ``runner.compile_model``). The engine's seams are
objects, not options: they go in ``components`` (``minifer.engine.components.Components``), never here.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minifer.core.sched.scheduler import SchedulerConfig
from minifer.engine.components import Components
from minifer.engine.llm_engine import CacheConfig
from minifer.quantization.kv_cache import check_kv_cache_dtype
from minifer.quantization.model import check_quantization

if TYPE_CHECKING:
    import argparse

    import torch

BATCHING = ("continuous", "static")
LOAD_FORMATS = ("auto", "safetensors", "dummy")  # what ``minifer.model_loader.build_model`` reads


@dataclass
class EngineArgs:
    """The engine's options; ``LLM(model, **options)`` takes any of them by name. Defaults of the cache and the
    scheduler are their configs' own (``CacheConfig``, ``SchedulerConfig``), as in vLLM."""

    #: A bundled name (``"tinystories-target"``), a local HF checkpoint directory, or a hub id.
    model: str | Path
    #: Another folder to take the tokenizer from (default: the model's).
    tokenizer: str | Path | None = None
    #: ``"auto"`` (``config.auto_dtype``: float32 on CPU, bfloat16 or float16 on CUDA) or a dtype or its name.
    dtype: str | torch.dtype = "auto"
    #: ``"cpu"``, ``"cuda"``, or None for the best available (vLLM has none: it runs on its platform).
    device: str | torch.device | None = None
    #: Seeds the draws of requests that carry no seed of their own.
    seed: int = 0
    #: Longest prompt + output (default: the model's ``max_position_embeddings``, also the upper bound).
    max_model_len: int | None = None
    #: ``"auto"`` / ``"safetensors"``, or ``"dummy"`` (random weights of the real shape).
    load_format: str = "auto"
    #: ``"continuous"`` (iteration-level scheduling over the paged KV cache, chapters 02-03) or ``"static"`` (padded
    #: batches with a contiguous cache, the baseline of chapter 03).
    batching: str = "continuous"
    #: How many sequences share a batch.
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    #: The scheduler's per-step token budget.
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    #: Split a prompt longer than the step's budget over several steps.
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    #: Tokens per paged KV block (continuous batching).
    block_size: int = CacheConfig.block_size
    #: KV blocks to allocate, overriding the memory budget (vLLM's ``num_gpu_blocks_override``).
    num_kv_blocks: int | None = CacheConfig.num_kv_blocks
    #: Bytes of KV cache on the CPU (vLLM's ``kv_cache_memory_bytes``).
    kv_cache_memory: int = CacheConfig.kv_cache_memory
    #: Fraction of the GPU's free memory the KV cache may take, in (0, 1].
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    #: Reuse the KV blocks of a prompt prefix computed before.
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    #: ``"auto"`` (the model's dtype) or ``"int8"`` / ``"fp8"``: 8-bit keys and values, about twice the sequences in
    #: the same memory (chapter 05).
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    #: ``"token"`` (a float16 scale per token and head, chosen as it is written) or ``"head"`` (one static scale per
    #: layer and head, calibrated at start-up; vLLM's are per layer).
    kv_cache_scales: str = CacheConfig.kv_cache_scales
    #: None, ``"int8"``, ``"int4"`` (g128, symmetric) or ``"fp8"``: weight-only, round-to-nearest on load (chapter
    #: 05; ``minifer.quantization``); ``"w8a8"``: int8 weights and each token's activations rounded to int8 (vLLM's INT8
    #: W8A8). Each means the same numerics on every device. A folder written by ``save_quantized`` loads quantized
    #: anyway.
    quantization: str | None = None
    #: vLLM's dict, e.g. ``{"method": "draft_model", "model": "tinystories-draft", "num_speculative_tokens": 4}`` or
    #: ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}``;
    #: ``"adaptive": False`` fixes k (chapter 04). ``"eagle"`` / ``"eagle3"`` take a trained head as ``model``.
    speculative_config: dict[str, Any] | None = None
    #: On CUDA, decode steps replay CUDA graphs unless this is True.
    enforce_eager: bool = False
    #: The CPU options ``pack_weights``, ``level`` (or ``mode``) and ``column_major_weights``
    #: (``engine.runner.compile_model`` says what each does); all off by default, so the model a learner reads is
    #: the one that runs.
    compilation_config: dict[str, Any] | None = None
    #: The most candidates ``logprobs`` and ``prompt_logprobs`` may ask for.
    max_logprobs: int = 20
    #: ``generate`` splits its requests over this many engine replicas, each a process with one torch thread
    #: (``features.data_parallel``: on a CPU, the way to use a second core).
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory", "data_parallel_size"):
            _check_int(self, name, low=1)
        _check_int(self, "num_kv_blocks", low=1, optional=True)
        _check_int(self, "max_model_len", low=2, optional=True)
        _check_int(self, "max_logprobs", low=0)
        _check_int(self, "seed")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        gpu = self.gpu_memory_utilization
        if isinstance(gpu, bool) or not isinstance(gpu, (int, float)) or not 0 < gpu <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu!r}")
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be 'static' or 'continuous', got {self.batching!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}")
        check_kv_cache_dtype(self.kv_cache_dtype, self.kv_cache_scales)
        if self.quantization is not None:
            check_quantization(self.quantization)
        if self.batching != "continuous":  # the static baseline has a contiguous cache and no engine step
            if self.kv_cache_dtype != "auto":
                raise ValueError("kv_cache_dtype applies to the paged cache of batching='continuous'")
            if self.speculative_config is not None:
                raise ValueError("speculative decoding runs inside the continuous engine: use batching='continuous'")

    @classmethod
    def from_kwargs(cls, caller: Callable[..., Any] | None = None, **kwargs: Any) -> EngineArgs:
        """``cls(**kwargs)``, but a keyword that is no option raises a ``TypeError`` naming it with the closest name
        ``caller`` (``LLM.__init__``) accepts, or, for one of the engine's seams, where seams go: a typo should not
        cost a reading of the dataclass."""
        caller, options = caller or cls.__init__, {f.name for f in fields(cls)}
        for name in sorted(set(kwargs) - options):
            where = caller.__qualname__.removesuffix(".__init__")
            if name in {f.name for f in fields(Components)}:
                raise TypeError(f"{where}() got the engine seam {name!r} as an option: seams go in "
                                f"components=Components({name}=...) (minifer.engine.components)")
            close = difflib.get_close_matches(name, sorted(options | set(inspect.signature(caller).parameters)), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f" (the options: {sorted(options)})"
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}{hint}")
        return cls(**kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options a parsed command line carries (the flags whose ``dest`` is a field's name); vLLM's name."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def to_kwargs(self) -> dict[str, Any]:
        """The options as ``LLM``'s keyword arguments: ``LLM(**args.to_kwargs())`` builds the same engine (what the
        data-parallel replicas are started with, in their own processes)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # not asdict: it would deep-copy the values

    def create_cache_config(self) -> CacheConfig:
        """The paged KV cache's part of these options."""
        return CacheConfig(self.block_size, self.num_kv_blocks, self.kv_cache_memory, self.gpu_memory_utilization,
                           self.enable_prefix_caching, self.kv_cache_dtype, self.kv_cache_scales)

    def create_scheduler_config(self) -> SchedulerConfig:
        """The scheduler's part of these options."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill)


def _check_int(args: EngineArgs, name: str, low: int | None = None, optional: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless its value is an integer (not a bool) of at least ``low``."""
    value = getattr(args, name)
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        kind = "an integer" if low is None else "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"{name} must be {kind}{' or None' if optional else ''}, got {value!r}")

