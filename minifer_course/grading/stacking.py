"""Graders for the chapter-06 exercises (measure before stacking), on the machinery of
:mod:`minifer_course.grading.base`.

* :func:`check_kv_blocks` grades ``fn(memory, weight_bytes, block_bytes)``, the number of KV blocks one memory
  budget leaves after the weights, against :func:`minifer_course.stacking.split_budget`;
* :func:`check_lever_analysis` grades ``fn(gain)``, the reading of a lever factorial (alone, product, stacked,
  overlap, added last), against :func:`minifer_course.stacking.lever_analysis`, with hints that name the classic
  mistakes (the wrong baseline for "alone", "added last" read as "added first", the overlap upside down).

Both take well under a second; ``tests/course/test_exercises_stacking.py`` checks that minifer's own implementations pass
and the classic mistakes fail.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from minifer_course.grading.base import Check, run_checks

__all__ = ["check_kv_blocks", "check_lever_analysis"]

KEYS = ("alone", "product", "stacked", "overlap", "in_stack")


# --- one memory budget ---------------------------------------------------------------------------------


def _reference_blocks(memory: int, weight_bytes: int, block_bytes: int) -> int:
    from minifer_course.stacking import split_budget

    return split_budget(memory, weight_bytes, block_bytes, 16).kv_blocks


def check_kv_blocks(fn: Callable[[int, int, int], int]) -> None:
    """Grade ``fn(memory, weight_bytes, block_bytes) -> blocks``: whole blocks of what the weights leave, and a
    ``ValueError`` when not one block fits."""

    def case(memory: int, weights: int, block: int, hint: str) -> Check:
        def run() -> None:
            want = _reference_blocks(memory, weights, block)
            try:
                got = fn(memory, weights, block)
            except ValueError as exc:
                raise AssertionError(
                    f"kv_blocks(memory={memory:,}, weight_bytes={weights:,}, block_bytes={block:,}) raised "
                    f"ValueError ({exc}), expected {want}\nhint: the weights leave {memory - weights:,} bytes, room "
                    f"for {want} block(s) of {block:,}: raise ValueError only when not even one block fits "
                    f"(memory - weight_bytes < block_bytes)") from None
            if isinstance(got, bool) or not isinstance(got, int):
                raise AssertionError(f"kv_blocks({memory}, {weights}, {block}) returned {got!r} "
                                     f"({type(got).__name__}); a number of blocks is an int")
            if got != want:
                if got == -(-(memory - weights) // block):
                    hint = "round down: a partial block is not a block"
                elif got == memory // block:
                    hint = "the weights come first: the cache gets memory - weight_bytes"
                raise AssertionError(f"kv_blocks(memory={memory:,}, weight_bytes={weights:,}, block_bytes={block:,})"
                                     f"\ngot      {got}\nexpected {want}\nhint: {hint}")
        return run

    def too_small(memory: int, weights: int, block: int) -> Check:
        def run() -> None:
            try:
                got = fn(memory, weights, block)
            except ValueError:
                return
            raise AssertionError(f"kv_blocks(memory={memory:,}, weight_bytes={weights:,}, block_bytes={block:,}) "
                                 f"returned {got!r}: the weights leave {memory - weights:,} bytes, not one block of "
                                 f"{block:,}.\nhint: raise ValueError (an engine with no cache cannot serve anything)")
        return run

    subtract = "the cache gets what the weights leave: (memory - weight_bytes) // block_bytes"
    rng = random.Random(0)
    randoms = [(rng.randrange(10**6, 10**9), rng.randrange(10**5, 10**6), rng.randrange(1, 10**5)) for _ in range(200)]

    def random_budgets() -> None:
        for m, w, b in randoms:
            case(m, w, b, subtract)()

    checks: list[Check] = [
        ("weights take part of the memory", case(1000, 300, 64, subtract)),
        ("the leftover is an exact number of blocks", case(1000, 360, 64, subtract)),
        ("a partial block is not a block", case(1000, 361, 64, "round down: a block is all or nothing")),
        ("exactly one block left: 1, not a ValueError", case(1000, 936, 64, subtract)),
        ("no weights at all", case(4096, 0, 1024, subtract)),
        ("200 random budgets", random_budgets),
        ("less than one block left: ValueError", too_small(1000, 990, 64)),
        ("weights larger than the memory: ValueError", too_small(1000, 1200, 64)),
    ]
    run_checks("kv_blocks", checks)


# --- reading a factorial -------------------------------------------------------------------------------


def _factorial(rng: random.Random, noise: float) -> dict[frozenset[str], float]:
    """Gains over static batching of every configuration: each lever a random factor, every configuration with
    two or more levers beside batching bent by a random interaction (as real measurements are)."""
    from minifer_course.stacking import LEVERS, configurations

    factor = {x: rng.uniform(0.6, 3.0) for x in LEVERS}
    out = {}
    for c in configurations():
        g = math.prod(factor[x] for x in c)
        if len(c) > 2:
            g *= math.exp(rng.uniform(-noise, noise))
        out[c] = g
    return out


def _close(a: Any, b: float) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _diagnose(key: str, lever: str | None, got: Any, gain: dict[frozenset[str], float]) -> str:
    from minifer_course.stacking import LEVERS

    static, cb, full = frozenset(), frozenset({"continuous"}), frozenset(LEVERS)
    raw = ("divide by static batching's value, gain[frozenset()]: it is 1 only when the gains are already over "
           "static batching, and the check also passes raw throughputs (tokens/s)")
    if (key == "alone" and lever == "continuous" and _close(got, gain[cb])) or (key == "stacked"
                                                                               and _close(got, gain[full])):
        return raw
    if key == "alone" and lever not in (None, "continuous"):
        if _close(got, gain[cb | {lever}] / gain[static]):
            return ("that is its gain over static batching, which includes continuous batching's own: a lever's "
                    "alone gain is over plain continuous batching, gain[{'continuous', lever}] / gain[{'continuous'}]")
        if _close(got, gain[cb | {lever}]):
            return "gains are over static batching: divide by the baseline's gain, gain[{'continuous'}]"
    if key == "in_stack" and lever not in (None, "continuous"):
        if _close(got, gain[cb | {lever}] / gain[cb]):
            return ("that is its alone gain: added last means on top of all the others, "
                    "gain[all four] / gain[all four without it]")
        if _close(got, gain[full - {lever}] / gain[full]):
            return "upside down: with it over without it"
    if key == "in_stack" and lever == "continuous":
        return "static batching hosts no other lever, so continuous batching's 'added last' is its alone gain"
    if key == "overlap":
        want = math.prod(gain[cb | {x}] / gain[cb] for x in LEVERS[1:]) * gain[cb] / gain[full]
        if _close(got, 1 / want):
            return "upside down: overlap = product / stacked (above 1 when the product overshoots)"
        return "overlap = product / stacked: how far multiplying the alone gains overshoots what was measured"
    if key == "product":
        return "multiply the four alone gains (continuous batching's included)"
    if key == "stacked":
        return "all four levers together, over static batching: gain[all four] / gain[static]"
    return "see the definitions above the function"


def _missing_key_hint(key: Any, gain: dict[frozenset[str], float]) -> str | None:
    """The hint for looking up ``gain[key]`` with ``key`` not a configuration (``None``: not that mistake)."""
    from minifer_course.stacking import LEVERS, configurations

    if not isinstance(key, frozenset) or key in configurations():
        return None
    if key == frozenset(LEVERS) - {"continuous"}:  # in_stack computed for continuous batching like the others
        return _diagnose("in_stack", "continuous", None, gain)
    if "continuous" not in key:
        return ("the other levers run only on continuous batching (static batching cannot host them), so every "
                "configuration but static batching includes 'continuous': a lever's alone gain is "
                "gain[cb | {x}] / gain[cb]")
    return "gain holds the configurations of configurations() only"


def check_lever_analysis(fn: Callable[[dict[frozenset[str], float]], dict[str, Any]]) -> None:
    """Grade ``fn(gain) -> {"alone", "product", "stacked", "overlap", "in_stack"}`` against
    :func:`minifer_course.stacking.lever_analysis` (other keys in the answer are ignored)."""
    from minifer_course.stacking import LEVERS, configurations, label, lever_analysis

    def compare(gain: dict[frozenset[str], float], what: str) -> None:
        given = dict(gain)
        try:
            got = fn(gain)
        except KeyError as exc:
            hint = _missing_key_hint(exc.args[0] if exc.args else None, given)
            if hint is None:
                raise
            shown = "{" + ", ".join(repr(x) for x in sorted(exc.args[0])) + "}"
            raise AssertionError(f"{what}: your function raised KeyError: gain has no configuration {shown}"
                                 f"\nhint: {hint}") from None
        if gain != given:
            raise AssertionError("your function changed the gain dict it was given; read it, build a new result")
        if not isinstance(got, dict):
            raise AssertionError(f"{what}: expected a dict with keys {', '.join(KEYS)}, got {type(got).__name__}")
        want = lever_analysis(given)
        for key in KEYS:
            if key not in got:
                raise AssertionError(f"{what}: the result has no {key!r} (keys: {sorted(got)})")
            if key in ("alone", "in_stack"):
                if not isinstance(got[key], dict) or set(got[key]) != set(LEVERS):
                    raise AssertionError(f"{what}: {key!r} must map each of {', '.join(LEVERS)} to a gain, "
                                         f"got {got[key]!r:.200}")
                for x in LEVERS:
                    if not _close(got[key][x], want[key][x]):
                        raise AssertionError(f"{what}: {key}[{x!r}] = {got[key][x]!r}, expected {want[key][x]:.6g}"
                                             f"\nhint: {_diagnose(key, x, got[key][x], given)}")
            elif not _close(got[key], want[key]):
                raise AssertionError(f"{what}: {key} = {got[key]!r}, expected {want[key]:.6g}"
                                     f"\nhint: {_diagnose(key, None, got[key], given)}")

    def independent() -> None:
        factor = {"continuous": 3.0, "speculative": 1.5, "int8_weights": 1.2, "int8_kv": 1.1}
        compare({c: math.prod(factor[x] for x in c) for c in configurations()}, "independent levers")

    def overlapping() -> None:
        factor = {"continuous": 3.0, "speculative": 1.5, "int8_weights": 1.2, "int8_kv": 1.1}
        gain = {c: math.prod(factor[x] for x in c) for c in configurations()}
        gain[frozenset(LEVERS)] /= 2
        compare(gain, "the full stack at half the product")

    def throughputs() -> None:  # tokens/s, not gains: static batching's is not 1
        compare({c: 287.0 * g for c, g in _factorial(random.Random(1), 0.3).items()}, "raw throughputs (tokens/s)")

    rng = random.Random(0)
    randoms = [_factorial(rng, 0.5) for _ in range(100)]

    def random_factorials() -> None:
        for i, g in enumerate(randoms):
            compare(g, f"random factorial {i}")

    def missing() -> None:
        gain = dict(randoms[0])
        gone = frozenset({"continuous", "int8_kv"})
        del gain[gone]
        try:
            fn(gain)
        except ValueError as e:
            if label(gone) not in str(e) and "int8_kv" not in str(e):
                raise AssertionError(f"the ValueError should name the missing configuration ({label(gone)}), "
                                     f"got: {e}") from None
            return
        except KeyError:
            raise AssertionError("a missing configuration raised KeyError; check first and raise a ValueError "
                                 f"that names it ({label(gone)})") from None
        raise AssertionError(f"configuration {label(gone)} is missing, yet no error: a factorial with a hole "
                             "cannot be read; raise ValueError naming it")

    checks: list[Check] = [
        ("independent levers: product = stacked, overlap 1", independent),
        ("overlapping levers: the stack below the product", overlapping),
        ("100 random factorials with interactions", random_factorials),
        ("raw throughputs instead of gains (static is not 1)", throughputs),
        ("a missing configuration: ValueError naming it", missing),
    ]
    run_checks("lever_analysis", checks)
