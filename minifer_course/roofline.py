"""The roofline of one forward step: how much arithmetic it does, how many bytes it moves, and which of
the two limits its speed on a given machine (chapter 01).

A step that performs ``F`` floating-point operations and moves ``B`` bytes between memory and the chip
cannot take less than ``max(F / peak_flops, B / bandwidth)``. Its *arithmetic intensity* ``I = F / B``
(FLOP per byte) says which term wins: below the machine's *ridge point* ``peak_flops / bandwidth`` the
step is memory-bound, above it compute-bound (Williams, Waterman and Patterson, "Roofline", CACM 2009).

Prefill runs every prompt token through the model in one step, so each weight read from memory is used
for all of them and ``I`` grows with the number of tokens. Decode runs one new token per sequence, so each
weight is read for one multiply-add per sequence: ``I`` is about ``batch`` FLOP per byte in bf16
(``batch / 2`` in float32), far below any accelerator's ridge at batch 1.

Counting conventions (published numbers differ in them, so they are spelled out):

- FLOPs: 2 per multiply-add of every matmul with a weight, plus attention's ``QK^T`` and ``PV`` over the
  *causal* (query, key) pairs only. Element-wise work (norms, RoPE, SiLU, softmax) is left out; it is
  well under 1% of the matmul FLOPs for these shapes.
- The lm_head projects one row per sequence per step, not every prompt token: minifer's engine calls
  ``compute_logits`` only on the rows it samples from.
- Bytes: every weight is read once per step (the embedding table only for the rows looked up, unless it
  is tied to the lm_head, which reads all of it); the KV cache is read over the whole context and written
  for the new tokens; activations are counted as if every operation read its inputs from memory and wrote
  its output back (no fusion), which is an *upper* estimate: fused kernels and caches keep many of them
  on chip. ``StepCost.intensity_weights_kv`` leaves them out, the other extreme.

Everything that times something returns the median of a few repeats (model steps) or the best of a few
(the machine's ceilings: neighbours on a shared machine only ever slow a run down).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from minifer.attention.layer import ContiguousKVCache
from minifer.bench.machine import (  # noqa: F401
    _device,
    _sync,
    _times,
    default_results_path,
    default_threads,
    device_name,
    environment,
    measure_copy_bandwidth,
)
from minifer.config import ModelConfig
from minifer.models.llama import LlamaForCausalLM

# --- counting ---------------------------------------------------------------------------------------


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights of one decoder layer that take part in a matmul: q/k/v, o, and the three SwiGLU matrices.
    Each contributes one multiply-add (2 FLOPs) per token that passes through the layer."""
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return h * (q + 2 * kv) + q * h + 3 * h * i


def weight_bytes(cfg: ModelConfig, dtype_bytes: float) -> float:
    """Bytes of every weight a step must read: all parameters except an *untied* embedding table, of
    which a step gathers only the rows of its tokens (counted separately in ``step_cost``)."""
    untied_embedding = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (cfg.num_parameters() - untied_embedding) * dtype_bytes


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: float) -> float:
    """KV-cache bytes one token occupies: a key and a value of ``kv_size`` in every layer."""
    return 2 * cfg.num_hidden_layers * cfg.kv_size * dtype_bytes


def activation_elements_per_token_layer(cfg: ModelConfig) -> int:
    """Activation elements one token reads and writes in one layer if no operation is fused.

    Norm (2h), qkv proj (h in, q+2kv out), RoPE on q and k (2q+2kv), attention (q in, q out; keys and
    values are KV-cache traffic), o proj (q in, h out), residual (2h in, h out), norm (2h), gate/up
    (h in, 2i out), SiLU*up (2i in, i out), down (i in, h out), residual (3h): 14h + 6q + 4kv + 6i.
    """
    h, q, kv, i = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return 14 * h + 6 * q + 4 * kv + 6 * i


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes of one forward step over ``batch`` sequences, ``new_tokens`` each."""

    batch: int
    new_tokens: int
    context: int
    flops_matmul: float
    flops_attention: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    activation_bytes: float

    @property
    def tokens(self) -> int:
        return self.batch * self.new_tokens

    @property
    def flops(self) -> float:
        return self.flops_matmul + self.flops_attention

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes

    @property
    def intensity(self) -> float:
        """FLOP per byte with every byte counted (activations unfused): the conservative value."""
        return self.flops / self.bytes

    @property
    def intensity_weights_kv(self) -> float:
        """FLOP per byte counting only weights and KV cache, as if activations never left the chip."""
        return self.flops / (self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes)

    def to_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.update(tokens=self.tokens, flops=self.flops, bytes=self.bytes, intensity=self.intensity,
                 intensity_weights_kv=self.intensity_weights_kv)
        return d


def step_cost(cfg: ModelConfig, *, batch: int, new_tokens: int, context: int, dtype_bytes: float = 2,
              kv_dtype_bytes: float | None = None, logits_rows: int | None = None) -> StepCost:
    """Count one forward step: ``batch`` sequences each bring ``new_tokens`` tokens and already hold
    ``context`` tokens in the KV cache. Prefill is ``context=0, new_tokens=prompt_len``; decode is
    ``new_tokens=1``. ``logits_rows`` defaults to one per sequence."""
    if batch < 1 or new_tokens < 1 or context < 0:
        raise ValueError(f"need batch >= 1, new_tokens >= 1, context >= 0; got {batch}, {new_tokens}, {context}")
    kv_dtype_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    rows = batch if logits_rows is None else logits_rows
    tokens = batch * new_tokens
    h, v, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    flops_matmul = 2.0 * tokens * layers * layer_matmul_params(cfg) + 2.0 * rows * v * h
    # Query i of the step (0-based) sees context + i + 1 keys; QK^T and PV are one multiply-add each per
    # (query head, key, head-dim element).
    pairs = new_tokens * context + new_tokens * (new_tokens + 1) / 2
    flops_attention = 4.0 * batch * layers * cfg.num_attention_heads * cfg.head_dim * pairs
    w_bytes = weight_bytes(cfg, dtype_bytes) + tokens * h * dtype_bytes  # + the embedding rows looked up
    per_token_kv = kv_bytes_per_token(cfg, kv_dtype_bytes)
    kv_read = batch * (context + new_tokens) * per_token_kv
    kv_write = tokens * per_token_kv
    act = (tokens * layers * activation_elements_per_token_layer(cfg)  # the layers
           + tokens * 3 * h  # embedding output, final norm in and out
           + rows * (h + v)) * dtype_bytes  # lm_head input rows and logits
    return StepCost(batch, new_tokens, context, flops_matmul, flops_attention, w_bytes, kv_read, kv_write, act)


def prefill_cost(cfg: ModelConfig, batch: int, prompt_len: int, dtype_bytes: float = 2) -> StepCost:
    return step_cost(cfg, batch=batch, new_tokens=prompt_len, context=0, dtype_bytes=dtype_bytes)


def decode_cost(cfg: ModelConfig, batch: int, context: int, dtype_bytes: float = 2) -> StepCost:
    return step_cost(cfg, batch=batch, new_tokens=1, context=context, dtype_bytes=dtype_bytes)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity (FLOP/byte) above which a step is compute-bound on this machine."""
    return peak_flops / bandwidth


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline itself: the best FLOP/s a step of this intensity can reach."""
    return min(peak_flops, intensity * bandwidth)


def step_time_bound(cost: StepCost, peak_flops: float, bandwidth: float) -> float:
    """Lower bound on one step's time: whichever of arithmetic or memory traffic takes longer."""
    return max(cost.flops / peak_flops, cost.bytes / bandwidth)


# --- the machine's ceilings -------------------------------------------------------------------------


def measure_gemv_bandwidth(device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                           n: int | None = None, repeats: int = 9) -> float:
    """Bytes/s of weight read by a large matrix-vector product, the kernel that batch-1 decode runs.
    This is what the matmul library achieves on one stream of weights, which can sit well below the
    copy bandwidth (a CPU library may not spread one matrix-vector product over all memory channels)."""
    dev = _device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    n = n or (16384 if dev.type == "cuda" else 4096)
    w = torch.randn(n, n, device=dev).to(dtype)
    x = torch.randn(1, n, device=dev).to(dtype)
    best = min(_times(lambda: torch.nn.functional.linear(x, w), dev, repeats, warmup=2))
    return w.numel() * w.element_size() / best


def measure_matmul_rate(device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                        n: int | None = None, repeats: int = 5) -> float:
    """FLOP/s of a large square matmul (``2 n^3`` FLOPs): the compute ceiling a prefill can approach.
    Defaults: float32 ``n=2048`` on a CPU (a few tenths of a second each), bf16 ``n=8192`` on a GPU."""
    dev = _device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    n = n or (8192 if dev.type == "cuda" else 2048)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    best = min(_times(lambda: a @ b, dev, repeats, warmup=1))
    return 2 * n**3 / best


def _matrix(nbytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A square-ish weight matrix of about ``nbytes`` (constant values: the time of a product does not
    depend on them, and filling is much faster than drawing random numbers)."""
    elem = torch.finfo(dtype).bits // 8
    n = max(16, int((nbytes / elem) ** 0.5) // 16 * 16)
    return torch.full((n, n), 0.01, dtype=dtype, device=device)


def matvec_size_sweep(device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                      sizes_mib: Iterable[float] | None = None, repeats: int = 7) -> list[dict[str, float]]:
    """Median time of one ``matrix x vector`` product for matrices from 64 KiB to hundreds of MiB.

    Small matrices sit in the caches and cost a fixed per-call overhead; large ones stream from main
    memory at the bandwidth. A batch-1 decode step is a chain of such products, one per weight matrix."""
    dev = _device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    sizes_mib = sizes_mib or ((0.0625, 0.25, 1, 4, 16, 64, 256, 1024) if dev.type == "cuda"
                              else (0.0625, 0.25, 1, 4, 16, 64, 256))
    rows = []
    with torch.inference_mode():
        for mib in sizes_mib:
            w = _matrix(int(mib * 2**20), dtype, dev)
            x = torch.full((1, w.shape[1]), 0.01, dtype=dtype, device=dev)
            sec = statistics.median(_times(lambda: torch.nn.functional.linear(x, w), dev, repeats, warmup=2))
            rows.append({"bytes": w.numel() * w.element_size(), "seconds": sec})
            del w
    return rows


def matvec_batch_sweep(device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                       mib: float | None = None, batches: Iterable[int] | None = None,
                       repeats: int = 7) -> list[dict[str, float]]:
    """Median time of one large matrix times ``batch`` vectors: the weights are read once whatever the
    batch, so while reading them dominates, more vectors cost almost nothing extra. This is the whole
    case for batching decode, in one kernel."""
    dev = _device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    mib = mib or (512 if dev.type == "cuda" else 64)
    batches = batches or ((1, 4, 16, 64, 128, 256, 512) if dev.type == "cuda" else (1, 2, 4, 8, 16, 32, 64, 128))
    w = _matrix(int(mib * 2**20), dtype, dev)
    rows = []
    with torch.inference_mode():
        for b in batches:
            x = torch.full((b, w.shape[1]), 0.01, dtype=dtype, device=dev)
            sec = statistics.median(_times(lambda: torch.nn.functional.linear(x, w), dev, repeats, warmup=2))
            n = w.shape[0]
            rows.append({"batch": b, "bytes": w.numel() * w.element_size(), "seconds": sec,
                         "flops": 2.0 * b * w.numel(), "intensity": 2.0 * b * w.numel() / (
                             (w.numel() + b * 2 * n) * w.element_size())})
    return rows


@dataclass(frozen=True)
class Ceilings:
    """This machine's measured limits, in bytes/s and FLOP/s."""

    device: str
    dtype: str
    copy_bandwidth: float
    gemv_bandwidth: float
    matmul_flops: float

    @property
    def ridge(self) -> float:
        return ridge_point(self.matmul_flops, self.copy_bandwidth)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ridge": self.ridge}


def measure_ceilings(device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> Ceilings:
    """Copy bandwidth, matrix-vector bandwidth and matmul rate, in a few seconds."""
    dev = _device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    with torch.inference_mode():
        return Ceilings(device_name(dev), str(dtype).replace("torch.", ""), measure_copy_bandwidth(dev),
                        measure_gemv_bandwidth(dev, dtype), measure_matmul_rate(dev, dtype))


def weight_matrix_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of each distinct weight matrix shape in the model (first layer's q/k/v, o, gate/up, down,
    and the lm_head): the sizes a decode step streams through one matrix-vector product at a time."""
    out: dict[str, int] = {}
    layer = model.model.layers[0]
    for name, mod in [*layer.named_modules(), ("lm_head", model.lm_head)]:
        if isinstance(mod, torch.nn.Linear):
            out[name.split(".")[-1]] = mod.weight.numel() * mod.weight.element_size()
    return out


# --- timing the model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTiming:
    """One measured forward step and its counted cost."""

    phase: str  # "prefill" or "decode"
    seconds: float  # median wall time of one step
    cost: StepCost

    @property
    def batch(self) -> int:
        return self.cost.batch

    @property
    def tokens(self) -> int:
        return self.cost.tokens

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def achieved_flops(self) -> float:
        return self.cost.flops / self.seconds

    @property
    def achieved_bandwidth(self) -> float:
        return self.cost.bytes / self.seconds

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "batch": self.batch, "new_tokens": self.cost.new_tokens,
                "context": self.cost.context, "seconds": self.seconds, "seconds_per_token": self.seconds_per_token,
                "tokens_per_second": self.tokens_per_second, "achieved_flops": self.achieved_flops,
                "achieved_bandwidth": self.achieved_bandwidth, "cost": self.cost.to_dict()}


def _model_dtype_device(model: LlamaForCausalLM) -> tuple[torch.dtype, torch.device]:
    w = model.lm_head.weight
    return w.dtype, w.device


def _cache(model: LlamaForCausalLM, batch: int, max_len: int) -> ContiguousKVCache:
    cfg = model.config
    dtype, device = _model_dtype_device(model)
    return ContiguousKVCache(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim,
                             dtype, device)


@dataclass
class _Runner:
    """One point of a sweep, set up once: ``fn`` runs ``steps`` forward steps of the same shape."""

    phase: str
    fn: Callable[[], None]
    steps: int
    cost: StepCost


def _prefill_runner(model: LlamaForCausalLM, batch: int, prompt_len: int, seed: int = 0) -> _Runner:
    cfg = model.config
    dtype, device = _model_dtype_device(model)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(cfg.vocab_size, (batch * prompt_len,), generator=gen).to(device)
    positions = torch.arange(prompt_len, device=device).repeat(batch)
    valid = torch.ones(batch, prompt_len, dtype=torch.bool, device=device)
    cache = _cache(model, batch, prompt_len)

    def step() -> None:
        cache.begin_step(0, prompt_len, valid)
        hidden = model(ids, positions, cache)
        model.compute_logits(hidden.view(batch, prompt_len, -1)[:, -1])

    return _Runner("prefill", step, 1, prefill_cost(cfg, batch, prompt_len, dtype_bytes=torch.finfo(dtype).bits / 8))


def _decode_runner(model: LlamaForCausalLM, batch: int, context: int, steps: int = 4, seed: int = 0) -> _Runner:
    cfg = model.config
    dtype, device = _model_dtype_device(model)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(cfg.vocab_size, (batch,), generator=gen).to(device)
    ones = torch.ones(batch, 1, dtype=torch.bool, device=device)
    cache = _cache(model, batch, context + steps)
    if context:
        cache.begin_step(0, context, torch.ones(batch, context, dtype=torch.bool, device=device))
    positions = [torch.full((batch,), context + s, device=device) for s in range(steps)]

    def run() -> None:
        for s in range(steps):
            cache.begin_step(context + s, 1, ones)
            hidden = model(ids, positions[s], cache)
            model.compute_logits(hidden)

    cost = decode_cost(cfg, batch, context + steps // 2, dtype_bytes=torch.finfo(dtype).bits / 8)
    return _Runner("decode", run, steps, cost)


def _measure(runners: list[_Runner], device: torch.device, repeats: int, warmup: int) -> list[StepTiming]:
    """Time every runner ``repeats`` times in interleaved rounds (all points, then all points again) and
    keep each point's median. A burst of activity from another process then spoils one sample of many
    points instead of every sample of one point, which would bend the curve at that point."""
    samples: list[list[float]] = [[] for _ in runners]
    with torch.inference_mode():
        for r in runners:
            for _ in range(warmup):
                r.fn()
        _sync(device)
        for _ in range(repeats):
            for r, out in zip(runners, samples):
                t0 = time.perf_counter()
                r.fn()
                _sync(device)
                out.append((time.perf_counter() - t0) / r.steps)
    return [StepTiming(r.phase, statistics.median(out), r.cost) for r, out in zip(runners, samples)]


def time_prefill(model: LlamaForCausalLM, batch: int, prompt_len: int, *, repeats: int = 3, warmup: int = 1,
                 seed: int = 0) -> StepTiming:
    """Median time of one prefill step: ``batch`` prompts of ``prompt_len`` random tokens through the whole
    model into a fresh KV cache, then the logits of each prompt's last token."""
    runner = _prefill_runner(model, batch, prompt_len, seed)
    return _measure([runner], _model_dtype_device(model)[1], repeats, warmup)[0]


def time_decode(model: LlamaForCausalLM, batch: int, context: int, *, steps: int = 4, repeats: int = 3,
                warmup: int = 1, seed: int = 0) -> StepTiming:
    """Median time of one decode step: ``batch`` sequences that already hold ``context`` tokens each add one.

    The cache's first ``context`` slots are declared valid without running a prefill: a step's time
    depends on the shapes it reads, not on the values (zeros here), and skipping the prefill keeps the
    sweep fast. Each repeat runs ``steps`` consecutive decode steps (context, context+1, ...)."""
    runner = _decode_runner(model, batch, context, steps, seed)
    return _measure([runner], _model_dtype_device(model)[1], repeats, warmup)[0]


def sweep_prefill(model: LlamaForCausalLM, prompt_lens: Iterable[int], batch: int = 1, *, repeats: int = 5,
                  warmup: int = 1) -> list[StepTiming]:
    """Prefill of ``batch`` prompts at each length, measured in interleaved rounds."""
    runners = [_prefill_runner(model, batch, n) for n in prompt_lens]
    return _measure(runners, _model_dtype_device(model)[1], repeats, warmup)


def sweep_decode(model: LlamaForCausalLM, batches: Iterable[int], context: int, *, repeats: int = 5,
                 warmup: int = 1, steps: int = 4) -> list[StepTiming]:
    """Decode steps at each batch size (all at ``context``), measured in interleaved rounds."""
    runners = [_decode_runner(model, b, context, steps) for b in batches]
    return _measure(runners, _model_dtype_device(model)[1], repeats, warmup)


def time_generate(llm: Any, *, batch: int = 1, prompt_len: int = 32, max_tokens: int = 64,
                  seed: int = 0) -> dict[str, float]:
    """Decode speed through the whole engine (``LLM.generate``: sampling, stop checks, detokenizing),
    from the requests' own timestamps: seconds per decode step after the first token, and tokens/s."""
    from minifer.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = llm.model_config.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(1, vocab, (prompt_len,), generator=gen).tolist()}
               for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    outs = llm.generate(prompts, params, use_tqdm=False)
    m = outs[0].metrics
    step = (m.finished_time - m.first_token_time) / (max_tokens - 1)
    return {"batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens, "seconds_per_step": step,
            "tokens_per_second": batch / step}


def time_budget(t: StepTiming, c: Ceilings) -> dict[str, float]:
    """Split a measured step's time into what the roofline explains and what it does not.

    ``memory_floor``: reading the weights and KV cache at the matrix-vector bandwidth (the rate the
    kernels decode runs actually reach; activations left out, they are small at decode sizes).
    ``compute_floor``: the FLOPs at the large-matmul rate. ``other``: the rest of the measured time:
    launching a few hundred small operations from Python, the ops the cost model leaves out, and kernels
    that reach neither ceiling at these shapes."""
    memory = (t.cost.weight_bytes + t.cost.kv_read_bytes + t.cost.kv_write_bytes) / c.gemv_bandwidth
    compute = t.cost.flops / c.matmul_flops
    return {"measured": t.seconds, "memory_floor": memory, "compute_floor": compute,
            "other": max(0.0, t.seconds - max(memory, compute))}


# --- published models on published hardware ---------------------------------------------------------


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s, dense, in the dtype the models run in
    source: str

    @property
    def ridge(self) -> float:
        return ridge_point(self.peak_flops, self.bandwidth)


H200_MEASURED = Hardware("H200, measured", 4.3e12, 790e12,
                         "literature.md: device-to-device copy and bf16 matmul measured on one H200")
H200_DATASHEET = Hardware("H200, datasheet", 4.8e12, 989e12, "NVIDIA H200 datasheet (dense bf16)")

# Llama-2-7B is not among the shipped configs; literature.md's "bounded near 326 tok/s on an H200" is
# about it, so its published hyperparameters (meta-llama/Llama-2-7b-hf config.json) are written here to
# reproduce that figure.
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def reference_configs() -> dict[str, ModelConfig]:
    """Published models by hub id: the configs shipped in ``minifer/assets/configs`` plus Llama-2-7B."""
    from minifer.model_loader import SHIPPED_CONFIGS, load_config

    configs = {name: load_config(path) for name, path in SHIPPED_CONFIGS.items()}
    configs["meta-llama/Llama-2-7b-hf"] = ModelConfig.from_dict(LLAMA2_7B)
    return configs


def decode_tokens_per_second_bound(cfg: ModelConfig, hw: Hardware, *, batch: int = 1, context: int = 0,
                                   dtype_bytes: float = 2, kv_dtype_bytes: float | None = None,
                                   with_activations: bool = False) -> float:
    """Upper bound on decode tokens/s (all sequences together): ``batch`` tokens per step, and a step
    cannot beat ``max(FLOPs / peak, bytes / bandwidth)``. Activations are left out by default because a
    serving kernel keeps them on chip at decode sizes."""
    c = step_cost(cfg, batch=batch, new_tokens=1, context=context, dtype_bytes=dtype_bytes,
                  kv_dtype_bytes=kv_dtype_bytes)
    moved = c.bytes if with_activations else c.weight_bytes + c.kv_read_bytes + c.kv_write_bytes
    return batch / max(c.flops / hw.peak_flops, moved / hw.bandwidth)


def ridge_batch(cfg: ModelConfig, hw: Hardware, *, context: int, dtype_bytes: float = 2,
                max_batch: int = 4096) -> int | None:
    """Smallest decode batch whose intensity (weights + KV) reaches ``hw``'s ridge point, or None when the
    KV cache keeps it below the ridge at any batch up to ``max_batch``."""
    for b in range(1, max_batch + 1):
        c = decode_cost(cfg, b, context, dtype_bytes)
        if c.intensity_weights_kv >= hw.ridge:
            return b
    return None


def decode_intensity_limit(cfg: ModelConfig, context: int, dtype_bytes: float = 2) -> float:
    """The decode intensity that no batch size can exceed at ``context`` tokens per sequence.

    Weights are read once per step however many sequences share it, but each sequence's KV cache is read
    for that sequence alone. With ``b`` sequences, FLOPs grow as ``b * f`` and bytes as ``W + b * kv``, so
    the intensity tends to ``f / kv`` as ``b`` grows: a ceiling set by the KV cache, not by the weights."""
    one = decode_cost(cfg, 1, context, dtype_bytes)
    return one.flops / (one.kv_read_bytes + one.kv_write_bytes)


def bound_table(hw: Hardware = H200_MEASURED, configs: dict[str, ModelConfig] | None = None,
                dtype_bytes: float = 2, context: int = 1024) -> list[dict[str, Any]]:
    """One row per model, sorted by size: parameters, the bytes of weights a decode step reads, the
    batch-1 decode bound on ``hw`` (tokens/s), the KV cache per token, the batch at which the KV cache
    read at ``context`` tokens equals the weights, and the decode intensity no batch can exceed there."""
    rows = []
    for name, cfg in (configs or reference_configs()).items():
        w = weight_bytes(cfg, dtype_bytes)
        kv = kv_bytes_per_token(cfg, dtype_bytes)
        rows.append({
            "model": name,
            "params": cfg.num_parameters(),
            "weight_gb": w / 1e9,
            "kv_kib_per_token": kv / 1024,
            "batch1_tokens_per_s": decode_tokens_per_second_bound(cfg, hw, dtype_bytes=dtype_bytes),
            "kv_equals_weights_batch": w / (kv * context),
            "intensity_limit": decode_intensity_limit(cfg, context, dtype_bytes),
            "context": context,
        })
    return sorted(rows, key=lambda r: r["params"])


# --- the whole chapter-01 measurement, as JSON ------------------------------------------------------


@dataclass
class RooflineResults:
    """Everything chapter 01 measures, ready for plots and for ``json.dump``."""

    model: str
    dtype: str
    environment: dict[str, Any]
    ceilings: Ceilings
    prefill: list[StepTiming] = field(default_factory=list)
    decode_by_batch: dict[int, list[StepTiming]] = field(default_factory=dict)  # context -> batch sweep
    decode_by_context: list[StepTiming] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "environment": self.environment,
                "ceilings": self.ceilings.to_dict(), "prefill": [t.to_dict() for t in self.prefill],
                "decode_by_batch": {str(c): [t.to_dict() for t in ts] for c, ts in self.decode_by_batch.items()},
                "decode_by_context": [t.to_dict() for t in self.decode_by_context]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path


PROMPT_LENS = (16, 32, 64, 128, 256, 512)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXTS = (16, 64, 128, 256, 512)


def run_roofline(llm: Any, *, ceilings: Ceilings | None = None, prompt_lens: Iterable[int] = PROMPT_LENS,
                 decode_batches: Iterable[int] = DECODE_BATCHES, batch_contexts: Iterable[int] = (128, 512),
                 decode_contexts: Iterable[int] = DECODE_CONTEXTS, repeats: int = 5) -> RooflineResults:
    """The chapter's sweeps on ``llm``'s model: prefill over prompt lengths (batch 1), decode over batch
    sizes (at each of ``batch_contexts``) and over context lengths (batch 1), all measured together in
    ``repeats`` interleaved rounds; each point reports its median."""
    model = llm.model
    dtype, device = _model_dtype_device(model)
    ceilings = ceilings or measure_ceilings(device, dtype)
    res = RooflineResults(str(getattr(llm, "model_path", "")), str(dtype).replace("torch.", ""), environment(),
                          ceilings)
    prompt_lens, decode_batches = list(prompt_lens), list(decode_batches)
    batch_contexts, decode_contexts = list(batch_contexts), list(decode_contexts)
    # Every point of every sweep in one interleaved measurement (see _measure).
    runners = [_prefill_runner(model, 1, n) for n in prompt_lens]
    runners += [_decode_runner(model, b, c) for c in batch_contexts for b in decode_batches]
    runners += [_decode_runner(model, 1, c) for c in decode_contexts]
    timings = _measure(runners, device, repeats, warmup=1)
    res.prefill, rest = timings[:len(prompt_lens)], timings[len(prompt_lens):]
    for c in batch_contexts:
        res.decode_by_batch[c], rest = rest[:len(decode_batches)], rest[len(decode_batches):]
    res.decode_by_context = rest
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minifer_course.roofline",
                                     description="Measure this machine's roofline and a model's prefill/decode steps.")
    parser.add_argument("--model", default="tinystories-target", help="bundled name, local folder or hub id")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16")
    parser.add_argument("--load-format", default="auto", help="'dummy' for random weights of a shipped config")
    parser.add_argument("--out", default=str(default_results_path()), help="where to write the JSON")
    parser.add_argument("--quick", action="store_true", help="fewer points and repeats (a smoke test)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: see default_threads)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or default_threads())

    from minifer import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format)
    kw: dict[str, Any] = {}
    if args.quick:
        kw = dict(prompt_lens=(16, 128), decode_batches=(1, 8), batch_contexts=(128,), decode_contexts=(128,),
                  repeats=2)
    res = run_roofline(llm, **kw)
    path = res.save(args.out)
    c = res.ceilings
    print(f"{c.device}: copy {c.copy_bandwidth / 1e9:.1f} GB/s, gemv {c.gemv_bandwidth / 1e9:.1f} GB/s, "
          f"matmul {c.matmul_flops / 1e9:.1f} GFLOP/s ({c.dtype}), ridge {c.ridge:.1f} FLOP/byte")
    for t in res.prefill:
        print(f"prefill batch 1 x {t.cost.new_tokens:4d} tokens: {t.seconds_per_token * 1e6:9.1f} us/token, "
              f"intensity {t.cost.intensity:6.1f}")
    for ctx, ts in res.decode_by_batch.items():
        for t in ts:
            print(f"decode  batch {t.batch:3d} (context {ctx}): {t.seconds_per_token * 1e6:9.1f} us/token, "
                  f"intensity {t.cost.intensity:6.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
