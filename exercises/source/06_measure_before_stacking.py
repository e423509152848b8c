# Source of exercises/06_measure_before_stacking.ipynb and solutions/06_measure_before_stacking.ipynb.
# Edit this file, never the notebooks, then run `make exercises` (see exercises/README.md).

# %% [markdown]
# # Exercises 06 · Measure before stacking
#
# Chapter 06 put four levers on one workload in one memory budget: continuous batching, speculative decoding,
# int8 weights and an int8 KV cache. Two ideas carried the chapter, and you rebuild both here:
#
# 1. **one memory budget**: the weights and the KV cache share the memory, so a lever that shrinks the weights
#    (or grows them, like a draft model) changes how many cache blocks there are, and with them how many
#    requests can decode at once;
# 2. **reading a factorial**: from the measured gain of every combination of levers, each lever's gain alone,
#    the product of those, the gain of the full stack, how far the product overshoots, and each lever's gain
#    when added last.
#
# Each exercise explains the idea, gives a function whose body you write, then a **check cell** that grades it
# against minifer's own (`minifer/bench/stacking.py`). A check prints `ok` per passing check and stops at the
# first failure with what differs and a hint.

# %% [markdown] exercise-only
# Run the cells from the top. Stuck? The solved twin is
# [`solutions/06_measure_before_stacking.ipynb`](../solutions/06_measure_before_stacking.ipynb).

# %% [markdown] solution-only
# *This is the solved twin of
# [`exercises/06_measure_before_stacking.ipynb`](../exercises/06_measure_before_stacking.ipynb), generated from
# `exercises/source/06_measure_before_stacking.py` by `make exercises`: edit the source, not this notebook.*

# %%
import json
import math
import statistics
from pathlib import Path

import minifer
from minifer.bench.stacking import LEVERS, SHORT, configurations, label
from minifer.bench.stacking import lever_analysis as minifer_lever_analysis
from minifer.bench.stacking import split_budget

RESULTS = Path(minifer.__file__).resolve().parents[1] / "benchmarks" / "results"

# %% [markdown]
# ## 1 · One budget, in blocks
#
# A serving engine loads the weights first and gives the KV cache what is left of its memory (vLLM:
# `gpu_memory_utilization` of the GPU, minus the weights and some room for activations). The cache is handed out
# in **blocks** of a fixed number of tokens, and a block of the target costs the same number of bytes whatever it
# holds (chapter 02). So the number of blocks is whole blocks of what the weights leave.
#
# Write `kv_blocks(memory, weight_bytes, block_bytes)`: the number of whole blocks of `block_bytes` that fit in
# `memory - weight_bytes`. If not even one fits, raise a `ValueError`: an engine without a cache can serve
# nothing, and it should say so when it starts, not when the first request arrives.

# %%
def kv_blocks(memory: int, weight_bytes: int, block_bytes: int) -> int:
    """Whole KV blocks of ``block_bytes`` in what ``weight_bytes`` leave of ``memory``; ValueError if none."""
    ### BEGIN SOLUTION
    left = memory - weight_bytes
    blocks = left // block_bytes if left > 0 else 0
    if blocks < 1:
        raise ValueError(f"{memory} bytes of memory leave {left} after {weight_bytes} bytes of weights: "
                         f"not one block of {block_bytes} bytes")
    return blocks
    ### END SOLUTION


# %%
# NBVAL_CHECK_OUTPUT
from minifer.course.grading.stacking import check_kv_blocks

check_kv_blocks(kv_blocks)

# %% [markdown]
# The bundled target in float32 holds 38,298,624 bytes of weights; in int8 (the decoder's linear layers; the
# embeddings and the output layer stay in float32) 13,046,784. A block of 16 tokens of its cache costs 98,304
# bytes in float32 and 26,112 in int8 with a scale per (token, head). Chapter 06's benchmark gave every
# configuration the float32 weights plus 8 MiB. (The engine holds back two blocks of its cache, a scratch and a null
# block, so the benchmark's tables show two fewer. The cells below call minifer's own functions, so that they run
# before you have written yours; once your check passes, put yours in: the numbers must not change.)

# %%
memory = 38_298_624 + 8 * 2**20
for name, weights, block in [("float32 weights, float32 cache", 38_298_624, 98_304),
                             ("int8 weights, float32 cache", 13_046_784, 98_304),
                             ("float32 weights, int8 cache", 38_298_624, 26_112),
                             ("int8 weights, int8 cache", 13_046_784, 26_112)]:
    n = split_budget(memory, weights, block, 16).kv_blocks  # = kv_blocks(memory, weights, block)
    print(f"{name:32s} {n:5d} blocks = {16 * n:6,d} tokens of cache")

# %% [markdown]
# Four times the blocks from int8 weights, because this small model's weights are most of the budget. For a large
# model on a large GPU the cache is most of the memory and int8 weights add only a few percent to it: the same
# lever, a different gain.
#
# ## 2 · Reading a factorial
#
# The factorial has nine configurations: static batching with nothing else, and continuous batching (`CB`) with
# every subset of the other three levers, eight of them (static batching cannot host them). Each configuration's
# **gain** is its throughput over static batching's, so `gain[frozenset()] == 1`. Here is the list, and how the
# notebook names them (the benchmark's table has a tenth row, `CB (A/A)`: plain continuous batching run a second
# time, a control whose difference from `CB` is the measurement's noise, not a configuration of the factorial):

# %%
for c in configurations():
    print(f"{label(c):16s} {sorted(c)}")

# %% [markdown]
# From the nine gains, five readings (write `static = frozenset()`, `cb = frozenset({"continuous"})`,
# `full = frozenset(LEVERS)`):
#
# * `alone`, for each of the four levers: continuous batching's is `gain[cb] / gain[static]`; every other
#   lever's is over plain continuous batching, its only host: `gain[cb | {x}] / gain[cb]`;
# * `product`: the four alone gains multiplied, the estimate chapter 06 warns about;
# * `stacked`: `gain[full] / gain[static]`, what all four measured together;
# * `overlap`: `product / stacked`, how far the estimate overshoots (1 when the levers are independent, above 1
#   when their gains overlap, below 1 when they help each other);
# * `in_stack`, each lever's gain when it is **added last**, on top of all the others: `gain[full] /
#   gain[full - {x}]`. For continuous batching, which cannot be removed while the others stay, use its alone gain.
#
# Write `lever_analysis(gain)` returning a dict with those five keys (`alone` and `in_stack` are dicts keyed by
# the lever names of `LEVERS`). If any of the nine configurations is missing from `gain`, raise a `ValueError`
# that names it (use `label`): a factorial with a hole cannot be read. Do not change `gain`. Divide by static
# batching's value rather than assume it is 1: the readings are ratios, and the check also passes raw
# throughputs (tokens/s).

# %%
def lever_analysis(gain: dict[frozenset, float]) -> dict:
    """Alone, product, stacked, overlap and added-last gains from the gain of every configuration."""
    ### BEGIN SOLUTION
    missing = [label(c) for c in configurations() if c not in gain]
    if missing:
        raise ValueError(f"missing configuration(s): {', '.join(missing)}")
    static, cb, full = frozenset(), frozenset({"continuous"}), frozenset(LEVERS)
    alone = {"continuous": gain[cb] / gain[static]}
    in_stack = {"continuous": alone["continuous"]}
    for x in LEVERS[1:]:
        alone[x] = gain[cb | {x}] / gain[cb]
        in_stack[x] = gain[full] / gain[full - {x}]
    product = math.prod(alone.values())
    stacked = gain[full] / gain[static]
    return {"alone": alone, "product": product, "stacked": stacked, "overlap": product / stacked,
            "in_stack": in_stack}
    ### END SOLUTION


# %%
# NBVAL_CHECK_OUTPUT
from minifer.course.grading.stacking import check_lever_analysis

check_lever_analysis(lever_analysis)

# %% [markdown]
# ## 3 · On the measurement
#
# The analysis on the committed benchmark (`benchmarks/results/stacking.json`, 96 requests, three rounds, the
# bundled pair on a CPU). Each round's gains are read on their own, so that a ratio of two configurations compares
# runs made seconds apart, and each reading's median over the rounds is reported, as in chapter 06:

# %%
bench = json.loads((RESULTS / "stacking.json").read_text())
rows = bench["rows"]
rounds = [minifer_lever_analysis({c: rows[label(c)]["round_gains"][r] for c in configurations()})  # = lever_analysis
          for r in range(bench["rounds"])]


def median(values):
    return statistics.median(values)


for x in LEVERS:
    print(f"{SHORT[x]:5s} alone {median([a['alone'][x] for a in rounds]):5.2f}x   "
          f"added last {median([a['in_stack'][x] for a in rounds]):5.2f}x")
print(", ".join(f"{key} {median([a[key] for a in rounds]):.2f}" for key in ("product", "stacked", "overlap")))

# %% [markdown]
# The product promises more than half again what the stack delivers. Two of the levers buy the same thing (cache
# blocks), and once the cache holds everything the workload keeps in flight the second buys nothing; speculation's
# gain depends on the concurrency the others raise. Read `in_stack` before you decide which levers to keep: here
# int8 weights earn their place on top of the others, the int8 cache (for this workload and budget) does not.
#
# ## Where these live in the engine
#
# * `kv_blocks` is `minifer.bench.stacking.split_budget` (which also counts static batching's rows); the engine's
#   `CacheConfig.num_blocks` (`minifer/engine/llm_engine.py`) does the same from `kv_cache_memory` on a CPU or
#   `gpu_memory_utilization` on a GPU, less the two blocks its cache holds back (`usable_blocks`);
# * `lever_analysis` is `minifer.bench.stacking.lever_analysis`, which also reads each lever's gain in every
#   context of the others (`contexts`) and the cumulative path in the course's order (`path`).
