# Source of exercises/01_diagnose.ipynb and solutions/01_diagnose.ipynb.
# Edit this file, never the notebooks, then run `make exercises` (see exercises/README.md).

# %% [markdown]
# # Exercises 01 · Diagnose: arithmetic intensity and a step-cost model fitted to your machine
#
# Chapter 01 claimed that decode is starved of arithmetic: each weight read from memory serves one multiply-add
# per sequence, so a batch-1 decode step does about one FLOP per byte moved, where any accelerator (and a CPU's
# large matmuls) could do dozens. And it showed that the bundled model decodes far slower than even that memory
# bound allows: the rest of the step, small operations launched one by one from Python, dominates. Here you
# rebuild both diagnoses:
#
# 1. **count**: the FLOPs and the bytes of a forward step (decode or prefill) of the bundled target and of a
#    Qwen3-0.6B-shaped model, their ratio (the *arithmetic intensity*), and which of the machine's two ceilings
#    binds;
# 2. **measure and model**: time the engine's decode step at several batch sizes on *your* machine, fit the
#    step-cost model $t(b) = t_0 + b\,t_1$ to those timings, and predict the batch at which decode stops being
#    dominated by the cost every step pays whatever its batch.
#
# Each exercise gives a function whose body you write, then a **check cell** that grades it against minifer's
# own (`minifer_course/roofline.py`) on fixed inputs: two real model shapes and an odd one, or data the grader
# generates. A check never looks at your timings, which differ from machine to machine.

# %% [markdown] exercise-only
# Run the cells from the top. Stuck? The solved twin is
# [`solutions/01_diagnose.ipynb`](../solutions/01_diagnose.ipynb).

# %% [markdown] solution-only
# *This is the solved twin of [`exercises/01_diagnose.ipynb`](../exercises/01_diagnose.ipynb), generated from
# `exercises/source/01_diagnose.py` by `make exercises`: edit the source, not this notebook.*

# %%
import math

import numpy as np

from minifer.config import ModelConfig
from minifer_course import roofline as rl
from minifer_course.common import format_table, setup_notebook
from minifer_course.grading.base import or_minifer  # yours once it runs, minifer's until then
from minifer_course.grading.diagnose import configs

print(setup_notebook()["torch_threads"], "thread(s)")
CONFIGS = configs()  # the bundled target, Qwen3-0.6B (the shipped config: no download) and an odd shape
target, qwen = CONFIGS["tinystories-target"], CONFIGS["Qwen/Qwen3-0.6B"]

# %% [markdown]
# ## 1 · The FLOPs of a step
#
# One forward step runs `batch` sequences, each bringing `new_tokens` tokens (a prompt in prefill, one token in
# decode) on top of `context` tokens already in its KV cache. Count, with the chapter's conventions
# (`rl.step_cost`'s docstring):
#
# * **2 FLOPs per multiply-add**: a `[m, k] x [k, n]` matmul is `2 m k n` FLOPs;
# * **the layers**: every token passes through each layer's matmuls with weights: `q, k, v` (`hidden -> q_size,
#   kv_size, kv_size`: with grouped-query attention `kv_size = num_key_value_heads * head_dim` is smaller),
#   `o` (`q_size -> hidden`) and the MLP's gate, up and down (`3 * hidden * intermediate_size`);
# * **attention's own matmuls**, $QK^\top$ and $PV$: one multiply-add each per (query head, key, `head_dim` element).
#   Attention is causal: query $i$ of the step (0-based) sees `context + i + 1` keys;
# * **the LM head** (`hidden -> vocab_size`) runs on one row per sequence, the one sampled from: minifer computes
#   logits only for the last token of each sequence, not for every prompt token.
#
# Norms, RoPE, SiLU and the softmax are left out: well under 1% of the matmuls at these shapes.

# %%
def step_flops(cfg: ModelConfig, batch: int, new_tokens: int, context: int) -> float:
    """FLOPs of one forward step: ``batch`` sequences of ``new_tokens`` new tokens over ``context`` cached ones.
    Uses ``cfg.hidden_size, q_size, kv_size, intermediate_size, num_hidden_layers, num_attention_heads, head_dim,
    vocab_size``."""
    ### BEGIN SOLUTION
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    layer_flops = 2 * batch * new_tokens * layers * per_layer
    lm_head = 2 * batch * cfg.vocab_size * h  # one row per sequence
    pairs = new_tokens * context + new_tokens * (new_tokens + 1) / 2  # causal (query, key) pairs
    attention = 2 * 2 * batch * layers * cfg.num_attention_heads * cfg.head_dim * pairs  # QK^T and PV
    return float(layer_flops + lm_head + attention)
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.diagnose import check_step_flops

check_step_flops(step_flops)

# %% [markdown]
# ## 2 · The bytes of a step
#
# What a step must move between memory and the chip, at least (activations left out: at decode sizes a serving
# kernel keeps them on chip, so this is the chapter's `weight_bytes + kv_read_bytes + kv_write_bytes`):
#
# * **the weights**, read once per step however many sequences share it: every parameter
#   (`cfg.num_parameters()`), except that an *untied* embedding table (`cfg.tie_word_embeddings` false) is not
#   read whole: the step gathers the rows of its `batch * new_tokens` tokens. (A tied table is the LM head's
#   weight too, and the LM head reads all of it.) So: `num_parameters()` minus the untied table, plus the rows;
# * **the KV cache**: a token's entry is a key and a value of `kv_size` values in each layer. Each sequence reads
#   its own cache over `context + new_tokens` positions (attention reads the new keys back too) and writes
#   `new_tokens` new entries;
# * `dtype_bytes` bytes per value: 4 in float32 (the bundled model on a CPU), 2 in bfloat16, 1 in int8.

# %%
def step_bytes(cfg: ModelConfig, batch: int, new_tokens: int, context: int, dtype_bytes: float) -> float:
    """Bytes of weights and KV cache one forward step moves (activations left out)."""
    ### BEGIN SOLUTION
    tokens, h = batch * new_tokens, cfg.hidden_size
    table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h  # an untied table is gathered, not read
    weights = (cfg.num_parameters() - table + tokens * h) * dtype_bytes
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.kv_size * dtype_bytes  # a key and a value, every layer
    kv = batch * (context + new_tokens) * kv_per_token + tokens * kv_per_token  # read, then written
    return float(weights + kv)
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.diagnose import check_step_bytes

check_step_bytes(step_bytes)

# %% [markdown]
# ## 3 · Which ceiling binds
#
# A step of `F` FLOPs that moves `B` bytes cannot take less than the larger of `F / peak_flops` and
# `B / bandwidth` (the two overlap: the chip computes while the next bytes arrive). Which one is larger is the
# comparison of the step's **intensity** `F / B` with the machine's **ridge point** `peak_flops / bandwidth`:
# below the ridge the step is *memory-bound*, above it *compute-bound*.
#
# Write `roofline_bound(flops, bytes_moved, peak_flops, bandwidth)` returning `(seconds, bound)` with `bound`
# either `"memory"` or `"compute"`.

# %%
def roofline_bound(flops: float, bytes_moved: float, peak_flops: float, bandwidth: float) -> tuple[float, str]:
    """The roofline's lower bound on a step's time, and which ceiling sets it ("memory" or "compute")."""
    ### BEGIN SOLUTION
    compute_s, memory_s = flops / peak_flops, bytes_moved / bandwidth
    return (compute_s, "compute") if compute_s > memory_s else (memory_s, "memory")
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.diagnose import check_roofline_bound

check_roofline_bound(roofline_bound)

# %% [markdown]
# ### On this machine
#
# The next cell measures this machine's two ceilings (a large copy's bandwidth and a large matmul's rate, as
# chapter 01 did), then counts a batch-1 decode step (context 128) and a 128-token prefill of both models in
# the dtype the bundled model runs in here (float32 on a CPU). **Before you run it**, decide for each of the four
# rows whether it is memory- or compute-bound. (Your functions are used once they run; until then, minifer's.)

# %%
from minifer import LLM

llm = LLM("tinystories-target")  # float32 on a CPU, bfloat16 on a GPU
ceil = rl.measure_ceilings(llm.device, llm.dtype)
dtype_bytes = llm.dtype.itemsize
print(f"{ceil.device}: copy bandwidth {ceil.copy_bandwidth / 1e9:.1f} GB/s, matmul {ceil.matmul_flops / 1e9:.1f} "
      f"GFLOP/s, ridge {ceil.ridge:.1f} FLOP/byte ({ceil.dtype})")


def _ref_flops(cfg, b, n, c):
    return rl.step_cost(cfg, batch=b, new_tokens=n, context=c).flops


def _ref_bytes(cfg, b, n, c, d):
    s = rl.step_cost(cfg, batch=b, new_tokens=n, context=c, dtype_bytes=d)
    return s.weight_bytes + s.kv_read_bytes + s.kv_write_bytes


flops_of, bytes_of = or_minifer(step_flops, _ref_flops), or_minifer(step_bytes, _ref_bytes)
bound_of = or_minifer(roofline_bound, lambda f, b, p, bw: (max(f / p, b / bw), "compute" if f / p > b / bw
                                                           else "memory"))
rows = []
for name, cfg in (("tinystories-target", target), ("Qwen3-0.6B", qwen)):
    for phase, (b, n, c) in (("decode b1, ctx 128", (1, 1, 128)), ("prefill 128 tokens", (1, 128, 0))):
        f, by = flops_of(cfg, b, n, c), bytes_of(cfg, b, n, c, dtype_bytes)
        seconds, bound = bound_of(f, by, ceil.matmul_flops, ceil.copy_bandwidth)
        rows.append({"model": name, "step": phase, "gflop": f / 1e9, "mb": by / 1e6, "i": f / by, "bound": bound,
                     "ms": seconds * 1e3})
print(format_table(rows, {"model": "model", "step": "step", "gflop": "GFLOP:.3f", "mb": "MB moved:,.1f",
                          "i": "FLOP/byte:.2f", "bound": "bound", "ms": "at least ms:.2f"}))

# %% [markdown]
# Decode sits at about half a FLOP per byte in float32 (one in bfloat16) for both models, whatever their size:
# each weight (4 bytes) is read for one multiply-add (2 FLOPs) per sequence. Prefill reuses each weight for every
# prompt token, so its intensity grows with the prompt and crosses a CPU's ridge (a few FLOP per byte) within a
# handful of tokens.
# The bound is a *floor*: the next part measures how far above it the bundled model's decode runs.
#
# ## 4 · A step-cost model, fitted to your machine
#
# Time the engine's decode step (`rl.sweep_decode`: the model's forward over a batch of sequences that hold 128
# tokens each, in interleaved rounds, median per batch size). The timings are yours: they differ from run to run
# and machine to machine, so nothing below compares them with anything.

# %%
BATCHES = [1, 2, 4, 8, 16, 32, 64]
timings = rl.sweep_decode(llm.model, BATCHES, context=128, repeats=5)
seconds = [t.seconds for t in timings]
print(format_table([{"b": t.batch, "ms": t.seconds * 1e3, "tok_s": t.tokens_per_second} for t in timings],
                   {"b": "batch:d", "ms": "ms per step:.2f", "tok_s": "tokens/s:,.0f"}))

# %% [markdown]
# The step barely grows with the batch at first. A straight line through these points, $t(b) = t_0 + b\,t_1$,
# separates what every step pays whatever its batch ($t_0$: reading the weights, and launching the same few
# hundred small operations) from what each sequence adds ($t_1$: its KV cache, its rows of every matmul).
#
# Write `fit_step_cost(batches, seconds)` returning `(t0, t1)`, the **least-squares** line through all the points
# (not a line through two of them, not through the origin). Raise a `ValueError` when the batches hold fewer
# than two distinct sizes: a line through one batch size has no slope. `np.polyfit` or `np.linalg.lstsq` will
# do, or the closed form: $t_1 = \mathrm{cov}(b, t) / \mathrm{var}(b)$, $t_0 = \bar t - t_1 \bar b$.

# %%
def fit_step_cost(batches: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares ``(t0, t1)`` of ``seconds ~ t0 + batch * t1``; ValueError for fewer than two batch sizes."""
    ### BEGIN SOLUTION
    if len(set(batches)) < 2:
        raise ValueError(f"need at least two distinct batch sizes to fit a line, got {sorted(set(batches))}")
    b, t = np.asarray(batches, dtype=float), np.asarray(seconds, dtype=float)
    t1 = float(((b - b.mean()) * (t - t.mean())).sum() / ((b - b.mean()) ** 2).sum())
    return float(t.mean() - t1 * b.mean()), t1
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.diagnose import check_fit_step_cost

check_fit_step_cost(fit_step_cost)

# %% [markdown]
# Throughput is $b / t(b) = b / (t_0 + b\,t_1)$: it grows almost linearly while $b\,t_1 \ll t_0$ (the fixed cost
# is shared by more sequences) and flattens towards $1 / t_1$ once the per-sequence cost dominates. The two are
# equal at the **crossover batch** $b^* = t_0 / t_1$, where throughput is half its ceiling: below it, decode is
# bound by the fixed cost of a step (overhead and weight reads); above it, by what each sequence costs.
#
# Write `crossover_batch(t0, t1)`. If `t1 <= 0` the step did not grow with the batch over the measured range
# (the fixed cost is all there is, or noise bent the line): return `math.inf`.

# %%
def crossover_batch(t0: float, t1: float) -> float:
    """The batch ``t0 / t1`` where the per-sequence cost equals a step's fixed cost; ``math.inf`` if ``t1 <= 0``."""
    ### BEGIN SOLUTION
    return t0 / t1 if t1 > 0 else math.inf
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.diagnose import check_crossover_batch

check_crossover_batch(crossover_batch)

# %% [markdown]
# ### Your machine's numbers
#
# The fit on your timings, against two yardsticks: how much of $t_0$ reading the weights at the measured copy
# bandwidth explains (the rest is overhead), and the batch at which the roofline says decode would turn
# compute-bound (where the intensity reaches the ridge). **Before you run it**, guess the crossover batch from
# the table above.

# %%
t0, t1 = or_minifer(fit_step_cost, lambda b, t: tuple(np.polyfit(b, t, 1)[::-1]))(BATCHES, seconds)
b_star = or_minifer(crossover_batch, lambda a, b: a / b if b > 0 else math.inf)(t0, t1)
weights_s = bytes_of(target, 1, 1, 128, dtype_bytes) / ceil.copy_bandwidth
hw = rl.Hardware(ceil.device, ceil.copy_bandwidth, ceil.matmul_flops, "measured above")
ridge_b = rl.ridge_batch(target, hw, context=128, dtype_bytes=dtype_bytes)
print(f"t0 = {t0 * 1e3:.2f} ms per step, t1 = {t1 * 1e6:.1f} µs per sequence; crossover batch {b_star:.0f}")
print(f"reading the weights and the cache at {ceil.copy_bandwidth / 1e9:.1f} GB/s: {weights_s * 1e3:.2f} ms "
      f"({100 * weights_s / t0:.0f}% of t0; the rest is overhead)")
print(f"the roofline's compute-bound batch on this machine: {ridge_b}")
print("residuals (ms):", ", ".join(f"b{b}: {1e3 * (s - t0 - b * t1):+.2f}" for b, s in zip(BATCHES, seconds)))

# %% [markdown]
# Read the printed share: on a CPU, reading the weights and the cache at the copy bandwidth explains only a small
# part of the bundled model's $t_0$, so its batch-1 decode is overhead-bound, far above both the bandwidth and the
# compute floor, and batching is nearly free until the crossover the cell printed. That fixed overhead is what
# CUDA graphs remove on a GPU.
# A model whose weights are 2.4 GB (Qwen3-0.6B in float32, chapter 01's section 5) reverses the proportions: its
# $t_0$ is mostly weight reads. The numbers above are from this machine and this run; rerun the timing cell and the fit moves, which is why section 4 of exercise 06 measures the noise before
# believing a difference.
#
# ## Where these live in the engine
#
# * `step_flops` and `step_bytes` are `minifer_course.roofline.step_cost` (`.flops`, and `.weight_bytes +
#   .kv_read_bytes + .kv_write_bytes`; `.bytes` adds the activations, the other extreme);
# * `roofline_bound` is `step_time_bound` beside `ridge_point` and `attainable_flops`;
# * the timings are `sweep_decode`, chapter 01's `run_roofline`, which places each step on the roofline plot.
