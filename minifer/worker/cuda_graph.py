"""CUDA graphs for decode steps: record the whole decoder forward once per batch size, replay it.

A small model's decode step on a fast GPU is *launch-bound*: dozens of kernels per layer, each a few
microseconds of work and several microseconds of Python to launch. A CUDA graph records the launches once;
replaying it is one call. As in vLLM, graphs are captured for a ladder of batch sizes and a step is padded up to
the next one.

A forward is capturable with fixed tensor addresses and shapes (inputs, attention metadata included, are copied
into static buffers before each replay) and no host synchronisation inside (the Triton kernels of
``minifer/kernels/triton_attention.py`` read context lengths on the GPU). Padded rows write to a scratch block and
attend to one token of it; their outputs are discarded. Only pure decode steps replay graphs; prompt chunks and
speculative verification run eagerly. ``LLM(..., enforce_eager=True)`` (vLLM's name) turns graphs off.
"""

from __future__ import annotations

import torch

from minifer.attention.backends.paged import PagedAttentionMetadata, PagedKVCache, slot_mapping
from minifer.models.llama import LlamaForCausalLM


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's ladder: 1, 2, 4, 8, then every multiple of 8 up to ``max_batch``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, max_batch: int, max_blocks_per_seq: int) -> None:
        dev = cache.k.device
        self.model, self.cache = model, cache
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.width = max_blocks_per_seq
        n = self.max_batch
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), cache.scratch_slot, dtype=torch.long, device=dev)
        self.tables = torch.full((n, self.width), cache.scratch_block, dtype=torch.int32, device=dev)
        self.ctx = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, b: int) -> PagedAttentionMetadata:
        return PagedAttentionMetadata.decode_only(self.slots[:b], self.tables[:b], self.ctx[:b],
                                                  self.cache.null_slot)

    @torch.inference_mode()
    def capture(self) -> None:
        if self.ids.device.type != "cuda":
            raise ValueError("CUDA graphs need the model and KV cache on a CUDA device")
        self._capture_cuda()

    def _capture_cuda(self) -> None:
        """Warm up (Triton compiles, cuBLAS picks its kernels) then record one graph per size, largest first,
        all in one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                self.cache.meta = self._meta(b)
                try:
                    for _ in range(2):
                        self.model(self.ids[:b], self.positions[:b], self.cache)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.outputs[b] = self.model(self.ids[:b], self.positions[:b], self.cache)
                    self.graphs[b] = graph
                finally:
                    self.cache.meta = None
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def can_run(self, batch: int) -> bool:
        return 0 < batch <= self.max_batch and bool(self.graphs)

    def run(self, ids: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One decode step: sequence ``i`` brings token ``ids[i]`` at ``positions[i]``, its blocks ``tables[i]``.
        Replays the smallest captured size >= len(ids); returns the hidden states ``[len(ids), hidden]``."""
        b = len(ids)
        size = next(s for s in self.sizes if s >= b)
        dev = self.ids.device
        pos = torch.tensor(positions)
        table = torch.full((b, self.width), self.cache.scratch_block, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        self.ids[:b].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:b].copy_(pos, non_blocking=True)
        self.slots[:b].copy_(slot_mapping(table, pos[:, None], self.cache.block_size)[:, 0], non_blocking=True)
        self.slots[b:size].fill_(self.cache.scratch_slot)
        self.tables[:b].copy_(table.to(dev, non_blocking=True))
        self.tables[b:size].fill_(self.cache.scratch_block)
        self.ctx[:b].copy_((pos + 1).to(torch.int32), non_blocking=True)
        self.ctx[b:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:b]

