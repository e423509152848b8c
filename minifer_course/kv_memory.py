"""KV-cache memory, measured (chapter 02): why a KV cache, how much a contiguous reservation wastes on
realistic lengths, what paging recovers, and what prefix caching saves.

- **Why a KV cache.** ``time_cache_vs_recompute`` times one decode step with the cache against recomputing
  the whole prefix for the same token; ``generation_flops`` counts both ways of generating N tokens, and
  ``greedy_by_recompute`` shows that recomputing gives the same tokens, only slower.
- **Reservation schemes.** Every step of a run, the sequences that are running hold some tokens in the KV
  cache (``stored``). What each scheme *reserves* for them differs:

  * contiguous, max length: ``max_model_len`` slots per sequence, the only safe choice when the output
    length is unknown (the vLLM paper's "Orca (max)");
  * contiguous, exact: ``prompt + max_tokens`` slots per sequence, as if the output length were known in
    advance ("Orca (oracle)"); minifer's static batches reserve even more, the batch's longest prompt plus
    its largest ``max_tokens`` for every row (``static_batch_usage``);
  * paged: whole blocks of ``block_size`` slots, taken only when the last one is full.

  The utilisation of a scheme over a run is ``sum(stored) / sum(reserved)`` over all steps: the share of
  the reserved slot-steps that held a token.
- **Simulation and engine.** ``record_engine`` runs a workload through an engine and records its KV state after
  every step. ``simulate_kv`` does the same on minifer's own ``LLMEngine`` built over a ``NullModel`` that
  computes nothing (``ignore_eos`` lengths are fixed, so the tokens do not matter): the engine's scheduler, block
  manager and step, not a copy of them, so a 512-request workload takes seconds and agrees with the real model's
  engine step for step.
- **Prefix caching.** ``measure_prefix_caching`` sends requests that share a system prompt one after another
  through fresh engines with prefix caching on and off (interleaved rounds) and compares their TTFT.
- **Parallel sampling.** ``measure_parallel_sampling`` asks for ``n`` completions of each prompt, with the
  completions sharing the prompt's blocks (prefix caching on) and without; it counts the KV blocks held, the
  prompt tokens computed, and checks that both give the same tokens (seeded).
- **Beam search.** ``measure_beam_search`` counts the same for beams that fork by sharing blocks and copy only
  the last, partly filled one they write (``beam_search.py``), and the KV tokens those copies carry
  against what a contiguous cache copies.

``python -m minifer_course.kv_memory --out benchmarks/results/kv_memory.json`` runs the chapter's
measurements and writes them as JSON with hardware and version metadata.
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from minifer.bench.machine import enable_triton_interpreter  # noqa: F401 (chapters 02 and 05 call it from here)
from minifer.bench.provenance import save_result
from minifer.bench.workloads import BenchRequest, Workload, make_workload
from minifer.worker.model_runner import ModelRunner

# --- reservation arithmetic (pure) ------------------------------------------------------------------


def blocks_for(length: int, block_size: int) -> int:
    """Blocks a sequence of ``length`` tokens holds: ``ceil(length / block_size)``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-length // block_size)


def paged_slots(lengths: Iterable[int], block_size: int) -> int:
    """Token slots that paged sequences of these lengths hold: whole blocks each."""
    return sum(blocks_for(n, block_size) * block_size for n in lengths)


def internal_waste(lengths: Iterable[int], block_size: int) -> float:
    """Share of the paged slots left empty in the sequences' last blocks (internal fragmentation)."""
    lengths = list(lengths)
    slots = paged_slots(lengths, block_size)
    return 1 - sum(lengths) / slots if slots else 0.0


def block_size_tradeoff(lengths: Sequence[int], block_sizes: Iterable[int], *, kv_bytes_per_token: float,
                        table_entry_bytes: int = 4) -> list[dict[str, float]]:
    """What a block size costs for sequences of these ``lengths`` (e.g. every running sequence at every
    step of a run): the share of reserved slots left empty (``waste``), block-table entries per sequence,
    new-block allocations per 1,000 tokens appended, and the table's bytes relative to the KV bytes."""
    lengths = list(lengths)
    if not lengths:
        raise ValueError("no lengths")
    total_tokens = sum(lengths)
    rows = []
    for b in block_sizes:
        entries = sum(blocks_for(n, b) for n in lengths)
        rows.append({"block_size": b, "waste": internal_waste(lengths, b),
                     "utilization": 1 - internal_waste(lengths, b),
                     "entries_per_seq": entries / len(lengths),
                     "allocations_per_1k_tokens": 1000 / b,
                     "table_bytes_per_kv_byte": entries * table_entry_bytes / (total_tokens * kv_bytes_per_token)})
    return rows


def static_batch_usage(input_lens: Sequence[int], output_lens: Sequence[int], batch_size: int,
                       max_model_len: int | None = None) -> dict[str, float]:
    """KV use of minifer's static batching (``engine/static.py``) on these lengths.

    Requests run in consecutive batches of ``batch_size``; each batch reserves, for every row, the batch's
    longest prompt plus its largest output (``ContiguousKVCache(batch, p_max + max_new)``) and runs until its
    longest request ends. At forward pass ``s`` (0 = the prefill) a live row holds ``prompt + s`` tokens; a
    finished row holds none that anyone needs. Returns the utilisation ``sum(stored) / sum(reserved)``,
    the forward passes, and the same utilisation against a ``max_model_len`` reservation if given."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(input_lens) != len(output_lens):
        raise ValueError("input_lens and output_lens differ in length")
    stored = reserved = row_steps = steps = 0
    for i in range(0, len(input_lens), batch_size):
        ins, outs = input_lens[i:i + batch_size], output_lens[i:i + batch_size]
        width = max(ins) + max(outs)
        for s in range(max(outs)):
            stored += sum(p + s for p, o in zip(ins, outs) if s < o)
            reserved += len(ins) * width
            row_steps += len(ins)
        steps += max(outs)
    out = {"utilization": stored / reserved if reserved else 0.0, "steps": steps}
    if max_model_len:
        out["utilization_max_len"] = stored / (row_steps * max_model_len) if row_steps else 0.0
    return out


# --- one step's KV state, from the engine or the simulation -----------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """The KV cache after one engine step."""

    running: int  # sequences holding blocks
    waiting: int  # queued (or preempted) requests
    stored: int  # tokens whose KV is in the cache, summed over running sequences
    blocks_used: int  # blocks not free (shared blocks once)
    reserved_exact: int  # sum of prompt + max_tokens over running sequences
    kv_utilization: float  # LLMEngine.stats()["kv_utilization"]
    preemptions: int  # cumulative
    lengths: tuple[int, ...] = ()  # tokens stored by each running sequence


def _record(engine, preemptions_before: int = 0) -> StepRecord:
    """The KV state after one step, read off ``engine``: its running sequences, its block manager's counts, and the
    utilisation the engine itself reports (``LLMEngine.stats``; not computed a second time here)."""
    sched, bm = engine.scheduler, engine.kv_cache_manager
    lengths = tuple(s.num_computed_tokens for s in sched.running)
    return StepRecord(len(sched.running), len(sched.waiting), sum(lengths), bm.num_blocks - bm.num_free_blocks,
                      sum(len(s.prompt_token_ids) + s.max_tokens for s in sched.running),
                      engine.stats()["kv_utilization"], sched.num_preemptions - preemptions_before, lengths)


@dataclass
class KVUsage:
    """Utilisation of each reservation scheme over one run (see the module docstring)."""

    steps: int
    block_size: int
    max_model_len: int
    paged: float  # sum(stored) / sum(blocks_used * block_size)
    paged_step_mean: float  # mean over steps of engine.stats()["kv_utilization"] (steps with sequences)
    contiguous_max: float  # sum(stored) / sum(running * max_model_len)
    contiguous_exact: float  # sum(stored) / sum(prompt + max_tokens of the running)
    mean_running: float
    peak_running: int
    preemptions: int
    mean_running_saturated: float | None = None  # while requests were waiting

    @property
    def fit_ratio(self) -> float:
        """How many more sequences the same memory holds paged than with max-length reservations."""
        return self.paged / self.contiguous_max

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fit_ratio": self.fit_ratio}


def summarize(records: Sequence[StepRecord], block_size: int, max_model_len: int) -> KVUsage:
    busy = [r for r in records if r.running]
    if not busy:
        raise ValueError("no step had a running sequence")
    stored = sum(r.stored for r in busy)
    saturated = [r.running for r in busy if r.waiting]
    return KVUsage(
        steps=len(records), block_size=block_size, max_model_len=max_model_len,
        paged=stored / sum(r.blocks_used * block_size for r in busy),
        paged_step_mean=statistics.fmean(r.kv_utilization for r in busy),
        contiguous_max=stored / (sum(r.running for r in busy) * max_model_len),
        contiguous_exact=stored / sum(r.reserved_exact for r in busy),
        mean_running=statistics.fmean(r.running for r in busy), peak_running=max(r.running for r in busy),
        preemptions=records[-1].preemptions if records else 0,
        mean_running_saturated=statistics.fmean(saturated) if saturated else None)


# --- the simulation: the real engine over a model that computes nothing ---------------------------------


class NullModel(torch.nn.Module):
    """A stand-in for the model that reads no weights and attends to nothing: every forward gives the same logits
    (token 1 wins). An ``LLMEngine`` built on it runs its real scheduler, block manager, prefix cache and step loop,
    so a simulation of the KV bookkeeping cannot drift from the engine's: it *is* the engine, minus the arithmetic.
    Its config asks for the smallest KV cache there is (one layer, one head of one value)."""

    def __init__(self, vocab_size: int = 2, max_model_len: int = 1 << 20) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=1, vocab_size=vocab_size,
                                      max_position_embeddings=max_model_len)
        self.lm_head = torch.nn.Linear(1, vocab_size, bias=False)  # its weight tells the engine dtype and device
        self.logits = torch.nn.functional.one_hot(torch.tensor(1), vocab_size).float()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        return torch.zeros(len(input_ids), 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(len(hidden), -1)


class NullRunner(ModelRunner):
    """The engine's ``ModelRunner`` minus the forward: the same rows of logits come back (a ``NullModel``'s), without
    packing tensors or building attention metadata that nothing reads (most of a null step's time otherwise)."""

    def forward(self, request_ids, starts, tokens, num_logits) -> torch.Tensor:
        return self.model.logits.expand(sum(num_logits), -1)


def null_engine(*, max_model_len: int, block_size: int = 16, num_kv_blocks: int = 4096, max_num_seqs: int = 16,
                max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                enable_prefix_caching: bool = True):
    """An ``LLMEngine`` with these cache and scheduler settings over a ``NullModel`` (run by a ``NullRunner``). Prompts are token ids; a
    request's output is clipped to what ``max_model_len`` leaves after its prompt, as ``LLM`` clips it."""
    from minifer.core.sched.scheduler import SchedulerConfig
    from minifer.engine.llm_engine import CacheConfig, EngineConfig, LLMEngine
    from minifer.request import Request

    def make_sequence(i, prompt, params, request_id=None):
        ids = list(prompt["prompt_token_ids"])
        room = max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"{request_id}: prompt of {len(ids)} tokens leaves no room in {max_model_len}")
        return Request(request_id, None, ids, params, min(params.max_tokens, room), frozenset())

    config = EngineConfig(CacheConfig(block_size, num_kv_blocks, enable_prefix_caching=enable_prefix_caching),
                          SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill),
                          max_model_len=max_model_len)
    engine = LLMEngine(NullModel(max_model_len=max_model_len), None, make_sequence, config)
    engine.runner = NullRunner(engine.runner.model, engine.kv_cache, engine.kv_cache_manager)
    return engine


def engine_settings(engine) -> dict[str, Any]:
    """The cache and scheduler settings of an ``LLMEngine``, as ``simulate_kv`` keyword arguments."""
    bm, cfg = engine.kv_cache_manager, engine.scheduler.config
    return {"block_size": bm.block_size, "num_kv_blocks": bm.num_blocks, "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "enable_chunked_prefill": cfg.enable_chunked_prefill, "enable_prefix_caching": bm.enable_prefix_caching}


def greedy_ignore_eos(max_tokens: int):
    from minifer.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def simulate_kv(workload: Workload, *, max_model_len: int, **settings) -> list[StepRecord]:
    """Serve ``workload`` (every request at t = 0) with minifer's engine over a ``NullModel`` (``null_engine``;
    ``settings``: its keyword arguments, e.g. ``engine_settings(engine)``) and record each step (``record_engine``).
    Requests generate exactly ``max_tokens`` tokens, as with ``ignore_eos``: a 512-request workload takes seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a null step's tensors hold a few numbers: more threads only add synchronisation
    try:
        return record_engine(null_engine(max_model_len=max_model_len, **settings), workload)
    finally:
        torch.set_num_threads(threads)


def record_engine(engine, workload: Workload) -> list[StepRecord]:
    """Add every request of ``workload`` to ``engine`` (an ``LLMEngine``, e.g. ``llm.engine``), step it until
    all are done, and record the KV state after each step. Requests are greedy with ``ignore_eos``, so each
    generates exactly its ``max_tokens``."""
    if engine.has_unfinished_requests():
        raise ValueError("the engine already has unfinished requests")
    before = engine.scheduler.num_preemptions
    for r in workload.requests:
        engine.add_request(r.request_id, {"prompt_token_ids": r.prompt_token_ids}, greedy_ignore_eos(r.max_tokens))
    records = []
    while engine.has_unfinished_requests():
        engine.step()
        records.append(_record(engine, before))
    return records


def scale_outputs(workload: Workload, num_requests: int, divide_by: int) -> Workload:
    """The first ``num_requests`` requests of ``workload`` with their output lengths divided by ``divide_by``
    (at least 1 token): the same prompts, a shorter run."""
    reqs = [BenchRequest(r.request_id, list(r.prompt_token_ids), max(1, r.max_tokens // divide_by), r.arrival)
            for r in workload.requests[:num_requests]]
    return Workload(f"{workload.name}[:{num_requests}], outputs/{divide_by}", reqs,
                    {**workload.params, "num_requests": num_requests, "output_divided_by": divide_by})


def sharegpt_workload(num_requests: int = 512, *, max_model_len: int = 1024, vocab_size: int = 2048,
                      bos_token_id: int | None = 0, seed: int = 0) -> Workload:
    """The ShareGPT-like workload of ``minifer.bench.workloads`` fitted into ``max_model_len``."""
    return make_workload(num_requests, "sharegpt", "sharegpt", seed=seed, vocab_size=vocab_size,
                         max_model_len=max_model_len, bos_token_id=bos_token_id)


# --- why a KV cache -----------------------------------------------------------------------------------


def generation_flops(cfg, prompt_len: int, new_tokens: int, dtype_bytes: float = 4) -> dict[str, float]:
    """FLOPs (and tokens pushed through the model) to generate ``new_tokens`` after a ``prompt_len``-token
    prompt, with a KV cache (one prefill, then one token per step) and without one (every token recomputes
    the whole prefix: a prefill of ``prompt_len + i`` tokens for token ``i + 1``)."""
    from minifer_course.roofline import decode_cost, prefill_cost

    if prompt_len < 1 or new_tokens < 1:
        raise ValueError("prompt_len and new_tokens must be >= 1")
    cached = prefill_cost(cfg, 1, prompt_len, dtype_bytes).flops
    cached += sum(decode_cost(cfg, 1, prompt_len + i, dtype_bytes).flops for i in range(new_tokens - 1))
    recompute = sum(prefill_cost(cfg, 1, prompt_len + i, dtype_bytes).flops for i in range(new_tokens))
    return {"with_cache_flops": cached, "recompute_flops": recompute,
            "with_cache_tokens": prompt_len + new_tokens - 1,
            "recompute_tokens": sum(prompt_len + i for i in range(new_tokens)),
            "ratio": recompute / cached}


def time_cache_vs_recompute(model, positions: Iterable[int] = (16, 64, 128, 256, 512), *, repeats: int = 3,
                            warmup: int = 1) -> list[dict[str, float]]:
    """Time to produce the token at each position ``p`` (batch 1): one decode step over a cache holding
    ``p`` tokens, against a forward over all ``p + 1`` tokens from scratch. Interleaved rounds, medians
    (``roofline._measure``)."""
    from minifer_course.roofline import _decode_runner, _measure, _model_dtype_device, _prefill_runner

    positions = list(positions)
    runners = [_decode_runner(model, 1, p, steps=2) for p in positions]
    runners += [_prefill_runner(model, 1, p + 1) for p in positions]
    t = _measure(runners, _model_dtype_device(model)[1], repeats, warmup)
    n = len(positions)
    return [{"position": p, "with_cache": a.seconds, "recompute": b.seconds, "ratio": b.seconds / a.seconds}
            for p, a, b in zip(positions, t[:n], t[n:])]


def estimate_generation_seconds(points: Sequence[dict[str, float]], prompt_len: int,
                                new_tokens: int) -> dict[str, float]:
    """Seconds to generate ``new_tokens`` after a ``prompt_len`` prompt both ways, interpolating the
    per-token times of ``time_cache_vs_recompute`` linearly in the position (the prefill of the prompt is
    left out of both: it is the same)."""
    xs = [p["position"] for p in points]

    def interp(key: str, x: float) -> float:
        if x <= xs[0]:
            return points[0][key]
        for a, b in zip(points, points[1:]):
            if x <= b["position"]:
                w = (x - a["position"]) / (b["position"] - a["position"])
                return a[key] + w * (b[key] - a[key])
        a, b = points[-2], points[-1]  # extrapolate along the last segment
        return b[key] + (x - b["position"]) * (b[key] - a[key]) / (b["position"] - a["position"])

    pos = range(prompt_len, prompt_len + new_tokens - 1)
    cached = sum(interp("with_cache", x) for x in pos)
    recompute = sum(interp("recompute", x) for x in pos)
    return {"with_cache_s": cached, "recompute_s": recompute, "ratio": recompute / cached}


@torch.inference_mode()
def greedy_by_recompute(model, prompt_ids: Sequence[int], new_tokens: int) -> list[int]:
    """Greedy generation with no KV cache kept between steps: every token runs the whole sequence so far
    through the model again (into a throwaway cache) and takes the argmax at the last position."""
    from minifer.attention.layer import ContiguousKVCache

    cfg, w = model.config, model.lm_head.weight
    ids = list(prompt_ids)
    for _ in range(new_tokens):
        n = len(ids)
        cache = ContiguousKVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, n, cfg.head_dim, w.dtype, w.device)
        cache.begin_step(0, n, torch.ones(1, n, dtype=torch.bool, device=w.device))
        hidden = model(torch.tensor(ids, device=w.device), torch.arange(n, device=w.device), cache)
        ids.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return ids[len(prompt_ids):]


# --- paged attention against dense attention ------------------------------------------------------


def _scattered_case(seed: int, *, context_lens: Sequence[int], query_lens: Sequence[int], block_size: int,
                    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str | torch.device):
    """A pool poisoned with NaN, sequences whose blocks are scattered at random, their K/V written through
    the slot mapping. Returns (q, k_cache, v_cache, tables, dense K/V per sequence)."""
    from minifer.attention.backends.paged import slot_mapping

    gen = torch.Generator().manual_seed(seed)
    need = [blocks_for(c, block_size) for c in context_lens]
    num_blocks = sum(need) + 5  # a few blocks nobody owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, dense, qs = [], [], []
    for c, t, nb in zip(context_lens, query_lens, need):
        table, perm = perm[:nb], perm[nb:]
        k = torch.randn(c, num_kv_heads, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(c, num_kv_heads, head_dim, generator=gen).to(device, dtype)
        slots = torch.tensor(slot_mapping(table, list(range(c)), block_size), device=device)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        tables.append(table)
        dense.append((k, v))
        qs.append(torch.randn(t, num_heads, head_dim, generator=gen).to(device, dtype))
    return torch.cat(qs), k_cache, v_cache, tables, dense


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain attention of one sequence's last ``T`` queries ``[T, Hq, D]`` over its contiguous keys and
    values ``[S, Hkv, D]`` (query ``t`` sits at position ``S - T + t``), GQA by repeating KV heads."""
    t, hq, d = q.shape
    s, hkv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1).float()
    v = v.repeat_interleave(hq // hkv, dim=1).float()
    scores = torch.einsum("thd,shd->hts", q.float(), k) / math.sqrt(d)
    q_pos = s - t + torch.arange(t, device=q.device)
    mask = torch.arange(s, device=q.device)[None, :] <= q_pos[:, None]
    out = torch.einsum("hts,shd->thd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    return out.to(q.dtype)


def paged_vs_dense(seed: int = 0, *, context_lens: Sequence[int] = (37, 1, 70, 16),
                   query_lens: Sequence[int] = (37, 1, 9, 1),
                   block_size: int = 16, num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 32,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> dict[str, Any]:
    """``paged_attention_reference`` on one ragged batch (a whole prompt, decodes, a prefill chunk) whose
    blocks are scattered over a NaN-poisoned pool, against dense causal attention on each sequence's
    contiguous keys and values. Returns the largest absolute difference and whether any NaN leaked."""
    from minifer.attention.backends.paged import PagedAttentionMetadata, paged_attention_reference

    q, k_cache, v_cache, tables, dense = _scattered_case(
        seed, context_lens=context_lens, query_lens=query_lens, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device)
    meta = PagedAttentionMetadata.build(tables, list(context_lens), list(query_lens), block_size, torch.device(device))
    out = paged_attention_reference(q, k_cache, v_cache, meta)
    ref = torch.cat([dense_causal_attention(qi, k, v) for qi, (k, v) in
                     zip(q.split(list(query_lens)), dense)])
    return {"max_abs_error": float((out.float() - ref.float()).abs().max()), "nan": bool(out.isnan().any()),
            "slot_mapping": meta.slot_mapping.tolist(), "tables": tables}


@dataclass
class TritonCheck:
    ran: bool
    message: str
    decode_max_error: float | None = None
    store_exact: bool | None = None

    @property
    def ok(self) -> bool:
        return self.ran and self.store_exact is True and (self.decode_max_error or 0.0) < 1e-5


def triton_vs_reference(seed: int = 0, *, context_lens: Sequence[int] = (1, 17, 40, 100), block_size: int = 16,
                        num_heads: int = 8, num_kv_heads: int = 2, head_dim: int = 32) -> TritonCheck:
    """The Triton kernels of ``minifer/kernels/triton_attention.py`` against the PyTorch reference on a decode
    batch with scattered blocks: ``store_kv`` must write exactly the reference's slots, and
    ``paged_decode_attention`` must match ``paged_attention_reference``. Runs on the GPU when there is one,
    else under Triton's interpreter; without Triton it returns ``ran=False`` and the reason."""
    available, message = enable_triton_interpreter()
    if not available:
        return TritonCheck(False, message)
    from minifer.attention.backends.paged import PagedAttentionMetadata, paged_attention_reference
    from minifer.kernels.triton_attention import paged_decode_attention, store_kv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    b = len(context_lens)
    q, k_cache, v_cache, tables, dense = _scattered_case(
        seed, context_lens=context_lens, query_lens=[1] * b, block_size=block_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.float32, device=device)
    meta = PagedAttentionMetadata.build(tables, list(context_lens), [1] * b, block_size, torch.device(device))
    # store: write each sequence's newest K/V again (fresh values) with the kernel and with indexing
    gen = torch.Generator().manual_seed(seed + 1)
    k_new = torch.randn(b, num_kv_heads, head_dim, generator=gen).to(device)
    v_new = torch.randn(b, num_kv_heads, head_dim, generator=gen).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = k_new
    v_ref.view(-1, num_kv_heads, head_dim)[meta.slot_mapping] = v_new
    store_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    same = lambda a, c: bool(torch.equal(a.nan_to_num(123.0), c.nan_to_num(123.0)))  # noqa: E731
    store_exact = same(k_cache, k_ref) and same(v_cache, v_ref)
    ref = paged_attention_reference(q, k_cache, v_cache, meta)
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens)
    return TritonCheck(True, message, float((out - ref).abs().max()), store_exact)


# --- a small pool to draw ---------------------------------------------------------------------------


def block_table_demo(block_size: int = 4, num_blocks: int = 24, prefix_caching: bool = False):
    """A small ``KVCacheManager`` after a scripted run: sequences A, B, C arrive, grow in turns (one token each
    per decode step, as in a batch), D joins them, B finishes, and E arrives and takes the lowest-numbered free
    blocks, B's old ones first (``BlockPool.get_new_block``).
    Returns ``(kv_cache_manager, {name: tokens stored})``."""
    from minifer.core.kv_cache_manager import KVCacheManager

    bm = KVCacheManager(num_blocks, block_size, prefix_caching)
    lens: dict[str, int] = {}
    rng = random.Random(0)

    def arrive(name: str, n: int) -> None:
        bm.allocate(name, [rng.randrange(1, 1000) for _ in range(n)])
        lens[name] = n

    def grow(names: Sequence[str], steps: int) -> None:
        for _ in range(steps):
            for name in names:
                lens[name] += 1
                bm.append_slots(name, lens[name])

    arrive("A", 6)
    arrive("B", 3)
    arrive("C", 9)
    grow("ABC", 5)
    arrive("D", 7)
    grow("ABCD", 4)
    bm.free("B")
    del lens["B"]
    arrive("E", 10)
    grow("ACDE", 3)
    return bm, lens


def prefix_sharing_demo(block_size: int = 4, num_blocks: int = 16, system_len: int = 10):
    """A small ``KVCacheManager`` with prefix caching: request A (a ``system_len``-token system prompt and a
    question) is computed and published; B and C arrive with the same system prompt and other questions and
    share its full blocks. Returns ``(kv_cache_manager, {name: tokens stored}, {name: tokens served from cache})``."""
    from minifer.core.kv_cache_manager import KVCacheManager

    bm = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    rng = random.Random(1)
    system = [rng.randrange(1, 1000) for _ in range(system_len)]
    lens, cached = {}, {}
    for name, q in (("A", 5), ("B", 3), ("C", 7)):
        ids = system + [rng.randrange(1, 1000) for _ in range(q)]
        cached[name] = bm.allocate(name, ids)
        bm.register_computed(name, ids)  # the engine does this once the step has written the KV
        lens[name] = len(ids)
    return bm, lens, cached


# --- prefix caching -------------------------------------------------------------------------------------


def prefix_prompts(num_requests: int, system_len: int, question_lens: tuple[int, int], *, vocab_size: int,
                   bos_token_id: int | None, seed: int = 0) -> list[list[int]]:
    """``num_requests`` prompts that share their first ``system_len`` tokens (a system prompt, BOS
    included) and end with a random question of ``question_lens[0]..question_lens[1]`` tokens."""
    rng = random.Random(f"prefix-{seed}")
    low = 1 if vocab_size > 1 else 0
    head = [bos_token_id] if bos_token_id is not None else []
    system = head + [rng.randrange(low, vocab_size) for _ in range(system_len - len(head))]
    return [system + [rng.randrange(low, vocab_size) for _ in range(rng.randint(*question_lens))]
            for _ in range(num_requests)]


def _serve_one_by_one(llm, prompts: Sequence[list[int]], *, prefix_caching: bool, block_size: int,
                      num_kv_blocks: int, max_tokens: int) -> dict[str, Any]:
    """A fresh engine over ``llm``'s model; each prompt arrives when the previous one has finished."""
    engine = _fresh_engine(llm, sharing=prefix_caching, block_size=block_size, num_blocks=num_kv_blocks,
                           max_num_seqs=16)
    ttfts, computed = [], 0
    for i, ids in enumerate(prompts):
        seq = engine.add_request(f"r{i}", {"prompt_token_ids": ids}, greedy_ignore_eos(max_tokens))
        while engine.has_unfinished_requests():
            engine.step()
        m = seq.metrics
        ttfts.append(m.first_token_time - m.arrival_time)
    bm = engine.kv_cache_manager
    prompt_tokens = sum(len(p) for p in prompts)
    computed = prompt_tokens - bm.prefix_cache_stats.hits * bm.block_size
    return {"ttft": ttfts, "mean_ttft": statistics.fmean(ttfts), "hit_rate": engine.stats()["prefix_cache_hit_rate"],
            "prompt_tokens": prompt_tokens, "prompt_tokens_computed": computed}


def measure_prefix_caching(llm, *, system_len: int = 256, question_lens: tuple[int, int] = (8, 32),
                           num_requests: int = 16, rounds: int = 3, block_size: int = 16, max_tokens: int = 1,
                           seed: int = 0) -> dict[str, Any]:
    """Mean TTFT of ``num_requests`` requests sharing a ``system_len``-token system prompt, arriving one after
    another, with prefix caching on and off. Each run uses a fresh engine (empty cache: the first request
    of a run always misses); the two settings alternate (on/off, off/on, ...) over ``rounds`` rounds, and
    the ratio off/on is taken per round (runs close in time on a shared machine), then the median."""
    bos = llm.tokenizer.bos_token_id if llm.tokenizer is not None else None
    prompts = prefix_prompts(num_requests, system_len, question_lens, vocab_size=llm.model_config.vocab_size,
                             bos_token_id=bos, seed=seed)
    longest = max(len(p) for p in prompts) + max_tokens
    num_kv_blocks = 4 * blocks_for(longest, block_size) + 8
    kw = dict(block_size=block_size, num_kv_blocks=num_kv_blocks, max_tokens=max_tokens)
    for flag in (True, False):  # warm-up: allocator, thread pools, first-call paths
        _serve_one_by_one(llm, prompts[:2], prefix_caching=flag, **kw)
    runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
    for r in range(rounds):
        for flag in ((True, False) if r % 2 == 0 else (False, True)):
            runs[flag].append(_serve_one_by_one(llm, prompts, prefix_caching=flag, **kw))
    ratios = [off["mean_ttft"] / on["mean_ttft"] for on, off in zip(runs[True], runs[False])]
    on0, off0 = runs[True][0], runs[False][0]
    return {
        "system_len": system_len, "question_lens": list(question_lens), "num_requests": num_requests,
        "rounds": rounds, "block_size": block_size, "max_tokens": max_tokens,
        "mean_ttft_on_s": statistics.median(r["mean_ttft"] for r in runs[True]),
        "mean_ttft_off_s": statistics.median(r["mean_ttft"] for r in runs[False]),
        "ttft_ratio_off_over_on": statistics.median(ratios), "ttft_ratio_rounds": ratios,
        "hit_rate": on0["hit_rate"], "hit_rate_off": off0["hit_rate"],
        "prompt_tokens": on0["prompt_tokens"], "prompt_tokens_computed_on": on0["prompt_tokens_computed"],
        "prompt_tokens_computed_off": off0["prompt_tokens_computed"],
        "first_request_ttft_on_s": statistics.median(r["ttft"][0] for r in runs[True]),
        "later_requests_ttft_on_s": statistics.median(statistics.fmean(r["ttft"][1:]) for r in runs[True]),
        "runs": {"on": runs[True], "off": runs[False]},
    }


# --- parallel sampling ------------------------------------------------------------------------------


def random_prompts(num: int, length: int, *, vocab_size: int, bos_token_id: int | None,
                   seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` random tokens (BOS first), sharing nothing with each other."""
    rng = random.Random(f"prompts-{seed}-{length}")
    low = 1 if vocab_size > 1 else 0
    head = [bos_token_id] if bos_token_id is not None else []
    return [head + [rng.randrange(low, vocab_size) for _ in range(length - len(head))] for _ in range(num)]


def parallel_sampling_blocks(prompt_len: int, output_len: int, n: int, block_size: int, shared: bool = True) -> int:
    """KV blocks that ``n`` completions of one prompt hold once each has ``prompt_len + output_len`` tokens.

    Unshared (no prefix caching, or a contiguous cache rounded to blocks), each holds all its blocks. Shared,
    the prompt's blocks are held once, except the one holding the prompt's last token: that token is always
    computed (its logits give the first output token), so no completion takes its block from the cache, and
    ``(prompt_len - 1) // block_size`` blocks are shared. (Exercise 02 has you derive this.)"""
    per_completion = blocks_for(prompt_len + output_len, block_size)
    if not shared:
        return n * per_completion
    common = (prompt_len - 1) // block_size
    return common + n * (per_completion - common)


def _fresh_engine(llm, *, sharing: bool, block_size: int, num_blocks: int, max_num_seqs: int,
                  max_num_batched_tokens: int = 4096):
    """A fresh continuous engine over ``llm``'s loaded model, with its own KV pool (prefix caching = ``sharing``)."""
    from minifer.core.sched.scheduler import SchedulerConfig
    from minifer.engine.llm_engine import CacheConfig, LLMEngine

    return LLMEngine.from_llm(llm, CacheConfig(block_size=block_size, num_kv_blocks=num_blocks,
                                               enable_prefix_caching=sharing),
                              SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens))


def parallel_sampling_demo(llm, *, n: int = 3, prompt_len: int = 10, block_size: int = 4, num_blocks: int = 16,
                           steps: int = 3, seed: int = 0):
    """One request for ``n`` completions of a ``prompt_len``-token prompt in a tiny pool, stepped ``steps`` times.
    Returns ``(kv_cache_manager, {sequence: tokens stored}, log)``; ``log`` says, after each step, which sequences
    were running and which waiting."""
    from minifer import SamplingParams

    engine = _fresh_engine(llm, sharing=True, block_size=block_size, num_blocks=num_blocks, max_num_seqs=n)
    bos = llm.tokenizer.bos_token_id if llm.tokenizer is not None else None
    prompt = random_prompts(1, prompt_len, vocab_size=llm.model_config.vocab_size, bos_token_id=bos, seed=seed)[0]
    params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=steps + 4, ignore_eos=True)
    group = engine.add_request("s", {"prompt_token_ids": prompt}, params)
    log = []
    for step in range(1, steps + 1):
        engine.step()
        running = [s.request_id for s in engine.scheduler.running]
        waiting = [s.request_id for s in engine.scheduler.waiting]
        log.append(f"after step {step}: running {running}, waiting {waiting}")
    return engine.kv_cache_manager, {s.request_id: s.num_computed_tokens for s in group.seqs}, log


def _run_parallel(llm, prompts: Sequence[list[int]], n: int, *, sharing: bool, block_size: int, max_tokens: int,
                  seed: int) -> dict[str, Any]:
    """All ``prompts`` at once, ``n`` seeded completions each, through a fresh engine with room for all of them
    (no preemption), prefix caching on (the completions share the prompt) or off (each holds its own copy).
    After every step, count the blocks in the running sequences' tables and the distinct physical blocks."""
    from minifer import SamplingParams
    from minifer.request import sequences_of

    seqs = len(prompts) * n
    room = seqs * blocks_for(max(map(len, prompts)) + max_tokens, block_size)
    engine = _fresh_engine(llm, sharing=sharing, block_size=block_size, num_blocks=room, max_num_seqs=seqs,
                              max_num_batched_tokens=max(4096, n * sum(map(len, prompts))))
    params = SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request(f"p{i}", {"prompt_token_ids": ids}, params) for i, ids in enumerate(prompts)]
    bm = engine.kv_cache_manager
    in_tables = distinct = peak = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        tables = [bm.block_table(s.request_id) for s in engine.scheduler.running]
        in_use = len({b for t in tables for b in t})
        in_tables += sum(map(len, tables))
        distinct += in_use
        peak = max(peak, in_use)
    return {"steps": steps, "block_steps_in_tables": in_tables, "block_steps_distinct": distinct,
            "peak_blocks": peak, "prompt_tokens": n * sum(map(len, prompts)),
            "prompt_tokens_computed": n * sum(map(len, prompts)) - bm.prefix_cache_stats.hits * block_size,
            "tokens": [[s.output_token_ids for s in sequences_of(r)] for r in requests]}


def _shape_prompts(llm, shapes: Sequence[tuple[int, int]], num_prompts: int, seed: int):
    """``(prompt_len, output_len, prompts)`` per shape: ``num_prompts`` random-token prompts of that length."""
    bos = llm.tokenizer.bos_token_id if llm.tokenizer is not None else None
    for prompt_len, max_tokens in shapes:
        yield prompt_len, max_tokens, random_prompts(num_prompts, prompt_len, vocab_size=llm.model_config.vocab_size,
                                                     bos_token_id=bos, seed=seed)


def measure_parallel_sampling(llm, *, shapes: Sequence[tuple[int, int]] = ((256, 32), (32, 128)),
                              n_values: Sequence[int] = (1, 2, 4, 8), num_prompts: int = 2, block_size: int = 16,
                              seed: int = 0) -> list[dict[str, Any]]:
    """KV memory of parallel sampling with and without sharing the prompt, per (prompt length, output length) in
    ``shapes`` and ``n`` in ``n_values``.

    ``memory_saving`` is the vLLM paper's measure (Kwon et al. 2023, §6.3, Fig. 15): blocks saved by sharing over
    the blocks the same sequences would hold without it, summed over the steps of the run. ``end_state_saving``
    is the same ratio for n finished completions, from the block arithmetic alone: each shares the prompt's
    ``(prompt_len - 1) // block_size`` full blocks (its last token is always computed, so a prompt of whole
    blocks keeps its last block private) out of ``ceil((prompt_len + output_len) / block_size)``."""
    rows = []
    for prompt_len, max_tokens, prompts in _shape_prompts(llm, shapes, num_prompts, seed):
        for n in n_values:
            kw = dict(block_size=block_size, max_tokens=max_tokens, seed=seed)
            on = _run_parallel(llm, prompts, n, sharing=True, **kw)
            off = _run_parallel(llm, prompts, n, sharing=False, **kw)
            rows.append({
                "prompt_len": prompt_len, "output_len": max_tokens, "n": n, "num_prompts": num_prompts,
                "memory_saving": 1 - on["block_steps_distinct"] / on["block_steps_in_tables"],
                "end_state_saving": 1 - parallel_sampling_blocks(prompt_len, max_tokens, n, block_size)
                / parallel_sampling_blocks(prompt_len, max_tokens, n, block_size, shared=False),
                "peak_blocks_shared": on["peak_blocks"], "peak_blocks_unshared": off["peak_blocks"],
                "prompt_tokens": on["prompt_tokens"], "prompt_tokens_computed_shared": on["prompt_tokens_computed"],
                "prompt_tokens_computed_unshared": off["prompt_tokens_computed"],
                "steps_shared": on["steps"], "steps_unshared": off["steps"],
                "same_tokens": on["tokens"] == off["tokens"]})
    return rows


# --- the chapter's measurements as one JSON ---------------------------------------------------------


def utilization_table(usage: KVUsage, static: dict[str, float]) -> list[dict[str, Any]]:
    """Rows (scheme, utilisation) for the notebook and the CLI."""
    return [
        {"scheme": f"contiguous, max_model_len ({usage.max_model_len}) per sequence",
         "utilization": usage.contiguous_max},
        {"scheme": "static batches (longest prompt + largest max_tokens per row)",
         "utilization": static["utilization"]},
        {"scheme": "contiguous, prompt + max_tokens per sequence", "utilization": usage.contiguous_exact},
        {"scheme": f"paged, block_size {usage.block_size}", "utilization": usage.paged},
    ]


def beam_search_demo(llm, *, beam_width: int = 3, prompt: str = "Once upon a time", block_size: int = 4,
                     num_blocks: int = 24, steps: int = 3, max_tokens: int = 12):
    """A beam search of one prompt in a tiny pool of ``block_size``-token blocks (a fresh engine over ``llm``'s
    model), watched for its first ``steps`` steps. Returns ``(kv_cache_manager, {beam: tokens stored}, log)`` as they
    were after step ``steps``; ``log`` says, step by step, each beam's latest token, which beams forked from which,
    and which blocks were copied on write."""
    import copy

    from minifer import BeamSearchParams
    from minifer.beam_search import BeamSearch

    engine = _fresh_engine(llm, sharing=True, block_size=block_size, num_blocks=num_blocks, max_num_seqs=beam_width)
    tok = llm.tokenizer
    ids = list(tok(prompt)["input_ids"])
    log: list[str] = []
    snapshot: dict[str, Any] = {}

    def watch(search: BeamSearch) -> None:
        step = search.stats.steps
        if step > steps or not search.active or search.active[0].done:
            return
        parent = dict(search.last_forks)
        beams = [f"{b.seq_id} {tok.decode(b.tokens[-1:])!r}" + (f" (fork of {parent[b.seq_id]})"
                                                                 if b.seq_id in parent else "")
                 for b in search.active[0].beams]
        copies = ", ".join(f"{src} -> {dst}" for src, dst in search.last_copies) or "none"
        log.append(f"after step {step}: {', '.join(beams)}; blocks copied: {copies}")
        if step == steps:
            snapshot["blocks"] = copy.deepcopy(search.blocks)
            snapshot["lengths"] = {b.seq_id: len(b.tokens) - 1 for b in search.active[0].beams}

    if not 1 <= steps < max_tokens:
        raise ValueError(f"steps must be in [1, max_tokens - 1] to see the beams mid-search, got steps={steps}, "
                         f"max_tokens={max_tokens}")
    BeamSearch(engine, BeamSearchParams(beam_width, max_tokens, ignore_eos=True), llm.eos_token_ids, tok,
               llm.max_model_len, beam_width).run([ids], on_step=watch)
    return snapshot["blocks"], snapshot["lengths"], log


def measure_beam_search(llm, *, shapes: Sequence[tuple[int, int]] = ((256, 32), (32, 128)),
                        widths: Sequence[int] = (1, 2, 4, 8), num_prompts: int = 2, block_size: int = 16,
                        seed: int = 0) -> list[dict[str, Any]]:
    """KV memory of beam search on the paged cache, per (prompt length, output length) in ``shapes`` and beam width
    in ``widths``: all ``num_prompts`` prompts searched side by side in a fresh engine with room for them
    (``ignore_eos``, so every search runs its full length). ``memory_saving`` is the vLLM paper's measure, as in
    ``measure_parallel_sampling``: blocks saved by sharing over the blocks the beams' tables list, summed over the
    steps. It also counts the forks, the copy-on-write block copies and the cached tokens they carried, against
    the tokens a contiguous cache would copy (every beam's whole cache, every step)."""
    from minifer import BeamSearchParams
    from minifer.beam_search import BeamSearch, blocks_bound

    rows = []
    for prompt_len, max_tokens, prompts in _shape_prompts(llm, shapes, num_prompts, seed):
        for w in widths:
            room = num_prompts * blocks_bound(prompt_len, max_tokens, w, block_size)
            engine = _fresh_engine(llm, sharing=True, block_size=block_size, num_blocks=room,
                                   max_num_seqs=num_prompts * w)
            search = BeamSearch(engine, BeamSearchParams(w, max_tokens, ignore_eos=True), llm.eos_token_ids,
                                llm.tokenizer, llm.max_model_len, num_prompts * w)
            search.run(prompts)
            st = search.stats
            rows.append({"prompt_len": prompt_len, "output_len": max_tokens, "beam_width": w,
                         "num_prompts": num_prompts, "memory_saving": st.memory_saving,
                         "peak_blocks_shared": st.peak_blocks, "peak_blocks_unshared": st.peak_blocks_unshared,
                         "forks": st.forks, "block_copies": st.block_copies,
                         "kv_tokens_copied": st.kv_tokens_copied, "kv_tokens_reordered": st.kv_tokens_reordered,
                         "steps": st.steps})
    return rows


def run_kv_memory(llm, *, num_requests: int = 512, seed: int = 0, max_model_len: int = 1024,
                  engine_requests: int = 24, engine_output_divisor: int = 8, prefix_rounds: int = 3,
                  timing_repeats: int = 3) -> dict[str, Any]:
    """Everything the chapter measures, for ``llm`` (continuous batching): utilisation by scheme on the
    ShareGPT-like workload (simulated), the same memory's concurrency, a real engine run against its
    simulation, the cost of decoding without a cache, and the TTFT gain of prefix caching."""
    from minifer_course.roofline import kv_bytes_per_token

    if llm.engine is None:
        raise ValueError("run_kv_memory needs LLM(..., batching='continuous')")
    cfg = llm.model_config
    max_model_len = min(max_model_len, llm.max_model_len)
    bos = llm.tokenizer.bos_token_id if llm.tokenizer is not None else None
    w = sharegpt_workload(num_requests, max_model_len=max_model_len, vocab_size=cfg.vocab_size,
                          bos_token_id=bos, seed=seed)
    settings = engine_settings(llm.engine)
    bs = settings["block_size"]
    enough = settings["max_num_seqs"] * blocks_for(max_model_len, bs)  # no request ever waits for memory
    sim = simulate_kv(w, max_model_len=max_model_len, **{**settings, "num_kv_blocks": enough})
    usage = summarize(sim, bs, max_model_len)
    static = static_batch_usage(w.input_lens, w.output_lens, settings["max_num_seqs"], max_model_len)
    # the memory that holds max_num_seqs max-length reservations, paged
    budget_blocks = settings["max_num_seqs"] * max_model_len // bs
    same_memory = simulate_kv(w, max_model_len=max_model_len, **{**settings, "num_kv_blocks": budget_blocks,
                                                                  "max_num_seqs": 1024})
    mem = summarize(same_memory, bs, max_model_len)
    small = scale_outputs(w, engine_requests, engine_output_divisor)
    t0 = time.perf_counter()
    real = record_engine(llm.engine, small)
    engine_seconds = time.perf_counter() - t0
    replica = simulate_kv(small, max_model_len=max_model_len, **settings)
    lengths = [n for r in sim for n in r.lengths]
    cache_timing = time_cache_vs_recompute(llm.model, repeats=timing_repeats)
    dtype_bytes = llm.dtype.itemsize
    return {
        "model": str(llm.model_path), "dtype": str(llm.dtype).replace("torch.", ""), "device": str(llm.device),
        "engine_settings": settings, "workload": w.summary(),
        "utilization": {"simulated": usage.to_dict(), "static_batches": static,
                        "table": utilization_table(usage, static)},
        "same_memory": {"token_slots": budget_blocks * bs, "contiguous_sequences": settings["max_num_seqs"],
                        "paged": mem.to_dict(), "contiguous_steps": usage.steps},
        "engine_run": {"workload": small.summary(), "usage": summarize(real, bs, max_model_len).to_dict(),
                       "seconds": engine_seconds, "simulation_agrees": real == replica, "steps": len(real)},
        "block_size_tradeoff": block_size_tradeoff(lengths, (1, 2, 4, 8, 16, 32, 64, 128, 256),
                                                   kv_bytes_per_token=kv_bytes_per_token(cfg, dtype_bytes)),
        "cache_vs_recompute": {"per_token": cache_timing,
                               "generate_16_to_512": estimate_generation_seconds(cache_timing, 16, 497),
                               "flops_16_to_512": generation_flops(cfg, 16, 497, dtype_bytes)},
        "prefix_caching": measure_prefix_caching(llm, rounds=prefix_rounds),
        "parallel_sampling": measure_parallel_sampling(llm),
        "beam_search": measure_beam_search(llm),
    }


def metadata(argv: Sequence[str]) -> dict[str, Any]:
    from minifer.bench.serving import git_commit
    from minifer_course.roofline import environment

    command = shlex.join(["python", "-m", "minifer_course.kv_memory", *argv])
    return {**environment(), "git": git_commit(), "command": command,
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def main(argv: list[str] | None = None) -> int:
    from minifer import LLM
    from minifer_course.roofline import default_results_path, default_threads

    parser = argparse.ArgumentParser(prog="python -m minifer_course.kv_memory",
                                     description="Chapter 02: KV utilisation by reservation scheme, decode with and "
                                                 "without a KV cache, prefix caching TTFT.")
    parser.add_argument("--model", default="tinystories-target", help="bundled name, local folder or hub id")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", help="'dummy' for random weights of a shipped config")
    parser.add_argument("--num-requests", type=int, default=512, help="ShareGPT-like requests (simulated)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="context the workload is fitted into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(default_results_path("kv_memory.json")))
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads or default_threads())
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format, max_num_seqs=16)
    res = run_kv_memory(llm, num_requests=args.num_requests, seed=args.seed, max_model_len=args.max_model_len,
                        prefix_rounds=args.prefix_rounds)
    res = {"kind": "kv_memory", "metadata": metadata(argv), **res}
    u = res["utilization"]["simulated"]
    print(f"KV utilisation on {args.num_requests} ShareGPT-like requests: paged {u['paged']:.1%}, contiguous "
          f"max-length {u['contiguous_max']:.1%}, exact reservation {u['contiguous_exact']:.1%}, static batches "
          f"{res['utilization']['static_batches']['utilization']:.1%}")
    m = res["same_memory"]
    print(f"same memory ({m['token_slots']:,} slots): contiguous {m['contiguous_sequences']} sequences, paged "
          f"{m['paged']['mean_running']:.1f} on average (peak {m['paged']['peak_running']}), "
          f"{m['paged']['preemptions']} preemptions")
    e = res["engine_run"]
    print(f"engine run: {e['steps']} steps, paged {e['usage']['paged']:.1%}, "
          f"simulation agrees: {e['simulation_agrees']}")
    g = res["cache_vs_recompute"]["generate_16_to_512"]
    print(f"tokens 16..512 without a cache: {g['ratio']:.1f}x the time with one")
    p = res["prefix_caching"]
    print(f"prefix caching: mean TTFT {p['mean_ttft_off_s'] * 1e3:.1f} ms off, {p['mean_ttft_on_s'] * 1e3:.1f} ms on "
          f"({p['ttft_ratio_off_over_on']:.2f}x), hit rate {p['hit_rate']:.1%}")
    for r in res["parallel_sampling"]:
        print(f"parallel sampling, prompt {r['prompt_len']} + output {r['output_len']}, n={r['n']}: "
              f"{r['memory_saving']:.1%} of the KV blocks saved, peak {r['peak_blocks_shared']} vs "
              f"{r['peak_blocks_unshared']} blocks, same tokens: {r['same_tokens']}")
    for r in res["beam_search"]:
        print(f"beam search, prompt {r['prompt_len']} + output {r['output_len']}, width {r['beam_width']}: "
              f"{r['memory_saving']:.1%} of the KV blocks saved, peak {r['peak_blocks_shared']} vs "
              f"{r['peak_blocks_unshared']} blocks, {r['block_copies']} block copies for {r['forks']} forks")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_result(res, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
