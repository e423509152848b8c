"""Graders of exercise 06's measurement section (an A/A control, the spread of repeated runs, the median's
interval, a verdict against the noise), on :mod:`minifer_course.grading.base`, and the references they compare with.

* :func:`check_interleaved_speedups` grades ``fn(run_a, run_b, rounds)``: B's speedup over A in each round, the two
  runs interleaved and taking turns to go first, against :func:`interleaved_speedups`, on fake runs whose "seconds"
  drift with time and penalise whoever goes first (what a shared machine's clocks and caches do), so that running
  all of A before all of B, or A always first, gives other numbers;
* :func:`check_relative_spread` grades ``fn(values)``, the range of repeated runs over their median;
* :func:`check_median_ci` grades ``fn(values, level, seed)``, a confidence interval of the median, by its coverage of
  the true median over 200 seeded samples of skewed timings (one-sided spikes, as a neighbour adds to a run): an
  order-statistic interval (:func:`minifer.bench.speculative.median_ci`) and a seeded bootstrap both pass; an
  interval of the mean, the range and an unseeded bootstrap do not;
* :func:`check_noise_verdict` grades ``fn(speedups, aa_speedups, level)``: "faster", "slower" or "no measurable
  difference", the lever's median interval against the A/A control's band, against :func:`noise_verdict`.

The data are generated from fixed seeds, never timed, so every report is the same on every machine.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from minifer_course.grading.base import Check, run_checks

__all__ = [
    "VERDICTS",
    "check_interleaved_speedups",
    "check_median_ci",
    "check_noise_verdict",
    "check_relative_spread",
    "interleaved_speedups",
    "noise_verdict",
    "relative_spread",
]

VERDICTS = ("faster", "slower", "no measurable difference")


# --- the references -----------------------------------------------------------------------------------------


def interleaved_speedups(run_a: Callable[[], float], run_b: Callable[[], float], rounds: int) -> list[float]:
    """B's speedup over A (``seconds_a / seconds_b``) in each of ``rounds`` rounds. Each round runs both, A first in
    even rounds and B first in odd ones: interleaving puts both runs of a round in the same moment of a drifting
    machine, and taking turns keeps whatever going first costs (cold caches, a clock ramping up) off one side."""
    out = []
    for r in range(rounds):
        order = (run_a, run_b) if r % 2 == 0 else (run_b, run_a)
        seconds = {fn: fn() for fn in order}  # dicts keep insertion order: the calls happen in `order`
        out.append(seconds[run_a] / seconds[run_b])
    return out


def relative_spread(values: Sequence[float]) -> float:
    """The range of repeated measurements over their median: how far apart runs of the same thing land."""
    return (max(values) - min(values)) / statistics.median(values)


def noise_verdict(speedups: Sequence[float], aa_speedups: Sequence[float], level: float = 0.95) -> str:
    """``"faster"`` when the confidence interval of the median speedup lies above every A/A ratio, ``"slower"`` when
    below every one, else ``"no measurable difference"``: the A/A control measured the same thing twice, so its
    spread is what the machine alone does to a ratio."""
    from minifer.bench.speculative import median_ci

    low, high, _ = median_ci(list(speedups), level)
    if low > max(aa_speedups):
        return "faster"
    if high < min(aa_speedups):
        return "slower"
    return "no measurable difference"


# --- interleaving -----------------------------------------------------------------------------------------------


class _Machine:
    """Two fake runs on one drifting clock: call ``k`` (counting both runs) takes ``base * (1 + drift * k)`` seconds,
    1.25x more when it opens a round (the first of each pair of calls). ``log`` records who ran."""

    def __init__(self, base_a: float, base_b: float, drift: float = 0.04) -> None:
        self.base, self.drift, self.log = {"A": base_a, "B": base_b}, drift, []

    def run(self, who: str) -> Callable[[], float]:
        def call() -> float:
            k = len(self.log)
            self.log.append(who)
            return self.base[who] * (1 + self.drift * k) * (1.25 if k % 2 == 0 else 1.0)
        return call


def _interleave_hint(log: list[str], rounds: int) -> str | None:
    if log.count("A") != rounds or log.count("B") != rounds:
        return (f"each run once per round: {rounds} rounds called A {log.count('A')} and B {log.count('B')} times "
                f"(order of calls: {''.join(log)[:40]})")
    pairs = [log[i:i + 2] for i in range(0, len(log), 2)]
    if any(sorted(p) != ["A", "B"] for p in pairs):
        return (f"interleave: run A and B in the same round, one after the other (order of calls: "
                f"{''.join(log)[:40]}); all of A and then all of B puts them in different moments of a drifting "
                "machine")
    if len({p[0] for p in pairs}) == 1 and rounds > 1:
        return (f"take turns going first (A first in even rounds, B first in odd ones): {pairs[0][0]} opened every "
                f"round, so whatever going first costs always lands on it")
    if [p[0] for p in pairs] != ["A" if r % 2 == 0 else "B" for r in range(rounds)]:
        return "A opens the even rounds (0, 2, ...), B the odd ones"
    return None


def check_interleaved_speedups(fn: Callable[[Callable[[], float], Callable[[], float], int], list[float]]) -> None:
    """Grade ``fn(run_a, run_b, rounds) -> [seconds_a / seconds_b per round]`` on fake runs of a drifting machine."""

    def case(base_a: float, base_b: float, rounds: int) -> Check:
        def run() -> None:
            mine, ref = _Machine(base_a, base_b), _Machine(base_a, base_b)
            got = fn(mine.run("A"), mine.run("B"), rounds)
            want = interleaved_speedups(ref.run("A"), ref.run("B"), rounds)
            hint = _interleave_hint(mine.log, rounds)
            if hint:
                raise AssertionError(f"{rounds} rounds, A {base_a:g} s and B {base_b:g} s\nhint: {hint}")
            if not isinstance(got, (list, tuple)) or len(got) != rounds:
                raise AssertionError(f"expected a list of {rounds} speedups, one per round, got {got!r:.120}")
            for r, (g, w) in enumerate(zip(got, want)):
                if not math.isclose(float(g), w, rel_tol=1e-12):
                    upside = math.isclose(float(g), 1 / w, rel_tol=1e-12)
                    raise AssertionError(
                        f"round {r}: speedup {float(g):.6g}, expected {w:.6g}\nhint: "
                        + ("upside down: B's speedup over A is seconds_a / seconds_b (above 1 when B is faster)"
                           if upside else "one ratio per round, of the two runs of that round"))
        return run

    run_checks("interleaved_speedups", [
        ("the same run twice (A/A), 6 rounds", case(0.5, 0.5, 6)),
        ("B twice as fast, 6 rounds", case(0.8, 0.4, 6)),
        ("an odd number of rounds", case(0.3, 0.36, 7)),
        ("one round", case(0.3, 0.2, 1)),
    ])


# --- the spread of repeated runs ----------------------------------------------------------------------------------


def check_relative_spread(fn: Callable[[Sequence[float]], float]) -> None:
    """Grade ``fn(values) -> (max - min) / median``."""

    def case(values: list[float]) -> Check:
        def run() -> None:
            want = relative_spread(values)
            got = fn(list(values))
            if isinstance(got, bool) or not isinstance(got, (int, float, np.floating)):
                raise AssertionError(f"expected a number, got {got!r:.80}")
            if math.isclose(float(got), want, rel_tol=1e-9):
                return
            span = max(values) - min(values)
            mistakes = [(span / statistics.fmean(values), ("divide by the median, not the mean: one slow run (a "
                                                           "neighbour's burst) drags the mean, not the median")),
                        (span, "relative to the median: divide the range by it, so runs of 2 s and of 2 ms compare"),
                        (statistics.stdev(values) / statistics.median(values),
                         "the range (max - min), not the standard deviation"),
                        (span / min(values), "divide by the median, not the fastest run")]
            hint = next((h for v, h in mistakes if math.isclose(float(got), v, rel_tol=1e-9)),
                        "(max(values) - min(values)) / median(values)")
            raise AssertionError(f"relative_spread({values}) = {float(got):.6g}, expected {want:.6g}\nhint: {hint}")
        return run

    run_checks("relative_spread", [
        ("five runs, one slow", case([1.02, 0.98, 1.00, 1.01, 1.60])),
        ("an even number of runs", case([0.21, 0.20, 0.26, 0.22])),
        ("unsorted, skewed", case([3.1, 2.9, 4.8, 3.0, 3.3, 2.95, 3.05])),
        ("identical runs: 0", case([0.5, 0.5, 0.5])),
    ])


# --- the median's interval ----------------------------------------------------------------------------------------


def skewed_timings(rng: np.random.Generator, n: int) -> np.ndarray:
    """Timings of one thing on a shared machine: about 1 s with 5% jitter, plus, in 30% of runs, a spike of 0.3-1.5 s
    (a neighbour only ever adds time). Skewed: the mean sits far above the median."""
    return rng.lognormal(0.0, 0.05, n) + (rng.random(n) < 0.3) * rng.uniform(0.3, 1.5, n)


def _interval(fn: Callable[..., Any], values: np.ndarray, level: float, seed: int) -> tuple[float, float]:
    got = fn(list(map(float, values)), level, seed)
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise AssertionError(f"expected a tuple (low, high), got {got!r:.120}")
    low, high = float(got[0]), float(got[1])
    if not low <= high:
        raise AssertionError(f"low {low:.6g} is above high {high:.6g}\nhint: sort the values first (order statistics "
                             "are the sorted values)")
    return low, high


def check_median_ci(fn: Callable[[Sequence[float], float, int], tuple[float, float]]) -> None:
    """Grade ``fn(values, level, seed) -> (low, high)`` by its coverage of the true median of skewed timings."""
    from minifer.bench.speculative import median_ci

    rng = np.random.default_rng(0)
    samples = [skewed_timings(rng, 25) for _ in range(200)]
    true_median = float(np.median(skewed_timings(np.random.default_rng(123), 2_000_000)))

    def contains_the_median() -> None:
        values = samples[0]
        low, high = _interval(fn, values, 0.95, 0)
        med = float(np.median(values))
        if not low <= med <= high:
            raise AssertionError(f"({low:.4g}, {high:.4g}) does not contain the sample's median {med:.4g}\nhint: an "
                                 "interval of the median is built around it, from the values *sorted* (order "
                                 "statistics) or from the medians of resamples")

    def repeatable() -> None:
        for values in samples[:20]:  # several: an unseeded bootstrap of many resamples often repeats on one
            first, again = _interval(fn, values, 0.95, 7), _interval(fn, values, 0.95, 7)
            if first == again:
                continue
            raise AssertionError(f"two calls with the same values and seed gave {first} and {again}\nhint: seed "
                                 "the bootstrap: rng = np.random.default_rng(seed), and draw every resample from rng")

    def coverage(level: float) -> Check:
        def run() -> None:
            intervals = [_interval(fn, v, level, 0) for v in samples]
            cov = sum(lo <= true_median <= hi for lo, hi in intervals) / len(intervals)
            low_ok, high_ok = level - 0.08, level + 0.9 * (1 - level)
            if low_ok <= cov <= high_ok:
                return
            ref = [median_ci(list(v), level)[:2] for v in samples]
            width = statistics.median(hi - lo for lo, hi in intervals)
            ref_width = statistics.median(hi - lo for lo, hi in ref)
            means = [float(np.mean(v)) for v in samples]
            if cov < low_ok and sum(lo <= m <= hi for (lo, hi), m in zip(intervals, means)) > 0.8 * len(samples):
                hint = ("your intervals surround the sample *mean*: these timings are skewed (one-sided spikes), the "
                        "mean sits far above the median, and the chapter's numbers are medians")
            elif cov < low_ok:
                hint = "too narrow or off-centre: take the interval from the median's sampling distribution"
            else:
                hint = (f"too wide (median width {width:.3g} s, a 95%-coverage order-statistic interval's is "
                        f"{ref_width:.3g} s): the range of the sample covers the median with probability 1 - 2/2^n")
            raise AssertionError(f"level {level}: your intervals contain the true median ({true_median:.4f} s) in "
                                 f"{cov:.1%} of 200 samples of 25 skewed timings; a {level:.0%} interval should in "
                                 f"{low_ok:.0%}-{high_ok:.1%}\nhint: {hint}")
        return run

    run_checks("median_ci", [
        ("contains the sample's median", contains_the_median),
        ("the same values and seed: the same interval", repeatable),
        ("coverage of the true median, level 0.95", coverage(0.95)),
        ("coverage of the true median, level 0.8", coverage(0.8)),
    ])


# --- the verdict --------------------------------------------------------------------------------------------------


def check_noise_verdict(fn: Callable[[Sequence[float], Sequence[float], float], str]) -> None:
    """Grade ``fn(speedups, aa_speedups, level)`` against :func:`noise_verdict` on cases that any interval of the
    median (order statistics or a seeded bootstrap) decides alike."""
    aa = [0.97, 1.02, 0.99, 1.05, 1.01, 0.98, 1.03]

    def case(speedups: list[float], band: list[float], hint: str) -> Check:
        def run() -> None:
            want = noise_verdict(speedups, band)
            got = fn(list(speedups), list(band), 0.95)
            if got not in VERDICTS:
                raise AssertionError(f"expected one of {VERDICTS}, got {got!r:.80}")
            if got != want:
                raise AssertionError(f"speedups {speedups}, A/A {band}: {got!r}, expected {want!r}\nhint: {hint}")
        return run

    wide = [0.96, 1.0, 1.3, 1.35, 1.4, 1.45, 1.5]
    run_checks("noise_verdict", [
        ("clearly faster", case([1.31, 1.28, 1.35, 1.30, 1.33, 1.29, 1.32, 1.34, 1.30], aa,
                                "the whole interval of the median lies above the A/A band: 'faster'")),
        ("clearly slower", case([0.81, 0.84, 0.80, 0.83, 0.82, 0.79, 0.85, 0.81, 0.80], aa,
                                "the whole interval lies below the A/A band: 'slower' (speedups below 1)")),
        ("above 1 but inside the A/A band", case([1.03, 1.04, 1.02, 1.04, 1.03, 1.05, 1.03, 1.04, 1.02], aa,
                                                 "compare with the A/A band, not with 1.0: two runs of the same "
                                                 "thing already differ by this much here")),
        ("one spike among the rounds", case([1.30, 1.28, 1.33, 4.0, 1.31, 1.29, 1.32, 1.30, 1.34], aa,
                                            "the interval of the median, not of the mean: one spike is not a "
                                            "reason to doubt eight rounds")),
        ("the median above the band, its interval not", case(wide, aa, "compare the median's *interval* with the "
                                                                       "band, not the median alone: with 7 wide "
                                                                       "rounds the interval reaches into the noise")),
    ])
