"""Turns a scheduled batch into tensors, runs the model over the paged cache, and samples.

This is the only place that touches the KV tensors: the scheduler and block manager decide *which*
tokens and *where* they go; the runner packs them (``input_ids``, ``positions``), builds the step's
``PagedAttentionMetadata`` once for all layers, and asks the model for logits only where a token is
needed: at the last token of each sequence that completes its prompt or decodes this step, and — with
speculative decoding — at every draft position too (chapter 04).
"""

from __future__ import annotations

import torch

from minifer.attention.backends.paged import PagedAttentionMetadata, PagedKVCache
from minifer.core.kv_cache_manager import KVBlockAllocator
from minifer.core.sched.scheduler import ScheduledBatch
from minifer.models.llama import LlamaForCausalLM
from minifer.sample.sampler import SampleResult, ranked_logprobs, sample_sequences
from minifer.worker.cuda_graph import DecodeGraphs

COMPILATION_KEYS = ("pack_weights", "column_major_weights", "level", "mode")
# vLLM's compilation levels (``CompilationConfig.level``, later ``mode``): 0 runs the model eagerly, 3 is vLLM's own
# compilation (the graph split at attention), which ``features.compiled_decoder`` does; 1 and 2 are stages of vLLM's
# Dynamo integration minifer has no separate meaning for
COMPILATION_LEVELS = (0, 3)


def compile_model(model: LlamaForCausalLM, config: dict | None, shared_with=None, enforce_eager: bool = False) -> dict:
    """Apply ``LLM``'s ``compilation_config`` to a freshly loaded model, in place, and return it as applied; every
    option is CPU-only. ``pack_weights``: float linear weights kept packed for oneDNN (``features.packed_linear``).
    ``level`` (or vLLM's newer ``mode``) 3: the decoder compiled by ``torch.compile``, attention left opaque
    (``features.compiled_decoder``; float weights); 0, the default, and ``enforce_eager=True`` keep it eager.
    ``column_major_weights``: float linear weights re-stored column-major, the layout a batch-1 matrix-vector
    product streams fastest (``features.weight_layout``). An LLM sharing another's weights shares its model too, so it must ask for the same."""
    config = dict(config or {})
    unknown = sorted(set(config) - set(COMPILATION_KEYS))
    if unknown:
        raise ValueError(f"compilation_config: unknown key(s) {unknown}; minifer reads {list(COMPILATION_KEYS)}")
    level = _compilation_level(config, enforce_eager)
    if level == 3 and config.get("pack_weights"):
        raise ValueError("compilation_config: pack_weights and level 3 do not combine: the compiled graph multiplies "
                         "the plain weights (inductor cannot lower oneDNN's packed ones); choose one")
    if shared_with is not None:
        if config != shared_with.compilation_config:
            raise ValueError(f"share_weights_with: the other LLM was compiled with {shared_with.compilation_config}, "
                             f"this one asks for {config}; both use one model, so they must match")
        return config
    if config.get("pack_weights"):
        from minifer.compilation.packed_linear import pack_linears

        if not pack_linears(model):
            raise ValueError("compilation_config: pack_weights needs float weights on a CPU whose torch has oneDNN")
    if config.get("column_major_weights"):
        from minifer.compilation.weight_layout import column_major_linears

        if model.lm_head.weight.device.type != "cpu" or not column_major_linears(model):
            raise ValueError("compilation_config: column_major_weights is a CPU layout for float linear weights")
    if level == 3:
        _compile_decoder(model)
    return config


def _compilation_level(config: dict, enforce_eager: bool) -> int:
    """The level asked for (``level`` or ``mode``, not both), checked; ``enforce_eager`` turns it to 0, as in vLLM."""
    if "level" in config and "mode" in config:
        raise ValueError("compilation_config: give 'level' or 'mode' (vLLM's newer name for it), not both")
    level = config.get("level", config.get("mode", 0))
    if level not in COMPILATION_LEVELS:
        raise ValueError(f"compilation_config: level/mode must be one of {list(COMPILATION_LEVELS)} (0: eager, "
                         f"3: compiled with torch.compile), got {level!r}")
    if enforce_eager:  # enforce_eager wins, as in vLLM; the applied config then says what runs
        for key in ("level", "mode"):
            config.pop(key, None)
        return 0
    return level


def _compile_decoder(model: LlamaForCausalLM) -> None:
    from minifer.compilation.compiled_decoder import compile_decoder

    weight = model.lm_head.weight
    if weight.device.type != "cpu" or getattr(model, "quantization_config", None) is not None:
        raise ValueError("compilation_config: level 3 (torch.compile) is minifer's CPU fast path for float weights; "
                         f"this model is on {weight.device.type} with quantization "
                         f"{getattr(model, 'quantization_config', None)} (on CUDA, CUDA graphs remove the overhead)")
    compile_decoder(model)


class ModelRunner:
    # a batch whose every row is plain greedy takes the argmax and its log-probability directly
    # (``sampling.sample_sequences``, which the static engine uses too); False: every batch through ``sample``
    fast_greedy: bool = True

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, blocks: KVBlockAllocator) -> None:
        self.model, self.cache, self.blocks = model, cache, blocks
        self.device = model.lm_head.weight.device
        self.graphs: DecodeGraphs | None = None  # on CUDA (worker/cuda_graph.py): pure decode steps replay them
        # called after each forward with (request_ids, starts, tokens, hidden [N, H]): the last hidden state of every
        # packed token, for a drafter that reads the target's features (EAGLE, ``spec_decode/eagle.py``)
        self.hidden_observers: list = []

    def enable_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        graphs = DecodeGraphs(self.model, self.cache, max_batch, -(-max_model_len // self.cache.block_size))
        graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def forward(self, request_ids: list[object], starts: list[int], tokens: list[list[int]],
                num_logits: list[int]) -> torch.Tensor:
        """One forward over ragged chunks: request ``i`` brings ``tokens[i]`` at positions ``starts[i]...``
        (its KV before ``starts[i]`` is cached and its blocks already cover the new tokens). Returns the
        logits of the last ``num_logits[i]`` tokens of each chunk, concatenated: ``[sum(num_logits), V]``."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        for start, chunk, n_logits in zip(starts, tokens, num_logits):
            ids.extend(chunk)
            positions.extend(range(start, start + len(chunk)))
            rows.extend(range(len(ids) - n_logits, len(ids)))
        dev = self.device
        if self.graphs is not None and len(ids) == len(tokens) and self.graphs.can_run(len(ids)):
            hidden = self.graphs.run(ids, positions, [self.blocks.block_table(r) for r in request_ids])
            self._notify(request_ids, starts, tokens, hidden[: len(ids)])
            return self._logits(hidden, rows)
        tables, ctx = [self.blocks.block_table(r) for r in request_ids], [s + len(c) for s, c in zip(starts, tokens)]
        self.cache.meta = PagedAttentionMetadata.build(tables, ctx, [len(c) for c in tokens], self.cache.block_size,
                                                       dev, null_slot=self.cache.null_slot)
        try:
            hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), self.cache)
        finally:
            self.cache.meta = None
        self._notify(request_ids, starts, tokens, hidden)
        return self._logits(hidden, rows)

    def _notify(self, request_ids: list[object], starts: list[int], tokens: list[list[int]],
                hidden: torch.Tensor) -> None:
        for observe in self.hidden_observers:
            observe(request_ids, starts, tokens, hidden)

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device, dtype=torch.long)])

    def execute_model(self, batch: ScheduledBatch, drafts: list[list[int]] | None = None) -> tuple[list[int], torch.Tensor]:
        """Run one step. Sequence ``i`` of the batch computes its next ``num_new_tokens[i]`` tokens plus, when
        speculating, its ``drafts[i]``. Returns the indices (into ``batch.seqs``) of the sequences that get
        logits — those whose prompt is complete — and the logits: one row per such sequence, or
        ``1 + len(drafts[i])`` rows for a speculating one. A sequence that asked for ``prompt_logprobs`` gets
        logits at its prompt positions too; they are turned into its prompt log-probabilities here, not returned."""
        starts, chunks, num_logits, sampling_rows = [], [], [], []
        prompt_rows: dict[int, int] = {}  # sequence -> first position whose logits give a prompt log-probability
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            draft = drafts[i] if drafts else []
            starts.append(start)
            chunks.append(seq.token_slice(start, start + n) + draft)
            complete = start + n == seq.num_tokens  # prompt complete (or a decode token): sample the next one
            rows = 1 + len(draft) if complete else 0
            if seq.needs_prompt_logprobs:  # position p's logits give prompt token p + 1's log-probability
                prompt_rows[i] = first = max(start, len(seq.prompt_logprobs) - 1)
                rows = max(rows, start + n - first + len(draft))
            num_logits.append(rows)
            if complete:
                sampling_rows.append(i)
        logits = self.forward([s.request_id for s in batch.seqs], starts, chunks, num_logits)
        if not prompt_rows:
            return sampling_rows, logits
        keep, at = [], 0  # record the prompt log-probabilities, return only the rows that sample
        for i, (seq, rows) in enumerate(zip(batch.seqs, num_logits)):
            if i in prompt_rows:
                first, prompt = prompt_rows[i], seq.prompt_token_ids
                upto = min(starts[i] + batch.num_new_tokens[i], len(prompt) - 1)  # positions that predict the prompt
                if upto > first:
                    seq.prompt_logprobs.extend(ranked_logprobs(logits[at : at + upto - first],
                                                               prompt[first + 1 : upto + 1], seq.params.prompt_logprobs))
                if i in sampling_rows:  # the rows that sample (and verify drafts) come last
                    keep.extend(range(at + rows - 1 - len(drafts[i] if drafts else []), at + rows))
            else:
                keep.extend(range(at, at + rows))
            at += rows
        return sampling_rows, logits[keep]

    @staticmethod
    def sample(seqs: list, logits: torch.Tensor) -> SampleResult:
        """Plain sampling, one token per sequence (penalties and ``min_tokens`` over each one's tokens so far)."""
        return sample_sequences(seqs, logits, fast_greedy=ModelRunner.fast_greedy)
