"""``LLM``: the offline entry point, with vLLM's signature (and its place, ``vllm/entrypoints/llm.py``) so a learner's
code moves to vLLM unchanged.

    from minifer import LLM, SamplingParams
    llm = LLM("tinystories-target")                       # or a local HF folder, or "Qwen/Qwen3-0.6B"
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceT
from pathlib import Path
from typing import Any

import torch

from minifer.beam_search import BeamSearch, BeamSearchOutput
from minifer.config import ModelConfig, resolve_device, resolve_dtype
from minifer.engine.arg_utils import EngineArgs
from minifer.engine.components import Components, as_components, check_seams
from minifer.engine.data_parallel import EngineReplicas, start_replicas
from minifer.engine.llm_engine import EngineConfig, LLMEngine
from minifer.engine.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from minifer.engine.static import generate_static
from minifer.model_loader import (
    build_model,
    chat_token_ids,
    load_config,
    load_tokenizer,
    resolve_model,
)
from minifer.models.llama import LlamaForCausalLM
from minifer.models.llama_eagle import EagleHead, load_eagle_head
from minifer.outputs import RequestOutput
from minifer.request import ParentRequest, Request, sequences_of
from minifer.sampling_params import BeamSearchParams, SamplingParams
from minifer.spec_decode.eagle import split_eagle3
from minifer.worker.model_runner import compile_model

Prompt = str | dict[str, Any]


def _replicas(args: EngineArgs, components: Components | None, shared: LLM | None) -> EngineReplicas | None:
    """``data_parallel.start_replicas`` when there are replicas to start: each replica process builds
    ``LLM(**options)`` from these same options, less ``data_parallel_size`` (a replica is one engine)."""
    if args.data_parallel_size == 1:
        return None
    options = {**args.to_kwargs(), "components": components, "share_weights_with": shared}
    del options["data_parallel_size"]
    return start_replicas(LLM, options, args.data_parallel_size, shared)


def _speculative(config: dict | SpeculativeConfig | None) -> tuple[SpeculativeConfig | None, bool | None]:
    """The engine's ``SpeculativeConfig`` and which EAGLE head ``"eagle3"`` asks for (``eagle.split_eagle3``)."""
    if config is None:
        return None, None
    eagle3 = None
    if isinstance(config, dict) and config.get("method") in ("eagle", "eagle3"):
        config, eagle3 = split_eagle3(config)  # "eagle3": an "eagle" of fused layers
    return SpeculativeConfig.from_dict(config), eagle3


class LLM:
    """A model, its tokenizer, and a generation loop.

    ``LLM(model, *, <the options most runs set>, **options)``, as vLLM's: every option is a field of
    ``EngineArgs`` (``minifer.engine.arg_utils``, which says what each does, its default and its check); the
    common ones are named here so that an editor shows them, and any other is passed by name (``block_size=32``,
    ``kv_cache_dtype="int8"``, ``data_parallel_size=2``, ...). A name that is no option raises a ``TypeError`` with
    the closest one. ``engine_args`` holds the options as given; ``device``, ``dtype`` and ``max_model_len`` the
    values they resolved to on this machine and checkpoint.

    Two arguments are objects rather than options, so they are not ``EngineArgs``' (an option can be written on a
    command line and sent to a replica process):
        components: a ``Components`` (``minifer.engine.components``) holding the engine's seams a caller replaces
            (``block_allocator``, ``scheduler``, ``sampler``, ``proposer``, ``verifier``, ``attention_backend``,
            ``quant_kernel``; ``LLMEngine`` lists their contracts) and the model classes to build (``model_registry``,
            vLLM's out-of-tree models: e.g. a model built from a learner's layer classes); a field left None runs the
            reference a chapter shows. The one way to hand in a seam: the
            course's way to run a learner's own pieces together (``minifer_course.workbench``).
        share_weights_with: another ``LLM`` of the same model, dtype, device and quantization whose loaded weights
            (and draft model, when both use the same draft) this one uses: two engines to compare in one process
            (chapter 04), without separate copies, whose placement in memory alone can change their speed.
    """

    def __init__(self, model: str | Path, *, tokenizer: str | Path | None = None,
                 dtype: str | torch.dtype = EngineArgs.dtype, device: str | torch.device | None = None,
                 seed: int = EngineArgs.seed, max_model_len: int | None = None,
                 max_num_seqs: int = EngineArgs.max_num_seqs, batching: str = EngineArgs.batching,
                 quantization: str | None = None, speculative_config: dict[str, Any] | None = None,
                 gpu_memory_utilization: float = EngineArgs.gpu_memory_utilization,
                 enforce_eager: bool = EngineArgs.enforce_eager, compilation_config: dict[str, Any] | None = None,
                 components: Components | None = None, share_weights_with: LLM | None = None,
                 **kwargs: Any) -> None:
        args = EngineArgs.from_kwargs(
            LLM.__init__, model=model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, batching=batching, quantization=quantization,
            speculative_config=speculative_config, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, compilation_config=compilation_config, **kwargs)
        self.engine_args = args
        parts = self.components = as_components(components)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.model_path = resolve_model(args.model, need_weights=args.load_format != "dummy")
        self.model_config: ModelConfig = load_config(self.model_path)
        limit = self.model_config.max_position_embeddings
        if args.max_model_len is not None and not args.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}] (the model's max_position_embeddings), "
                             f"got {args.max_model_len}")
        self.max_model_len = args.max_model_len or limit
        self.max_num_seqs, self.batching, self.seed = args.max_num_seqs, args.batching, args.seed
        self.max_logprobs = args.max_logprobs
        model_cls = parts.model_cls(self.model_config.architecture, LlamaForCausalLM)
        if share_weights_with is not None:
            self.model = self._shared_model(share_weights_with, model_cls)
        else:
            self.model = self._load_model(args, parts, limit, model_cls)
        self.compilation_config = compile_model(self.model, args.compilation_config, share_weights_with,
                                                args.enforce_eager)
        self.replicas = _replicas(args, components, share_weights_with)
        self.quantization_config = getattr(self.model, "quantization_config", None)
        tokenizer_path = self.model_path if args.tokenizer is None else resolve_model(args.tokenizer)
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.eos_token_ids = frozenset(self._eos_ids())
        self._generator = torch.Generator(device=self.device).manual_seed(args.seed)
        self._counter = itertools.count()
        self.engine: LLMEngine | None = None
        spec, self._eagle3 = _speculative(args.speculative_config)
        self.draft_model = self._drafter(spec, share_weights_with)
        check_seams(parts, args.batching, spec)
        if args.batching == "continuous":
            config = EngineConfig(args.create_cache_config(), args.create_scheduler_config(), spec,
                                  cuda_graphs=not args.enforce_eager, max_model_len=self.max_model_len)
            self.engine = LLMEngine(self.model, self.tokenizer, self.make_sequence, config,
                                    draft_model=self.draft_model, components=parts)

    def _drafter(self, spec: SpeculativeConfig | None, shared: LLM | None) -> torch.nn.Module | None:
        """The draft model (``shared``'s when it loaded the same one), or the EAGLE head (it reads this target's
        features, so it is bound to it)."""
        self._draft_source = spec.model if spec is not None and spec.method == "draft_model" else None
        if shared is not None and self._draft_source is not None and shared._draft_source == self._draft_source:
            spec.model = shared.draft_model  # the same draft, already loaded
        if spec is not None and spec.method == "draft_model":
            return self._load_draft(spec)
        if spec is not None and spec.method == "eagle":
            return load_eagle_head(resolve_model(spec.model), self.model, self.dtype,
                                   self.max_model_len + MAX_SPECULATIVE_TOKENS, fused=self._eagle3,
                                   head_cls=self.components.model_cls("EagleHead", EagleHead))
        return None

    def _load_model(self, args: EngineArgs, parts: Components, max_positions: int,
                    model_cls: type[LlamaForCausalLM]) -> torch.nn.Module:
        """The target's weights in a ``model_cls`` (quantized as asked), its quantized layers on ``parts.quant_kernel``
        or the device's default (``kernels.quant_kernel_for``, else the reference)."""
        from minifer.kernels import quant_kernel_for
        from minifer.model_loader.quantized import load_model

        kernel = parts.quant_kernel or quant_kernel_for(self.device)  # weight-only; "w8a8" rounds activations first
        return load_model(self.model_path, args.quantization, load_format=args.load_format, quant_kernel=kernel,
                          dtype=self.dtype, device=self.device, max_positions=max_positions, seed=args.seed,
                          model_cls=model_cls)

    def _shared_model(self, other: "LLM", model_cls: type[LlamaForCausalLM]) -> torch.nn.Module:
        """``other``'s loaded model, after checking it is the model this engine was asked for."""
        if not isinstance(other, LLM):
            raise TypeError(f"share_weights_with must be an LLM, got {type(other).__name__}")
        if type(other.model) is not model_cls:
            raise ValueError(f"share_weights_with: the other LLM's model is a {type(other.model).__name__}, this one "
                             f"is to be a {model_cls.__name__} (components.model_registry): load it instead")
        mine, theirs = self.engine_args, other.engine_args
        want = (self.model_path, self.dtype, self.device, mine.quantization, mine.load_format)
        have = (other.model_path, other.dtype, other.device, theirs.quantization, theirs.load_format)
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

    def make_sequence(self, i: int, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Request:
        """Validate one request and turn it into a ``Request`` (errors name the prompt and the field)."""
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
        return Request(request_id or str(next(self._counter)), text, ids, params, max_tokens,
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
        "length"); the server (``minifer.entrypoints.openai.serve``) refuses such an explicit one instead, as vLLM's does.
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
        requests = [ParentRequest.fan_out(s) if s.params.n > 1 else s for s in seqs]
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

    def _run_engine(self, requests: list[Request | ParentRequest], bar) -> None:
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
        finished sequences, best first (``beam_search.py``, chapter 02). It needs the engine idle: no other
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
