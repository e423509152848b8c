"""The graders of exercise 01 (``minifer_course.grading.diagnose``) and of exercise 06's measurement section
(``minifer_course.grading.measure``): minifer's own implementations pass with a deterministic report, other correct
routes pass too, and each classic mistake fails with the hint that names it. (The generated notebooks, their
execution and the untouched exercises are covered by ``tests/course/test_exercises.py``.)"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import scipy.stats

from minifer.bench.speculative import median_ci as ref_median_ci
from minifer_course import roofline as rl
from minifer_course.grading import diagnose as gd
from minifer_course.grading import measure as gm
from test_exercises import test_graders_pass_minifers_own_implementation as passes_deterministically

# --- exercise 01: the references and other correct routes ----------------------------------------------------


def _flops(cfg, b, n, c):
    return rl.step_cost(cfg, batch=b, new_tokens=n, context=c).flops


def _bytes(cfg, b, n, c, d, *, weights=1, kv_read=1, kv_write=1, rows=1, whole_table=False):
    """The reference's bytes with switches for the classic mistakes (0 leaves a term out)."""
    s = rl.step_cost(cfg, batch=b, new_tokens=n, context=c, dtype_bytes=d)
    table = cfg.vocab_size * cfg.hidden_size * d if whole_table and not cfg.tie_word_embeddings else 0
    rows_bytes = b * n * cfg.hidden_size * d
    return (weights * (s.weight_bytes - rows_bytes) + rows * rows_bytes + table + kv_read * s.kv_read_bytes
            + kv_write * s.kv_write_bytes)


def _bound(f, by, p, bw):
    return rl.step_time_bound(rl.StepCost(1, 1, 0, f, 0, by, 0, 0, 0), p, bw), ("compute" if f / p > by / bw
                                                                             else "memory")


def _fit(b, t):
    if len(set(b)) < 2:
        raise ValueError("fewer than two batch sizes")
    res = scipy.stats.linregress(b, t)
    return float(res.intercept), float(res.slope)


def _crossover(t0, t1):
    return t0 / t1 if t1 > 0 else math.inf


REFERENCES_01 = [
    (gd.check_step_flops, _flops, "step_flops: 18/18 checks passed"),
    (gd.check_step_bytes, _bytes, "step_bytes: 18/18 checks passed"),
    (gd.check_roofline_bound, _bound, "roofline_bound: 4/4 checks passed"),
    (gd.check_fit_step_cost, _fit, "fit_step_cost: 5/5 checks passed"),
    (gd.check_crossover_batch, _crossover, "crossover_batch: 4/4 checks passed"),
]

# --- exercise 06, section 4: the references and a bootstrap -----------------------------------------------------


def _order_statistic_ci(values, level=0.95, seed=0):
    return ref_median_ci(list(values), level)[:2]


def _bootstrap_ci(values, level=0.95, seed=0, *, of=np.median):
    rng = np.random.default_rng(seed)
    stats = of(rng.choice(np.asarray(values), (2000, len(values))), axis=1)
    return tuple(float(q) for q in np.quantile(stats, [(1 - level) / 2, (1 + level) / 2]))


def _verdict_from(ci):
    def verdict(speedups, aa, level=0.95):
        low, high = ci(speedups, level)
        return "faster" if low > max(aa) else "slower" if high < min(aa) else "no measurable difference"
    return verdict


REFERENCES_06 = [
    (gm.check_interleaved_speedups, gm.interleaved_speedups, "interleaved_speedups: 4/4 checks passed"),
    (gm.check_relative_spread, gm.relative_spread, "relative_spread: 4/4 checks passed"),
    (gm.check_median_ci, _order_statistic_ci, "median_ci: 4/4 checks passed"),
    (gm.check_median_ci, _bootstrap_ci, "median_ci: 4/4 checks passed"),
    (gm.check_noise_verdict, gm.noise_verdict, "noise_verdict: 5/5 checks passed"),
    (gm.check_noise_verdict, _verdict_from(_bootstrap_ci), "noise_verdict: 5/5 checks passed"),
]


@pytest.mark.parametrize("grader, reference, summary", REFERENCES_01 + REFERENCES_06,
                         ids=[f"{g.__name__}-{r.__name__}" for g, r, _ in REFERENCES_01 + REFERENCES_06])
def test_graders_pass_correct_implementations(grader, reference, summary, capsys):
    np_rng = np.random.get_state()
    passes_deterministically(grader, reference, summary, capsys)  # and leaves torch's global RNG alone
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), np_rng)), "nor numpy's"


# --- the classic mistakes ------------------------------------------------------------------------------------


def _flops_with(*, macs=2, lm_head=True, lm_rows_all=False, attention=True, kv_heads=False, causal=True):
    def fn(cfg, b, n, c):
        h, layers = cfg.hidden_size, cfg.num_hidden_layers
        per_layer = rl.layer_matmul_params(cfg)
        total = macs * b * n * layers * per_layer
        total += lm_head * macs * (b * n if lm_rows_all else b) * cfg.vocab_size * h
        pairs = n * c + n * (n + 1) / 2 if causal else n * (c + n)
        heads = cfg.num_key_value_heads if kv_heads else cfg.num_attention_heads
        total += attention * 2 * macs * b * layers * heads * cfg.head_dim * pairs
        return float(total)
    return fn


def _seq_speedups(run_a, run_b, rounds):
    a = [run_a() for _ in range(rounds)]
    return [x / run_b() for x in a]


def _a_first(run_a, run_b, rounds):
    return [run_a() / run_b() for _ in range(rounds)]


def _unsorted_ci(values, level=0.95, seed=0):
    xs = sorted(values)
    low, _, _ = ref_median_ci(xs, level)
    j = xs.index(low)
    return values[j], values[len(values) - 1 - j]


def _global_rng_bootstrap(values, level=0.95, seed=0):
    """A bootstrap that draws from numpy's global generator (the test seeds it, so the verdict is fixed)."""
    medians = np.median(np.random.choice(np.asarray(values), (2000, len(values))), axis=1)
    return tuple(float(q) for q in np.quantile(medians, [(1 - level) / 2, (1 + level) / 2]))


def _t_interval(values, level=0.95, seed=0):
    return scipy.stats.t.interval(level, len(values) - 1, loc=np.mean(values), scale=scipy.stats.sem(values))


WRONG = [
    (gd.check_step_flops, _flops_with(macs=1), "2 FLOPs per multiply-add"),
    (gd.check_step_flops, _flops_with(lm_head=False), "left out the LM head"),
    (gd.check_step_flops, _flops_with(lm_rows_all=True), "one row per sequence"),
    (gd.check_step_flops, _flops_with(attention=False), "QK\\^T and PV"),
    (gd.check_step_flops, _flops_with(kv_heads=True), r"per \*query\* head"),
    (gd.check_step_flops, _flops_with(causal=False), "attention is causal"),
    (gd.check_step_bytes, lambda cfg, b, n, c, d: _bytes(cfg, b, n, c, 2), "multiply by dtype_bytes"),
    (gd.check_step_bytes, lambda cfg, b, n, c, d: _bytes(cfg, b, n, c, 4), "multiply by dtype_bytes"),
    (gd.check_step_bytes, lambda *a: _bytes(*a, kv_read=0, kv_write=0), "count the KV cache"),
    (gd.check_step_bytes, lambda *a: _bytes(*a, kv_write=0), "count twice"),
    (gd.check_step_bytes, lambda *a: _bytes(*a, whole_table=True), "untied embedding table"),
    (gd.check_step_bytes, lambda *a: _bytes(*a, rows=0), "add the embedding rows"),
    (gd.check_step_bytes, lambda cfg, b, n, c, d: _bytes(cfg, b, n, c, d, weights=b),
     "read once per step"),
    (gd.check_roofline_bound, lambda f, by, p, bw: (min(f / p, by / bw), _bound(f, by, p, bw)[1]), "max, not min"),
    (gd.check_roofline_bound, lambda f, by, p, bw: (f / p + by / bw, _bound(f, by, p, bw)[1]), "not their sum"),
    (gd.check_roofline_bound, lambda f, by, p, bw: (_bound(f, by, p, bw)[0], "memory"), "ridge"),
    (gd.check_fit_step_cost, lambda b, t: _fit(b, t)[::-1], r"return \(t0, t1\)"),
    (gd.check_fit_step_cost, lambda b, t: (0.0, float(np.dot(b, t) / np.dot(b, b))), "fit an intercept"),
    (gd.check_fit_step_cost, lambda b, t: _fit(b, [x / y for x, y in zip(t, b)]), "not seconds per token"),
    (gd.check_fit_step_cost, lambda b, t: (t[0] - (t[-1] - t[0]) / (b[-1] - b[0]) * b[0],
                                           (t[-1] - t[0]) / (b[-1] - b[0])), "every point"),
    (gd.check_fit_step_cost, lambda b, t: tuple(np.polyfit(b, t, 1)[::-1]) if len(set(b)) > 1 else (t[0], 0.0),
     "raise ValueError"),
    (gd.check_crossover_batch, lambda t0, t1: t1 / t0, "upside down"),
    (gd.check_crossover_batch, lambda t0, t1: round(t0 / t1) if t1 > 0 else math.inf, "not rounded"),
    (gd.check_crossover_batch, lambda t0, t1: t0 / t1 if t1 else math.inf, "return math.inf"),
    (gm.check_interleaved_speedups, _seq_speedups, "interleave: run A and B in the same round"),
    (gm.check_interleaved_speedups, _a_first, "take turns going first"),
    (gm.check_interleaved_speedups, lambda a, b, r: [1 / x for x in gm.interleaved_speedups(a, b, r)],
     "upside down"),
    (gm.check_relative_spread, lambda v: (max(v) - min(v)) / statistics.fmean(v), "not the mean"),
    (gm.check_relative_spread, lambda v: statistics.stdev(v) / statistics.median(v), "not the standard deviation"),
    (gm.check_relative_spread, lambda v: max(v) - min(v), "relative to the median"),
    (gm.check_median_ci, _t_interval, r"surround the sample \*mean\*"),
    (gm.check_median_ci, lambda v, level=0.95, seed=0: _bootstrap_ci(v, level, seed, of=np.mean),
     r"surround the sample \*mean\*"),
    (gm.check_median_ci, lambda v, level=0.95, seed=0: (min(v), max(v)), "too wide"),
    (gm.check_median_ci, _global_rng_bootstrap, "seed the"),
    (gm.check_median_ci, _unsorted_ci, "sort the values"),
    (gm.check_noise_verdict, lambda s, aa, level=0.95: _verdict_from(_order_statistic_ci)(s, [1.0], level),
     "not with 1.0"),
    (gm.check_noise_verdict, lambda s, aa, level=0.95: ("faster" if statistics.median(s) > max(aa) else "slower"
                                                        if statistics.median(s) < min(aa)
                                                        else "no measurable difference"), r"\*interval\*"),
    (gm.check_noise_verdict, _verdict_from(_t_interval), "not of the mean"),
]


@pytest.mark.parametrize("grader, wrong, match", WRONG, ids=[f"{g.__name__}: {m}" for g, _, m in WRONG])
def test_graders_reject_classic_mistakes(grader, wrong, match, capsys):
    np.random.seed(0)  # for the mistake that draws from numpy's global generator
    with pytest.raises(AssertionError, match=match):
        grader(wrong)
    assert "  FAIL  " in capsys.readouterr().out


@pytest.mark.parametrize("grader, args", [
    (gd.check_step_flops, 4), (gd.check_step_bytes, 5), (gd.check_roofline_bound, 4), (gd.check_fit_step_cost, 2),
    (gd.check_crossover_batch, 2), (gm.check_interleaved_speedups, 3), (gm.check_relative_spread, 1),
    (gm.check_median_ci, 3), (gm.check_noise_verdict, 3)])
def test_the_stub_says_not_implemented(grader, args):
    def stub(*a):
        raise NotImplementedError("implement it")

    with pytest.raises(AssertionError, match="not implemented yet"):
        grader(stub)


def test_the_fit_grader_compares_with_least_squares_not_with_a_timing():
    """The grader's reference is the least-squares line: on a perfect line it recovers the generating (t0, t1)."""
    b = [1, 2, 4, 8, 16, 32, 64]
    t0, t1 = gd._reference_fit(b, [0.005 + 2e-4 * x for x in b])
    assert math.isclose(t0, 0.005, rel_tol=1e-9) and math.isclose(t1, 2e-4, rel_tol=1e-9)


def test_the_fake_machine_punishes_the_classic_orders():
    """The fake runs give an A/A ratio of exactly 1 only to no order at all: the drift and the cost of going
    first both bias the ratios of a non-interleaved or fixed-order measurement, which is what the grader detects."""
    machine = gm._Machine(1.0, 1.0)
    interleaved = gm.interleaved_speedups(machine.run("A"), machine.run("B"), 6)
    machine = gm._Machine(1.0, 1.0)
    sequential = _seq_speedups(machine.run("A"), machine.run("B"), 6)
    assert statistics.median(sequential) < 0.85 < statistics.median(interleaved)
