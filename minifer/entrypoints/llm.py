"""``LLM``: the offline entry point, with vLLM's signature (and its place, ``vllm/entrypoints/llm.py``) so a learner's
code moves to vLLM unchanged.

    from minifer import LLM, SamplingParams
    llm = LLM("tinystories-target")                       # or a local HF folder, or "Qwen/Qwen3-0.6B"
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Sequence as SequenceT
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from minifer.config import ModelConfig, resolve_device, resolve_dtype
from minifer.engine.components import SEAMS, Components, check_seams, merge_components
from minifer.engine.llm_engine import CacheConfig, LLMEngine
from minifer.engine.runner import compile_model
from minifer.engine.scheduler import SchedulerConfig
from minifer.engine.sequence import Sequence, SequenceGroup, sequences_of
from minifer.engine.static import generate_static
from minifer.layers.kv_quant import check_kv_cache_dtype
from minifer.loader import (
    build_model,
    chat_token_ids,
    load_config,
    load_tokenizer,
    resolve_model,
)
from minifer.models.llama import LlamaForCausalLM
from minifer.outputs import RequestOutput
from minifer.sampling import BeamSearchParams, SamplingParams

if TYPE_CHECKING:  # the features a run does not ask for are imported where it asks (a result then fingerprints
    # only the code it ran: minifer.bench.provenance)
    from minifer.features.beam_search import BeamSearchOutput
    from minifer.engine.block_manager import KVBlockAllocator
    from minifer.features.data_parallel import EngineReplicas
    from minifer.engine.speculative import SpeculativeConfig
    from minifer.engine.proposers import DraftProposer
    from minifer.engine.scheduler import SchedulerPolicy
    from minifer.layers.paged_attention import PagedAttentionBackend
    from minifer.quant.linear import QuantKernel
    from minifer.sampling import Sampler
    from minifer.spec.rejection import Verifier

Prompt = str | dict[str, Any]


def _replicas(llm_kwargs: dict[str, Any], size: Any, shared: LLM | None) -> EngineReplicas | None:
    """``data_parallel.start_replicas``, imported only when there are replicas to start (or a size to refuse)."""
    if isinstance(size, int) and size == 1:
        return None
    from minifer.features.data_parallel import start_replicas

    return start_replicas(LLM, llm_kwargs, size, shared)


def _speculative(config: dict | SpeculativeConfig | None) -> tuple[SpeculativeConfig | None, bool | None]:
    """The engine's ``SpeculativeConfig`` and which EAGLE head ``"eagle3"`` asks for (``eagle.split_eagle3``);
    speculation's modules are imported only when it is asked for."""
    if config is None:
        return None, None
    from minifer.engine.speculative import SpeculativeConfig

    eagle3 = None
    if isinstance(config, dict) and config.get("method") in ("eagle", "eagle3"):
        from minifer.features.eagle import split_eagle3

        config, eagle3 = split_eagle3(config)  # "eagle3": an "eagle" of fused layers
    return SpeculativeConfig.from_dict(config), eagle3


def _check_options(batching: str, max_num_seqs: Any, kv_cache_dtype: str, kv_cache_scales: str) -> None:
    check_kv_cache_dtype(kv_cache_dtype, kv_cache_scales)
    if kv_cache_dtype != "auto" and batching != "continuous":
        raise ValueError("kv_cache_dtype applies to the paged cache of batching='continuous'")
    if batching not in ("static", "continuous"):
        raise ValueError(f"batching must be 'static' or 'continuous', got {batching!r}")
    if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")


class LLM:
    """A model, its tokenizer, and a generation loop.

    Args:
        model: bundled name (``"tinystories-target"``), local HF checkpoint directory, or hub id.
        tokenizer: another folder to take the tokenizer from (default: the model's).
        dtype: ``"auto"`` (``config.auto_dtype``: float32 on CPU, bfloat16 or float16 on CUDA) or a dtype name.
        device: ``"cpu"``, ``"cuda"`` or None for the best available.
        seed: seeds the draws of requests that carry no seed of their own.
        max_model_len: longest prompt + output (default: the model's ``max_position_embeddings``).
        load_format: ``"auto"`` (safetensors) or ``"dummy"`` (random weights of the real shape).
        max_num_seqs: how many sequences share a batch.
        batching: ``"continuous"`` (iteration-level scheduling over the paged KV cache, chapters 02-03)
            or ``"static"`` (padded batches with a contiguous cache, the baseline of chapter 03).
        block_size, num_kv_blocks, kv_cache_memory, gpu_memory_utilization, enable_prefix_caching:
            the paged KV cache (continuous batching only); see ``CacheConfig``.
        max_num_batched_tokens, enable_chunked_prefill: the scheduler's per-step token budget.
        speculative_config: vLLM's dict, e.g. ``{"method": "draft_model", "model": "tinystories-draft",
            "num_speculative_tokens": 4}`` or ``{"method": "ngram", "num_speculative_tokens": 4,
            "prompt_lookup_max": 4, "prompt_lookup_min": 1}``; ``"adaptive": False`` fixes k (chapter 04). ``"eagle"``
            / ``"eagle3"`` take a trained head as ``model`` (``"tinystories-target-eagle"``, ``"-eagle3"``).
        kv_cache_dtype: ``"auto"`` (the model's dtype) or ``"int8"`` / ``"fp8"``: 8-bit keys and values, about
            twice the sequences in the same memory (chapter 05).
        kv_cache_scales: ``"token"`` (the default: a float16 scale per token and head, chosen as it is written)
            or ``"head"`` (one static scale per layer and head, calibrated at start-up; vLLM's are per layer).
        enforce_eager: on CUDA, decode steps replay CUDA graphs unless this is True (vLLM's name).
        quantization: None, ``"int8"``, ``"int4"`` (g128, symmetric) or ``"fp8"``: weight-only, round-to-nearest
            on load (chapter 05; ``minifer.quant``); ``"w8a8"``: int8 weights and each token's activations rounded
            to int8 (vLLM's INT8 W8A8; on the CPU an integer GEMM, faster than dequantizing the weights every
            step). Each means the same numerics on every device. A folder written by ``save_quantized`` loads
            quantized anyway.
        max_logprobs: the most candidates ``logprobs`` and ``prompt_logprobs`` may ask for (vLLM's limit).
        quant_kernel: what quantized layers multiply through (a weight-only ``QuantKernel``,
            ``minifer.quant.linear``; with ``"w8a8"`` it multiplies the rounded activations); default: Triton on
            CUDA, the PyTorch reference on the CPU (for ``"w8a8"``: the integer GEMM, ``w8a8_linear``).
        data_parallel_size: vLLM's name: ``generate`` splits its requests over this many engine replicas, each a
            process with one torch thread (``features.data_parallel``: on a CPU, the way to use a second core).
        compilation_config: vLLM's name; minifer reads the CPU options ``pack_weights``, ``level`` (or ``mode``) and
            ``column_major_weights`` (``engine.runner.compile_model`` says what each does).
            All are off by default, so the model a learner reads is the one that runs.
        block_allocator, scheduler, sampler, proposer, verifier, attention_backend: the engine's seams
            (``LLMEngine`` lists their contracts); None builds the reference implementation a chapter shows.
        components: a ``Components`` holding any of those seams and ``quant_kernel``, plus the model classes to build
            (``model_registry``, vLLM's out-of-tree models: e.g. a model built from a learner's layer classes): the
            course's way to run a learner's own pieces together (``minifer_course.workbench``). A piece may be given
            here or as an argument, not both.
        share_weights_with: another ``LLM`` of the same model, dtype, device and quantization whose loaded weights
            (and draft model, when both use the same draft) this one uses: two engines to compare in one process
            (chapter 04), without separate copies, whose placement in memory alone can change their speed.
    """

    def __init__(self, model: str | Path, *, tokenizer: str | Path | None = None, dtype: str | torch.dtype = "auto",
                 device: str | torch.device | None = None, seed: int = 0, max_model_len: int | None = None,
                 load_format: str = "auto", max_num_seqs: int = 16, batching: str = "continuous",
                 block_size: int = 16, num_kv_blocks: int | None = None, kv_cache_memory: int = 256 * 2**20,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 speculative_config: dict[str, Any] | None = None, enforce_eager: bool = False,
                 kv_cache_dtype: str = "auto", quantization: str | None = None,
                 kv_cache_scales: str = "token", share_weights_with: "LLM | None" = None,
                 max_logprobs: int = 20, quant_kernel: QuantKernel | None = None,
                 block_allocator: Callable[..., KVBlockAllocator] | None = None,
                 scheduler: Callable[..., SchedulerPolicy] | None = None, sampler: Sampler | None = None,
                 proposer: DraftProposer | None = None, verifier: Verifier | None = None,
                 attention_backend: Callable[..., PagedAttentionBackend] | None = None,
                 compilation_config: dict[str, Any] | None = None, data_parallel_size: int = 1,
                 components: Components | None = None) -> None:
        replica_kwargs = {k: v for k, v in locals().items() if k not in ("self", "data_parallel_size")}
        parts = merge_components(components, block_allocator=block_allocator, scheduler=scheduler, sampler=sampler,
                                 proposer=proposer, verifier=verifier, attention_backend=attention_backend,
                                 quant_kernel=quant_kernel)
        self.components = parts
        _check_options(batching, max_num_seqs, kv_cache_dtype, kv_cache_scales)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model_path = resolve_model(model, need_weights=load_format != "dummy")
        self.model_config: ModelConfig = load_config(self.model_path)
        limit = self.model_config.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}] (the model's max_position_embeddings), "
                             f"got {max_model_len}")
        self.max_model_len = max_model_len or limit
        self.max_num_seqs, self.batching, self.seed = max_num_seqs, batching, seed
        self.max_logprobs = max_logprobs
        self._quantization, self._load_format = quantization, load_format  # what share_weights_with checks
        model_cls = parts.model_cls(self.model_config.architecture, LlamaForCausalLM)
        if share_weights_with is not None:
            self.model = self._shared_model(share_weights_with, quantization, load_format, model_cls)
        else:
            self.model = self._load_model(quantization, load_format, parts.quant_kernel, limit, seed, model_cls)
        self.compilation_config = compile_model(self.model, compilation_config, share_weights_with, enforce_eager)
        self.replicas = _replicas(replica_kwargs, data_parallel_size, share_weights_with)
        self.quantization_config = getattr(self.model, "quantization_config", None)
        self.tokenizer = load_tokenizer(resolve_model(tokenizer) if tokenizer is not None else self.model_path)
        self.eos_token_ids = frozenset(self._eos_ids())
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._counter = itertools.count()
        self.engine: LLMEngine | None = None
        spec, self._eagle3 = _speculative(speculative_config)
        if spec is not None and batching != "continuous":
            raise ValueError("speculative decoding runs inside the continuous engine: use batching='continuous'")
        self.draft_model = self._drafter(spec, share_weights_with)
        seams = check_seams(batching, spec, **{n: getattr(parts, n) for n in SEAMS})
        if batching == "continuous":
            self.engine = LLMEngine(
                self.model, self.tokenizer, self.make_sequence,
                CacheConfig(block_size, num_kv_blocks, kv_cache_memory, gpu_memory_utilization, enable_prefix_caching,
                            kv_cache_dtype, kv_cache_scales),
                SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill), spec, self.draft_model,
                cuda_graphs=not enforce_eager, max_model_len=self.max_model_len, **seams)

    def _drafter(self, spec: SpeculativeConfig | None, shared: LLM | None) -> torch.nn.Module | None:
        """The draft model (``shared``'s when it loaded the same one), or the EAGLE head (it reads this target's
        features, so it is bound to it)."""
        self._draft_source = spec.model if spec is not None and spec.method == "draft_model" else None
        if shared is not None and self._draft_source is not None and shared._draft_source == self._draft_source:
            spec.model = shared.draft_model  # the same draft, already loaded
        if spec is not None and spec.method == "draft_model":
            return self._load_draft(spec)
        if spec is not None and spec.method == "eagle":
            from minifer.engine.speculative import MAX_SPECULATIVE_TOKENS
            from minifer.features.eagle_head import load_eagle_head

            from minifer.features.eagle_head import EagleHead

            return load_eagle_head(resolve_model(spec.model), self.model, self.dtype,
                                   self.max_model_len + MAX_SPECULATIVE_TOKENS, fused=self._eagle3,
                                   head_cls=self.components.model_cls("EagleHead", EagleHead))
        return None

    def _load_model(self, quantization: str | None, load_format: str, quant_kernel: QuantKernel | None,
                    max_positions: int, seed: int, model_cls: type[LlamaForCausalLM]) -> torch.nn.Module:
        """The target's weights in a ``model_cls`` (quantized as asked), its quantized layers on ``quant_kernel`` or the
        device's default (``kernels.quant_kernel_for``, else the reference)."""
        from minifer.kernels import quant_kernel_for
        from minifer.loader.quantized import load_model

        kernel = quant_kernel or quant_kernel_for(self.device)  # weight-only; "w8a8" rounds activations before it
        return load_model(self.model_path, quantization, load_format=load_format, quant_kernel=kernel,
                          dtype=self.dtype, device=self.device, max_positions=max_positions, seed=seed,
                          model_cls=model_cls)

    def _shared_model(self, other: "LLM", quantization: str | None, load_format: str,
                      model_cls: type[LlamaForCausalLM]) -> torch.nn.Module:
        """``other``'s loaded model, after checking it is the model this engine was asked for."""
        if not isinstance(other, LLM):
            raise TypeError(f"share_weights_with must be an LLM, got {type(other).__name__}")
        if type(other.model) is not model_cls:
            raise ValueError(f"share_weights_with: the other LLM's model is a {type(other.model).__name__}, this one "
                             f"is to be a {model_cls.__name__} (components.model_registry): load it instead")
        want = (self.model_path, self.dtype, self.device, quantization, load_format)
        have = (other.model_path, other.dtype, other.device, other._quantization, other._load_format)
        names = ("model", "dtype", "device", "quantization", "load_format")
        diff = [f"{n} {w!r} vs {h!r}" for n, w, h in zip(names, want, have) if w != h]
        if diff:
            raise ValueError(f"share_weights_with: the other LLM was loaded differently ({'; '.join(diff)}); "
                             "only identical weights can be shared")
        return other.model

    def _load_draft(self, spec: SpeculativeConfig) -> torch.nn.Module:
        """Load the draft (same device and dtype) and check it speaks the target's vocabulary: drafts are
        compared with the target token by token, so both must number tokens identically."""
        if isinstance(spec.model, torch.nn.Module):
            draft, draft_cfg, draft_tok = spec.model, spec.model.config, None
        else:
            path = resolve_model(spec.model)
            draft_cfg = load_config(path)
            draft = build_model(path, load_format="auto", dtype=self.dtype, device=self.device,
                                max_positions=max(self.max_model_len, draft_cfg.max_position_embeddings),
                                seed=self.seed,
                                model_cls=self.components.model_cls(draft_cfg.architecture, LlamaForCausalLM))
            draft_tok = load_tokenizer(path)
        if draft_cfg.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {draft_cfg.vocab_size} tokens but the target's has "
                             f"{self.model_config.vocab_size}: a draft must use the target's tokenizer")
        if draft_tok is not None and self.tokenizer is not None and draft_tok.get_vocab() != self.tokenizer.get_vocab():
            raise ValueError("the draft model's tokenizer differs from the target's (same size, different tokens): "
                             "a draft must use the target's tokenizer")
        return draft

    def stats(self) -> dict[str, float | int]:
        """KV-cache and scheduler statistics of the continuous engine."""
        if self.engine is None:
            raise ValueError("stats() needs batching='continuous' (the static baseline has no paged cache)")
        return self.engine.stats()

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_cfg = self.model_path / "generation_config.json" if self.model_path.is_dir() else None
        if gen_cfg is not None and gen_cfg.is_file():
            import json

            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def get_tokenizer(self):
        return self.tokenizer

    # --- requests -----------------------------------------------------------------------------------

    def _prompt_ids(self, i: int, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {i} is text but this model has no tokenizer (dummy weights?): "
                                 f"pass {{'prompt_token_ids': [...]}}")
            ids = list(self.tokenizer(prompt)["input_ids"])
            if not ids:  # "" is a prompt when the tokenizer adds a BOS token (as vLLM accepts it); else nothing is
                raise ValueError(f"prompt {i} is empty: it tokenizes to no tokens (this tokenizer adds no BOS token)")
            return prompt, ids
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"prompt {i}: prompt_token_ids must be a non-empty list of token ids")
            vocab = self.model_config.vocab_size
            for t in ids:
                if not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"prompt {i}: token id {t!r} is out of the vocabulary (size {vocab})")
            return prompt.get("prompt"), list(ids)
        raise ValueError(f"prompt {i} must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def make_sequence(self, i: int, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Validate one request and turn it into a ``Sequence`` (errors name the prompt and the field)."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params for prompt {i} must be a SamplingParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(i, prompt)
        vocab = self.model_config.vocab_size
        for t in params.logit_bias or {}:
            if t >= vocab:
                raise ValueError(f"prompt {i}: logit_bias names token id {t}, out of the vocabulary (size {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise ValueError(f"prompt {i}: {name}={asked} is more than max_logprobs={self.max_logprobs} "
                                 f"(LLM(max_logprobs=...) raises the limit)")
        if params.prompt_logprobs is not None and self.engine is None:
            raise ValueError(f"prompt {i}: prompt_logprobs needs batching='continuous' (the static baseline computes "
                             "logits for the last prompt token only)")
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"prompt {i}: stop_token_ids has {t}, out of the vocabulary (size {vocab})")
        self._check_something_to_sample(i, params)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt {i} has {len(ids)} tokens: it must be shorter than max_model_len="
                             f"{self.max_model_len} to leave room for output")
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        gen = self._generator
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        return Sequence(request_id or str(next(self._counter)), text, ids, params, max_tokens,
                        self.eos_token_ids, generator=gen)

    def _check_something_to_sample(self, i: int, params: SamplingParams) -> None:
        """Until ``min_tokens``, EOS and the stop tokens are masked out: if that is every token of the vocabulary,
        a sampled row would be all -inf, a NaN distribution that fails the step of the whole batch."""
        vocab = self.model_config.vocab_size
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if params.min_tokens and len({t for t in stops if t < vocab}) >= vocab:
            raise ValueError(f"prompt {i}: stop_token_ids and EOS cover the whole vocabulary, and min_tokens="
                             f"{params.min_tokens} masks them all: nothing is left to sample")

    def generate(self, prompts: Prompt | SequenceT[Prompt],
                 sampling_params: SamplingParams | SequenceT[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate a completion for every prompt; outputs come back in the order of the prompts.

        All prompts are validated before any work starts, so a bad one raises a ``ValueError`` naming it. A
        ``max_tokens`` beyond what ``max_model_len`` leaves after a prompt is clipped to that room (finish reason
        "length"); the server (``minifer.serve``) refuses such an explicit one instead, as vLLM's does.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts: "
                                 f"give one, or one per prompt")
        seqs = [self.make_sequence(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        if self.replicas is not None:  # validated here; generated by the replicas
            return self.replicas.generate(prompts, params, [s.num_tokens + (s.params.max_tokens or self.max_model_len) for s in seqs])
        requests = [SequenceGroup.fan_out(s) if s.params.n > 1 else s for s in seqs]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="Processed prompts", dynamic_ncols=True)
        if self.engine is None:
            counted: set[int] = set()

            def on_batch_done(_batch) -> None:  # a prompt is done when all its completions are
                for k, r in enumerate(requests):
                    if k not in counted and r.is_finished:
                        counted.add(k)
                        bar.update(1)

            generate_static(self.model, [s for r in requests for s in sequences_of(r)], self.max_num_seqs,
                            self.tokenizer, on_batch_done=on_batch_done if bar is not None else None)
        else:
            self._run_engine(requests, bar)
        if bar is not None:
            bar.close()
        return [r.to_output(self.tokenizer) for r in requests]

    def _run_engine(self, requests: list[Sequence | SequenceGroup], bar) -> None:
        engine = self.engine
        for r in requests:
            engine.scheduler.check_fits(sequences_of(r)[0])  # reject before anything runs, as for bad prompts
        added: list[str] = []
        try:
            for r in requests:
                engine.add_sequence(r)
                added.append(r.request_id)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and bar is not None:
                        bar.update(1)
        except BaseException:  # a failed step (or Ctrl-C) must not leave its requests behind for the next call
            for rid in added:
                if rid in engine.requests:
                    engine.abort_request(rid)
            raise

    def beam_search(self, prompts: Prompt | SequenceT[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``): each returns its ``params.beam_width`` best
        finished sequences, best first (``features/beam_search.py``, chapter 02). It needs the engine idle: no other
        requests under way, no server owning it."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if self.engine is None:
            raise ValueError("beam search runs on the paged KV cache: use batching='continuous'")
        self.engine._check_thread()
        if self.engine.has_unfinished_requests():
            raise RuntimeError("beam search needs the engine to itself: finish or abort its running requests first")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        ids = [self._prompt_ids(i, p)[1] for i, p in enumerate(prompts)]
        from minifer.features.beam_search import BeamSearch

        search = BeamSearch(self.engine, params, self.eos_token_ids, self.tokenizer, self.max_model_len,
                            self.max_num_seqs)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Beam search", dynamic_ncols=True)
        outputs = search.run(ids, on_finish=(lambda _i: bar.update(1)) if bar is not None else None)
        if bar is not None:
            bar.close()
        return outputs

    def chat(self, messages: list[dict[str, str]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """One conversation through the tokenizer's chat template (Qwen3 and Llama-3 instruct models)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        ids = chat_token_ids(self.tokenizer, messages)
        return self.generate([{"prompt_token_ids": ids}], sampling_params, use_tqdm=use_tqdm)
