"""``LLMEngine``: the online engine — add requests at any time, advance all of them one step at a time.

    engine = LLMEngine.from_llm(LLM("tinystories-target"))   # a fresh engine; or LLM(...).engine
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=32))
    while engine.has_unfinished_requests():
        for out in engine.step():          # incremental RequestOutputs of the requests that advanced
            ...

Each ``step`` asks the scheduler for a batch (continuous batching over a paged KV cache), runs it, and
appends the sampled tokens. A request that cannot be served is rejected at ``add_request`` with a clear
error; the others are unaffected. Nothing admitted is lost: every request finishes, is aborted by
``abort_request``, or — when memory runs out — is preempted and later recomputed to the same output.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from minifer.attention.backends.paged import PagedAttentionBackend, PagedKVCache
from minifer.core.kv_cache_manager import KVCacheManager, scratch_sequence
from minifer.core.sched.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from minifer.engine.adaptive_k import build_adaptive_speculator
from minifer.engine.components import Components
from minifer.engine.core import StepParts, engine_step
from minifer.engine.speculative import SpeculativeConfig, Speculator, build_proposer
from minifer.models.llama import LlamaForCausalLM
from minifer.outputs import RequestOutput
from minifer.quantization.kv_cache import CALIBRATION_TEXT
from minifer.request import ParentRequest, Request, RequestStatus, sequences_of
from minifer.sample.sampler import Sampler
from minifer.worker.model_runner import ModelRunner


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # overrides the memory budget
    kv_cache_memory: int = 256 * 2**20  # bytes, on CPU
    gpu_memory_utilization: float = 0.9  # fraction of the GPU's free memory, on CUDA
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # or "int8" / "fp8": 8-bit codes + a scale per (token, head), chapter 05
    kv_cache_scales: str = "token"  # or "head": static per-(layer, head) scales calibrated at start-up

    def num_blocks(self, bytes_per_block: int, device: torch.device) -> int:
        if self.num_kv_blocks is not None:
            if self.num_kv_blocks < 1:
                raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
            return self.num_kv_blocks
        if device.type == "cuda":
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * self.gpu_memory_utilization) - 2 * 2**30  # headroom for activations
        else:
            budget = self.kv_cache_memory
        n = usable_blocks(budget, bytes_per_block)
        if n < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {bytes_per_block} bytes beyond the "
                             f"{PagedKVCache.RESERVED_BLOCKS} the cache reserves")
        return n


def usable_blocks(budget: int, bytes_per_block: int) -> int:
    """Blocks a request can get from ``budget`` bytes: the cache also allocates its scratch and null blocks
    (``PagedKVCache.RESERVED_BLOCKS``) from the same memory. At least 0."""
    return max(0, budget // bytes_per_block - PagedKVCache.RESERVED_BLOCKS)


def kv_block_bytes(model: LlamaForCausalLM, cache_config: CacheConfig,
                   draft_model: LlamaForCausalLM | None = None) -> int:
    """Bytes of one KV block as ``LLMEngine`` allocates it: the target's layers in the cache's format, plus, when
    a draft model speculates, the draft's block in its own dtype (its cache gets as many blocks, from the same
    budget)."""
    cfg = model.config
    per_block = PagedKVCache.bytes_per_block(cfg.num_hidden_layers, cache_config.block_size, cfg.num_key_value_heads,
                                             cfg.head_dim, model.lm_head.weight.dtype, cache_config.kv_cache_dtype,
                                             cache_config.kv_cache_scales)
    if draft_model is not None:
        d = draft_model.config
        per_block += PagedKVCache.bytes_per_block(d.num_hidden_layers, cache_config.block_size, d.num_key_value_heads,
                                                  d.head_dim, draft_model.lm_head.weight.dtype)
    return per_block


@dataclass(frozen=True)
class EngineConfig:
    """An ``LLMEngine``'s settings in one value, as vLLM hands its engine one ``VllmConfig``. ``cuda_graphs``: decode
    steps replay CUDA graphs (on CUDA, with the Triton kernels) captured up to ``max_model_len`` (None: the model's
    ``max_position_embeddings``); ``speculative_config`` None: no speculation."""

    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = None
    cuda_graphs: bool = False
    max_model_len: int | None = None


class LLMEngine:
    """The seams a chapter teaches are the fields of ``components`` (a ``Components``; None: the reference), each a
    ``typing.Protocol`` (or ``Callable`` type) whose docstring is its contract: ``block_allocator``
    (``KVBlockAllocator``, built as ``block_allocator(num_blocks, block_size, enable_prefix_caching)``:
    ``KVCacheManager``), ``scheduler`` (``SchedulerPolicy``, built as ``scheduler(scheduler_config, allocator)``:
    ``Scheduler``), ``sampler`` (``Sampler``: ``ModelRunner.sample``), ``attention_backend``
    (``PagedAttentionBackend``, built like ``PagedKVCache``, the default); for speculation (``draft_model``: the draft
    or EAGLE head) ``proposer`` (``DraftProposer``: the one ``speculative_config`` names) and ``verifier``
    (``Verifier``: ``RejectionVerifier``, vLLM's rejection sampler). ``quant_kernel`` and ``model_registry`` are the
    model's (``LLM`` builds it with them)."""

    def __init__(self, model: LlamaForCausalLM, tokenizer, make_sequence, config: EngineConfig, *,
                 draft_model: LlamaForCausalLM | None = None, components: Components | None = None) -> None:
        cfg, device, dtype = model.config, model.lm_head.weight.device, model.lm_head.weight.dtype
        cache_config, parts = config.cache_config, components or Components()
        num_blocks = cache_config.num_blocks(kv_block_bytes(model, cache_config, draft_model), device)
        self.tokenizer, self.cache_config = tokenizer, cache_config
        self._make_sequence = make_sequence
        self.kv_cache_manager = (parts.block_allocator or KVCacheManager)(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.kv_cache: PagedAttentionBackend = (parts.attention_backend or PagedKVCache)(
            cfg.num_hidden_layers, num_blocks, cache_config.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype,
            device, cache_config.kv_cache_dtype, cache_config.kv_cache_scales)
        self.scheduler = (parts.scheduler or Scheduler)(config.scheduler_config, self.kv_cache_manager)
        self.runner = ModelRunner(model, self.kv_cache, self.kv_cache_manager)
        self.sampler: Sampler = parts.sampler or ModelRunner.sample
        self.step_tokens = 0  # the tokens the current step's batches gave the model (0: nothing was scheduled)
        if self.kv_cache.kv_cache_scales == "head":
            self._calibrate_kv_scales()
        self.owner: threading.Thread | None = None  # the one thread allowed to drive the engine (a server's loop)
        self.requests: dict[str, Request | ParentRequest] = {}  # unfinished requests by their id
        self._seqs: dict[str, Request] = {}  # their unfinished sequences (a group's completions: "<i>_<id>")
        self._group_of: dict[str, ParentRequest] = {}  # a completion's sequence id -> its group
        if config.cuda_graphs and device.type == "cuda" and self.kv_cache.use_triton:
            try:
                self.runner.enable_cuda_graphs(config.scheduler_config.max_num_seqs,
                                               config.max_model_len or cfg.max_position_embeddings)
            except Exception as e:  # a capture failure costs speed, never the engine
                warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); decode steps run eagerly")
                self.runner.graphs = None
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            self.speculator = self._speculator(config.speculative_config, draft_model, num_blocks,
                                               cache_config.block_size, parts.proposer, parts.verifier)

    def _speculator(self, cfg: SpeculativeConfig, draft_model, num_blocks: int, block_size: int, proposer,
                    verifier) -> Speculator:
        """The fixed-k ``Speculator`` (the reference), or adaptive k's when ``cfg.adaptive`` asks for that policy."""
        drafter = build_proposer(cfg, draft_model, self.runner, num_blocks, block_size, proposer)
        vocab_size = self.runner.model.config.vocab_size
        if cfg.adaptive:
            return build_adaptive_speculator(cfg, drafter, self.runner, self.kv_cache_manager, vocab_size, verifier,
                                             self.sampler)
        return Speculator(cfg, drafter, self.kv_cache_manager, vocab_size, verifier, self.sampler)

    @classmethod
    def from_llm(cls, llm, cache_config: CacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None) -> "LLMEngine":
        """A fresh engine, with its own KV cache and queue, over ``llm``'s loaded model and tokenizer: what the
        benchmarks use to compare engine settings on one set of weights."""
        return cls(llm.model, llm.tokenizer, llm.make_sequence,
                   EngineConfig(cache_config or CacheConfig(), scheduler_config or SchedulerConfig()))

    def _calibrate_kv_scales(self) -> None:
        """Static KV scales: one prefill of ``CALIBRATION_TEXT`` on a scratch sequence, before any request."""
        if self.tokenizer is None:
            raise ValueError("kv_cache_scales='head' calibrates the static scales on a text, and this model has no "
                             "tokenizer to encode it: use kv_cache_scales='token'")
        blocks = self.kv_cache_manager
        ids = list(self.tokenizer(CALIBRATION_TEXT)["input_ids"])[: blocks.block_size * blocks.num_free_blocks]
        with scratch_sequence(blocks, "__kv_calibrate__", ids):
            self.kv_cache.calibrate_scales(lambda: self.runner.forward(["__kv_calibrate__"], [0], [ids], [1]))

    # --- requests ---------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params, arrival_time: float | None = None,
                    prompt_index: int = 0) -> Request | ParentRequest:
        """Validate and queue a request; a bad one raises ``ValueError`` (naming the problem) and leaves the others
        alone. ``arrival_time`` (``time.perf_counter()`` seconds; default now): when it reached a front end that
        queued it, so that TTFT counts that wait. ``prompt_index``: its place in the caller's request, for errors."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = self._make_sequence(prompt_index, prompt, params, request_id=request_id)
        if arrival_time is not None:
            seq.metrics.arrival_time = arrival_time
        return self.add_sequence(seq)

    def _check_thread(self) -> None:
        """The engine is not thread-safe: while a server's loop owns it (``owner``), other threads may not drive it."""
        if self.owner is not None and threading.current_thread() is not self.owner:
            raise RuntimeError(f"this engine is driven by the thread {self.owner.name!r} "
                               "(a server, minifer.entrypoints.openai.serve): "
                               "send it requests over HTTP, or shut the server down first")

    def add_sequence(self, request: Request | ParentRequest) -> Request | ParentRequest:
        """Queue an already validated request (``LLM.generate`` validates a whole batch first). A sequence
        that asks for ``n > 1`` completions is fanned out into a ``ParentRequest`` (returned)."""
        self._check_thread()
        if isinstance(request, Request) and request.params.n > 1:
            request = ParentRequest.fan_out(request)
        seqs = sequences_of(request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        for s in seqs:
            if s.request_id in self._seqs:
                raise ValueError(f"request id {request.request_id!r}: its completion {s.index} would be sequence "
                                 f"{s.request_id!r}, which is already in use")
        self.scheduler.check_fits(seqs[0])  # the completions are alike: one check holds for all
        first, siblings = seqs[0], seqs[1:]
        self.scheduler.add(first)
        if siblings and self._prompt_shareable(first):
            request.pending = siblings  # type: ignore[union-attr]  # until `first` has computed the prompt
        else:
            for s in siblings:
                self.scheduler.add(s)
        self.requests[request.request_id] = request
        for s in seqs:
            self._seqs[s.request_id] = s
            if isinstance(request, ParentRequest):
                self._group_of[s.request_id] = request
        return request

    def _prompt_shareable(self, seq: Request) -> bool:
        """Whether siblings can take any of the prompt's blocks from the prefix cache once ``seq`` computed them:
        prefix caching is on and the prompt fills a block before its last token (which is always computed)."""
        bm = self.kv_cache_manager
        return bm.enable_prefix_caching and (len(seq.prompt_token_ids) - 1) // bm.block_size >= 1

    def abort_request(self, request_id: str) -> None:
        """Stop a request (all its completions) and free its KV blocks. A completion that finished in a step that
        then failed before retiring it is cleaned up too."""
        self._check_thread()
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        for seq in sequences_of(request):
            if seq.request_id not in self._seqs:  # finished and retired already
                continue
            self.scheduler.abort(seq)
            if self.speculator is not None:
                self.speculator.release(seq.request_id)
            if not seq.is_finished:
                seq.abort()
            self._retire(seq)
        if isinstance(request, ParentRequest):
            request.pending = []
        self.requests.pop(request_id, None)

    def _retire(self, seq: Request) -> None:
        """Forget a finished or aborted sequence; its request too once every completion is done."""
        del self._seqs[seq.request_id]
        group = self._group_of.pop(seq.request_id, None)
        if group is None:
            del self.requests[seq.request_id]
        elif not any(s.request_id in self._seqs for s in group.seqs):  # its last completion
            del self.requests[group.request_id]

    def stream(self, request_id: str, prompt, params) -> Iterator[str]:
        """Add a request and yield its text as it grows (deltas), stepping the engine — and with it every
        other queued request — until this one finishes. One completion (``n=1``): read ``step()``'s outputs
        for several."""
        if getattr(params, "n", 1) != 1:
            raise ValueError(f"stream() follows one completion but request {request_id!r} asks for n={params.n}: "
                             "call add_request() and read each completion's delta_text from step()")
        self.add_request(request_id, prompt, params)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    if out.outputs[0].delta_text:
                        yield out.outputs[0].delta_text
                    if out.finished:
                        return

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- the step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward pass over the scheduled batch. Returns outputs of the requests that got a token.

        The step itself is ``engine_step`` (``engine/core.py``, chapter 03), or, when speculating, ``Speculator.step``
        (``engine_step`` with drafts, ``engine/spec_step.py``); around it the engine reports the outputs and merges a
        request's ``n`` completions."""
        self._check_thread()
        self.step_tokens = 0
        spec = self.speculator
        parts = StepParts(self.scheduler, self._execute, self.sampler, self.kv_cache_manager, self.tokenizer)
        sampled = spec.step(parts, self._num_waiting) if spec is not None else engine_step(parts)
        if not self.step_tokens and self.scheduler.has_unfinished():
            raise RuntimeError("scheduler made no progress: no request fits in the free KV blocks")
        outputs = self._group_outputs(sampled, [seq.to_output(self.tokenizer) for seq in sampled])
        for seq in sampled:
            if seq.is_finished:
                self._retire(seq)
        return outputs

    def _execute(self, batch: ScheduledBatch, drafts: list[list[int]] | None = None) -> tuple[list[int], torch.Tensor]:
        """The step's ``execute``: the runner's, noting when each sequence was first scheduled (TTFT's queueing)."""
        self.step_tokens += sum(batch.num_new_tokens)
        now = time.perf_counter()
        for seq in batch.seqs:
            seq.metrics.first_scheduled_time = seq.metrics.first_scheduled_time or now
        return self.runner.execute_model(batch, drafts)

    def _num_waiting(self) -> int:
        """Sequences waiting for a slot: the scheduler's queue plus siblings held until their prompt is computed."""
        if not self._group_of:  # no request with n > 1: nothing is held back
            return len(self.scheduler.waiting)
        held = sum(len(r.pending) for r in self.requests.values() if isinstance(r, ParentRequest))
        return len(self.scheduler.waiting) + held

    def _group_outputs(self, sampled: list[Request], outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One output per request: the completions of a group that advanced this step are merged into one
        ``RequestOutput`` under the request's id. A group whose first completion has now computed its prompt
        (it sampled a token) hands its pending siblings to the scheduler, at the front of the queue: they arrived
        with it."""
        if not self._group_of:  # no request with n > 1: one output per sequence already
            return outputs
        # request id -> (its group, or None for a single sequence; the outputs to report), in first-seen order
        by_request: dict[str, tuple[ParentRequest | None, list[RequestOutput]]] = {}
        for seq, out in zip(sampled, outputs):
            group = self._group_of.get(seq.request_id)
            if group is not None and group.pending:
                self.scheduler.add_front(group.pending)
                group.pending = []
            key = seq.request_id if group is None else group.request_id
            by_request.setdefault(key, (group, []))[1].append(out)
        return [outs[0] if group is None else group.merge(outs) for group, outs in by_request.values()]

    def stats(self) -> dict[str, float | int]:
        bm = self.kv_cache_manager
        # Tokens held per physical block: a prefix block shared by several sequences counts once.
        held: dict[int, int] = {}
        for s in self.scheduler.running:
            for i, bid in enumerate(bm.block_table(s.request_id)):
                n = min(bm.block_size, s.num_computed_tokens - i * bm.block_size)
                if n > 0:
                    held[bid] = max(held.get(bid, 0), n)
        in_use = len({bid for s in self.scheduler.running for bid in bm.block_table(s.request_id)})
        stored = sum(held.values())
        return {
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            "kv_blocks_cached": bm.num_cached_blocks,
            "kv_utilization": stored / (in_use * bm.block_size) if in_use else 0.0,  # of the running requests' blocks
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_rate": bm.prefix_cache_stats.hits / max(bm.prefix_cache_stats.queries, 1),
            "num_running": len(self.scheduler.running),
            "num_waiting": self._num_waiting(),
            "kv_cache_dtype": self.kv_cache.kv_cache_dtype,
            "kv_cache_scales": self.kv_cache.kv_cache_scales,
            **(self.speculator.summary() if self.speculator is not None else {}),
        }


__all__ = ["LLMEngine", "EngineConfig", "CacheConfig", "SchedulerConfig", "RequestStatus", "kv_block_bytes",
           "usable_blocks"]
