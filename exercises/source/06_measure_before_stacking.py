# Source of exercises/06_measure_before_stacking.ipynb and solutions/06_measure_before_stacking.ipynb.
# Edit this file, never the notebooks, then run `make exercises` (see exercises/README.md).

# %% [markdown]
# # Exercises 06 · Measure before stacking
#
# Chapter 06 put four levers on one workload in one memory budget: continuous batching, speculative decoding,
# int8 weights and an int8 KV cache. Two ideas carried the chapter, and you rebuild both here, then the method
# that measured them:
#
# 1. **one memory budget**: the weights and the KV cache share the memory, so a lever that shrinks the weights
#    (or grows them, like a draft model) changes how many cache blocks there are, and with them how many
#    requests can decode at once;
# 2. **reading a factorial**: from the measured gain of every combination of levers, each lever's gain alone,
#    the product of those, the gain of the full stack, how far the product overshoots, and each lever's gain
#    when added last;
# 3. **measuring a difference**: an A/A control, the spread of repeated runs and the median's confidence interval,
#    to tell a lever's effect from the machine's noise.
#
# Each exercise explains the idea, gives a function whose body you write, then a **check cell** that grades it
# against minifer's own (`minifer_course/stacking.py`, `minifer/bench/speculative.py`) or on data it generates. A
# check prints `ok` per passing check and stops at the first failure with what differs and a hint.

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
from minifer_course.stacking import LEVERS, SHORT, configurations, label
from minifer_course.stacking import lever_analysis as minifer_lever_analysis
from minifer_course.stacking import split_budget

RESULTS = Path(minifer.__file__).resolve().parents[1] / "benchmarks" / "results"

from minifer_course.common import setup_notebook

print(setup_notebook())  # CPU threads (one on a machine of two cores or fewer), quiet progress bars

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


# %% nbval-check-output
from minifer_course.grading.stacking import check_kv_blocks

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


# %% nbval-check-output
from minifer_course.grading.stacking import check_lever_analysis

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
# The product promises more than the stack delivers (in the committed three-round run,
# `benchmarks/results/stacking.json`, about 1.4 times). Two of the levers buy the same thing (cache
# blocks), and once the cache holds everything the workload keeps in flight the second buys nothing; speculation's
# gain depends on the concurrency the others raise. Read `in_stack` before you decide which levers to keep: here
# int8 weights earn their place on top of the others (run as W8A8 on a CPU that multiplies int8 natively, they also
# make the step faster); the
# int8 cache and speculation (for this workload and budget) do not: added last, neither is clear of the A/A band.
#
# ## 4 · Is a difference real? An A/A control and the median's interval
#
# Every ratio above came out of a machine whose speed drifts: neighbours, clocks, caches. Before you believe that
# a lever changed the throughput by 5%, measure what the machine alone does to a ratio. Four tools, each a short
# function:
#
# 1. **interleave**: run the two configurations in the same round, one right after the other, so both see the same
#    moment of a drifting machine, and let them take turns going first, so whatever going first costs (cold caches,
#    a clock ramping up) does not always land on the same one. A round's **speedup** of B over A is
#    `seconds_a / seconds_b` (above 1 when B is faster);
# 2. **the A/A control**: the same configuration as both A and B. Its speedups would all be 1.0 on a perfect
#    machine; their spread, the **A/A band** (lowest to highest), is the noise of this machine and this method;
# 3. **the spread of repeated runs**: the range over the median, `(max - min) / median`. The median, because a
#    neighbour only ever adds time: one slow run drags a mean, not a median;
# 4. **the median's confidence interval**: the median of a few rounds is itself a random number. A
#    distribution-free interval takes two order statistics of the sorted values, `(x[j-1], x[n-j])` (0-based),
#    with the largest `j` whose coverage `1 - 2 P(Binomial(n, 1/2) <= j - 1)` is still at least `level`: each
#    value falls below the true median with probability 1/2, whatever the distribution. (A bootstrap works too:
#    the `(1 - level) / 2` and `(1 + level) / 2` quantiles of the medians of resamples, drawn from
#    `np.random.default_rng(seed)` so that the same data give the same interval.)
#
# A lever is **faster** when the whole interval of its median speedup lies above the A/A band, **slower** when it
# lies below it, and otherwise its effect is not measurable here, however far its median is from 1.
#
# Write `interleaved_speedups(run_a, run_b, rounds)`: each `run_*()` runs its configuration once and returns the
# seconds it took; in round `r`, A goes first when `r` is even, B when it is odd; return the list of the rounds'
# speedups `seconds_a / seconds_b`.

# %%
def interleaved_speedups(run_a, run_b, rounds: int) -> list[float]:
    """B's speedup over A in each round, the two run in turn (A first in even rounds, B first in odd ones)."""
    ### BEGIN SOLUTION
    speedups = []
    for r in range(rounds):
        if r % 2 == 0:
            a = run_a()
            b = run_b()
        else:
            b = run_b()
            a = run_a()
        speedups.append(a / b)
    return speedups
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.measure import check_interleaved_speedups

check_interleaved_speedups(interleaved_speedups)

# %% [markdown]
# Write `relative_spread(values)`: `(max - min) / median` of repeated measurements.

# %%
def relative_spread(values: list[float]) -> float:
    """The range of repeated measurements over their median."""
    ### BEGIN SOLUTION
    return (max(values) - min(values)) / statistics.median(values)
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.measure import check_relative_spread

check_relative_spread(relative_spread)

# %% [markdown]
# Write `median_ci(values, level=0.95, seed=0)` returning `(low, high)`, an interval that contains the true median
# with probability `level` (order statistics or a seeded bootstrap; `scipy.stats.binom` has the binomial sums).
# The check draws 200 samples of 25 skewed timings (about 1 s, plus a spike of 0.3-1.5 s in 30% of the runs) and
# counts how often your intervals contain the true median.

# %%
def median_ci(values: list[float], level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """A confidence interval ``(low, high)`` of the median of ``values`` at ``level``."""
    ### BEGIN SOLUTION
    from scipy.stats import binom

    xs, n = sorted(values), len(values)
    j = 1  # coverage of (x[j-1], x[n-j]) is 1 - 2 * P(Binomial(n, 1/2) <= j - 1)
    while j + 1 <= n // 2 and 1 - 2 * binom.cdf(j, n, 0.5) >= level:
        j += 1
    return xs[j - 1], xs[n - j]
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.measure import check_median_ci

check_median_ci(median_ci)

# %% [markdown]
# Write `noise_verdict(speedups, aa_speedups, level=0.95)`: `"faster"`, `"slower"` or
# `"no measurable difference"`, your `median_ci` of the lever's speedups against the A/A band.

# %%
def noise_verdict(speedups: list[float], aa_speedups: list[float], level: float = 0.95) -> str:
    """Whether a lever's median speedup is outside the A/A control's band, by its confidence interval."""
    ### BEGIN SOLUTION
    low, high = median_ci(speedups, level)
    if low > max(aa_speedups):
        return "faster"
    if high < min(aa_speedups):
        return "slower"
    return "no measurable difference"
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.measure import check_noise_verdict

check_noise_verdict(noise_verdict)

# %% [markdown]
# ### On the engine
#
# Now a real measurement: the bundled target serving 8 greedy requests of 24 tokens, against itself (a second
# engine of the same configuration: the A/A control) and against int8 weights (weight-only, `quantization="int8"`:
# the codes are dequantized to float32 inside every layer at every step), 9 rounds of
# each. **Before you run it**, write down whether int8 weights will be faster, slower or not measurably different
# for this small model on this machine. The numbers are yours and vary from run to run: nothing compares them.
# (Your functions are used once they run; until then, minifer's.)

# %%
import time

from minifer import LLM
from minifer.bench.speculative import median_ci as minifer_median_ci
from minifer_course.grading import measure as ref
from minifer_course.grading.base import or_minifer  # yours once it runs, minifer's until then
from minifer.sampling_params import SamplingParams


PROMPTS = ["Once upon a time there was a little", "The dog ran to the", "Lily wanted to play with her",
           "One day, a big red", "Tom and Sue went to the park and", "The sun was hot and the",
           "A little bird sat on a", "Mom said that it was time to"]
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def timed(llm):
    def run() -> float:
        t0 = time.perf_counter()
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return time.perf_counter() - t0
    return run


engines = {"base": LLM("tinystories-target"), "again": LLM("tinystories-target"),
           "int8": LLM("tinystories-target", quantization="int8")}
for llm in engines.values():
    timed(llm)()  # warm-up
speedups_of = or_minifer(interleaved_speedups, ref.interleaved_speedups)
aa = speedups_of(timed(engines["base"]), timed(engines["again"]), 9)
lever = speedups_of(timed(engines["base"]), timed(engines["int8"]), 9)
spread_of = or_minifer(relative_spread, ref.relative_spread)
ci_of = or_minifer(median_ci, lambda v, level=0.95, seed=0: minifer_median_ci(v, level)[:2])
verdict_of = or_minifer(noise_verdict, ref.noise_verdict)
print(f"A/A speedups: {', '.join(f'{x:.3f}' for x in aa)}; band {min(aa):.3f}-{max(aa):.3f}, "
      f"spread {spread_of(aa):.1%}")
low, high = ci_of(lever, 0.95, 0)
print(f"int8 speedups: {', '.join(f'{x:.3f}' for x in lever)}; median {statistics.median(lever):.3f}, "
      f"95% interval {low:.3f}-{high:.3f}")
print("int8 weights:", verdict_of(lever, aa, 0.95))

# %% [markdown]
# Compare your verdict with your prediction. Weight-only int8 reads a quarter of float32's weight bytes but turns
# them back into float32 before every product, so on a CPU, where this small model's step is mostly overhead and
# its weights sit in the caches, expect little difference either way; how busy the machine is (the A/A band: on a
# shared 2-core machine it can span tens of percent) decides whether a small one can be seen at all. Chapter 06's
# lever multiplies int8 codes directly (W8A8), which is faster only on CPUs with int8 dot-product instructions.
# Whole
# runs of half a second each, back to back, see different moments of a busy machine; chapter 06's benchmark
# interleaves single engine steps in a random order (`run_interleaved`) to narrow the band, and keeps a `CB (A/A)`
# row for the same reason as here: the range of its ratios over the rounds is the band inside which a reading is not
# distinguishable from no change.
#
# ## Where these live in the engine
#
# * `kv_blocks` is `minifer_course.stacking.split_budget` (which also counts static batching's rows); the engine's
#   `CacheConfig.num_blocks` (`minifer/engine/llm_engine.py`) does the same from `kv_cache_memory` on a CPU or
#   `gpu_memory_utilization` on a GPU, less the two blocks its cache holds back (`usable_blocks`);
# * `lever_analysis` is `minifer_course.stacking.lever_analysis`, which also reads each lever's gain in every
#   context of the others (`contexts`) and the cumulative path in the course's order (`path`);
# * `interleaved_speedups` is the method of `minifer.bench.speculative.run_interleaved`, which interleaves single
#   engine *steps* in a fresh random order each turn; `median_ci` is `minifer.bench.speculative.median_ci`; the A/A
#   band is `aa_band` in `minifer_course.stacking.analyse_rounds`.
