"""Graders of exercise 01 (chapter 01, diagnose prefill vs decode), on :mod:`minifer_course.grading.base`.

* :func:`check_step_flops` grades ``fn(cfg, batch, new_tokens, context)``, the FLOPs of one forward step, against
  :func:`minifer_course.roofline.step_cost` (``.flops``);
* :func:`check_step_bytes` grades ``fn(cfg, batch, new_tokens, context, dtype_bytes)``, the bytes of weights and KV
  cache the step moves (``weight_bytes + kv_read_bytes + kv_write_bytes``: activations left out, the chapter's
  ``intensity_weights_kv``);
* :func:`check_roofline_bound` grades ``fn(flops, bytes_moved, peak_flops, bandwidth) -> (seconds, "memory" |
  "compute")``, the roofline's lower bound on the step's time and the ceiling that sets it;
* :func:`check_fit_step_cost` grades ``fn(batches, seconds) -> (t0, t1)``, a least-squares line
  ``t(b) = t0 + b * t1``, on data the grader generates (never on timings, which differ from run to run);
* :func:`check_crossover_batch` grades ``fn(t0, t1)``, the batch where the per-sequence cost catches up with the
  fixed cost of a step.

Each wrong answer is compared with the classic mistakes (half the FLOPs, the LM head forgotten or run on every
prompt token, the wrong dtype, the KV cache left out, ...) so that the hint names the one made.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from minifer.config import ModelConfig
from minifer_course.grading.base import Check, run_checks

__all__ = [
    "check_crossover_batch",
    "check_fit_step_cost",
    "check_roofline_bound",
    "check_step_bytes",
    "check_step_flops",
    "configs",
]

# An odd shape beside the two real ones: grouped-query attention with one KV head, a head_dim that is not
# hidden / heads, biases, an untied embedding and a vocabulary that is not a power of two.
ODD = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1001, "hidden_size": 96, "intermediate_size": 250,
       "num_hidden_layers": 5, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 40,
       "tie_word_embeddings": False, "attention_bias": True}

# (batch, new_tokens, context): decode (one new token per sequence), prefill (context 0), a chunk of a prefill.
SHAPES = [(1, 1, 0), (1, 1, 128), (7, 1, 300), (1, 128, 0), (3, 17, 0), (2, 16, 33)]


def configs() -> dict[str, ModelConfig]:
    """The bundled target's config, Qwen3-0.6B's (shipped, no download) and an odd synthetic shape."""
    from minifer.model_loader import load_config, resolve_model
    from minifer_course.roofline import reference_configs

    return {"tinystories-target": load_config(resolve_model("tinystories-target", need_weights=False)),
            "Qwen/Qwen3-0.6B": reference_configs()["Qwen/Qwen3-0.6B"], "odd shape": ModelConfig.from_dict(ODD)}


def _number(got: Any, what: str) -> float:
    if isinstance(got, bool) or not isinstance(got, (int, float, np.integer, np.floating)):
        raise AssertionError(f"{what}: expected a number, got {type(got).__name__} ({got!r:.80})")
    return float(got)


def _close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def _shape_text(name: str, batch: int, new: int, context: int) -> str:
    kind = "decode" if new == 1 else ("prefill" if context == 0 else "prefill chunk")
    return f"{name}, {kind}: batch={batch}, new_tokens={new}, context={context}"


# --- FLOPs ------------------------------------------------------------------------------------------------


def _flop_parts(cfg: ModelConfig, batch: int, new: int, context: int) -> dict[str, float]:
    """The reference's FLOPs split into its terms (they sum to ``step_cost(...).flops``)."""
    from minifer_course.roofline import layer_matmul_params

    tokens, h, v, layers = batch * new, cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    pairs = new * context + new * (new + 1) / 2
    return {"layers": 2.0 * tokens * layers * layer_matmul_params(cfg), "lm_head": 2.0 * batch * v * h,
            "attention": 4.0 * batch * layers * cfg.num_attention_heads * cfg.head_dim * pairs}


def _flops_hint(got: float, cfg: ModelConfig, batch: int, new: int, context: int) -> str:
    p = _flop_parts(cfg, batch, new, context)
    want = sum(p.values())
    per_pair = 4.0 * batch * cfg.num_hidden_layers * cfg.head_dim
    pairs = new * context + new * (new + 1) / 2
    mistakes = [
        (want / 2, "count 2 FLOPs per multiply-add (one multiply, one add): a [m, k] x [k, n] matmul is 2*m*k*n"),
        (want - p["lm_head"], "you left out the LM head: 2 * vocab_size * hidden_size per sampled row"),
        (want + 2.0 * (batch * new - batch) * cfg.vocab_size * cfg.hidden_size,
         "the LM head runs on one row per sequence (the last token, the one sampled), not on every prompt token"),
        (want - p["attention"], ("you left out attention's own matmuls: QK^T and PV, 2 multiply-adds per (query head, "
                                "key, head_dim element)")),
        (p["layers"] + p["lm_head"] + per_pair * cfg.num_key_value_heads * pairs,
         ("attention's arithmetic is per *query* head: grouped-query attention shares keys and values, not the "
         "multiply-adds")),
        (p["layers"] + p["lm_head"] + per_pair * cfg.num_attention_heads * new * (context + new),
         "attention is causal: query i of the step sees context + i + 1 keys, not all context + new_tokens"),
    ]
    for value, hint in mistakes:
        if _close(got, value, 1e-6):
            return hint
    return (f"expected layers {p['layers']:.6g} (2 * tokens * layers * matmul weights per layer) + LM head "
            f"{p['lm_head']:.6g} + attention {p['attention']:.6g}; mind grouped-query attention (k and v project to "
            f"num_key_value_heads * head_dim)")


def check_step_flops(fn: Callable[[ModelConfig, int, int, int], float]) -> None:
    """Grade ``fn(cfg, batch, new_tokens, context)`` against ``step_cost(...).flops`` on three shapes of model and
    six of step (decode, prefill, a prefill chunk on top of a context)."""
    cfgs = configs()

    def case(name: str, cfg: ModelConfig, shape: tuple[int, int, int]) -> Check:
        def run() -> None:
            want = sum(_flop_parts(cfg, *shape).values())
            got = _number(fn(cfg, *shape), "step_flops")
            if not _close(got, want):
                raise AssertionError(f"step_flops({_shape_text(name, *shape)})\ngot      {got:.6g}\nexpected {want:.6g}"
                                     f"\nhint: {_flops_hint(got, cfg, *shape)}")
        return run

    checks = [(f"{name}: batch {b}, {n} new token(s), context {c}", case(name, cfg, (b, n, c)))
              for name, cfg in cfgs.items() for b, n, c in SHAPES]
    run_checks("step_flops", checks)


# --- bytes --------------------------------------------------------------------------------------------------


def _byte_parts(cfg: ModelConfig, batch: int, new: int, context: int, dtype_bytes: float) -> dict[str, float]:
    """The reference's bytes (weights and KV cache) split into its terms."""
    from minifer_course.roofline import kv_bytes_per_token, weight_bytes

    tokens = batch * new
    kv = kv_bytes_per_token(cfg, dtype_bytes)
    return {"weights": weight_bytes(cfg, dtype_bytes), "embedding_rows": tokens * cfg.hidden_size * dtype_bytes,
            "kv_read": batch * (context + new) * kv, "kv_write": tokens * kv}


def _bytes_hint(got: float, cfg: ModelConfig, batch: int, new: int, context: int, dtype_bytes: float) -> str:
    p = _byte_parts(cfg, batch, new, context, dtype_bytes)
    want = sum(p.values())
    kv = p["kv_read"] + p["kv_write"]
    table = cfg.vocab_size * cfg.hidden_size * dtype_bytes
    mistakes = [(sum(_byte_parts(cfg, batch, new, context, d).values()),
                 f"multiply by dtype_bytes ({dtype_bytes:g} here): 4 bytes per value in float32, 2 in bfloat16, "
                 "1 in int8")
                for d in (1, 2, 4) if d != dtype_bytes]
    mistakes += [
        (want - kv, ("count the KV cache: each sequence reads its keys and values over context + new_tokens positions "
                    "and writes them for its new tokens")),
        (want - p["kv_write"], ("the new tokens' keys and values count twice: written to the cache (kv_write) and "
                               "read back by attention (the read covers context + new_tokens positions)")),
        (want - p["kv_read"] + p["kv_read"] / batch, "each sequence reads its own KV cache: multiply by batch"),
        (want - kv / 2, "a token's cache entry is a key *and* a value, in every layer: 2 * layers * kv_size values"),
        (want + (0 if cfg.tie_word_embeddings else table),
         "a step gathers only its tokens' rows of an untied embedding table (tokens * hidden values), not the table"),
        (want - p["embedding_rows"], "add the embedding rows the step looks up: tokens * hidden_size values"),
        (want + (batch - 1) * p["weights"], "the weights are read once per step, shared by every sequence in it"),
    ]
    for value, hint in mistakes:
        if _close(got, value, 1e-6):
            return hint
    return (f"expected weights {p['weights']:.6g} + embedding rows {p['embedding_rows']:.6g} + KV read "
            f"{p['kv_read']:.6g} + KV write {p['kv_write']:.6g} bytes")


def check_step_bytes(fn: Callable[[ModelConfig, int, int, int, float], float]) -> None:
    """Grade ``fn(cfg, batch, new_tokens, context, dtype_bytes)`` against the weights and KV-cache bytes of
    ``step_cost`` (activations left out), in float32, bfloat16 and int8."""
    cfgs = configs()

    def case(name: str, cfg: ModelConfig, shape: tuple[int, int, int], dtype_bytes: float) -> Check:
        def run() -> None:
            want = sum(_byte_parts(cfg, *shape, dtype_bytes).values())
            got = _number(fn(cfg, *shape, dtype_bytes), "step_bytes")
            if not _close(got, want):
                raise AssertionError(f"step_bytes({_shape_text(name, *shape)}, dtype_bytes={dtype_bytes:g})"
                                     f"\ngot      {got:.6g}\nexpected {want:.6g}"
                                     f"\nhint: {_bytes_hint(got, cfg, *shape, dtype_bytes)}")
        return run

    checks = []
    for i, (name, cfg) in enumerate(cfgs.items()):
        for j, (b, n, c) in enumerate(SHAPES):
            d = (4, 2, 1)[(i + j) % 3]
            checks.append((f"{name}: batch {b}, {n} new token(s), context {c}, {d} byte(s) per value",
                           case(name, cfg, (b, n, c), d)))
    run_checks("step_bytes", checks)


# --- the roofline -------------------------------------------------------------------------------------------


def check_roofline_bound(fn: Callable[[float, float, float, float], tuple[float, str]]) -> None:
    """Grade ``fn(flops, bytes_moved, peak_flops, bandwidth) -> (seconds, bound)``: the larger of the two times and
    ``"memory"`` or ``"compute"`` for the one that sets it."""

    def case(flops: float, moved: float, peak: float, bw: float) -> Check:
        def run() -> None:
            want_s, want_b = max(flops / peak, moved / bw), ("compute" if flops / peak > moved / bw else "memory")
            got = fn(flops, moved, peak, bw)
            if not (isinstance(got, tuple) and len(got) == 2):
                raise AssertionError(f"expected a tuple (seconds, 'memory' or 'compute'), got {got!r:.120}")
            seconds, bound = _number(got[0], "seconds"), got[1]
            where = f"flops={flops:.4g}, bytes={moved:.4g}, peak={peak:.4g} FLOP/s, bandwidth={bw:.4g} B/s"
            if bound != want_b:
                raise AssertionError(f"{where}: bound {bound!r}, expected {want_b!r}\nhint: intensity "
                                     f"{flops / moved:.3g} FLOP/byte against the ridge {peak / bw:.3g}: below it the "
                                     f"bytes take longer (memory-bound), above it the arithmetic")
            if not _close(seconds, want_s):
                hint = ("the step takes at least as long as the *slower* of the two: max, not min"
                        if _close(seconds, min(flops / peak, moved / bw)) else
                        "the two can overlap, so the bound is max(flops / peak, bytes / bandwidth), not their sum"
                        if _close(seconds, flops / peak + moved / bw) else "max(flops / peak, bytes / bandwidth)")
                raise AssertionError(f"{where}: {seconds:.6g} s, expected {want_s:.6g} s\nhint: {hint}")
        return run

    run_checks("roofline_bound", [
        ("decode on a GPU: memory-bound", case(2.4e9, 2.4e9, 790e12, 4.3e12)),
        ("a long prefill on a GPU: compute-bound", case(1.2e15, 2.5e9, 790e12, 4.3e12)),
        ("a CPU: low ridge, prefill compute-bound", case(2.3e9, 3.8e7, 1.0e11, 2.0e10)),
        ("a CPU: batch-1 decode memory-bound", case(1.9e7, 3.7e7, 1.0e11, 2.0e10)),
    ])


# --- the step-cost model --------------------------------------------------------------------------------------


def _reference_fit(batches: list[float], seconds: list[float]) -> tuple[float, float]:
    t1, t0 = np.polyfit(np.asarray(batches, float), np.asarray(seconds, float), 1)
    return float(t0), float(t1)


def _fit_hint(got: tuple[float, float], b: np.ndarray, t: np.ndarray) -> str:
    t0, t1 = _reference_fit(list(b), list(t))
    slope_origin = float((b @ t) / (b @ b))
    per_token = _reference_fit(list(b), list(t / b))
    ends = ((t[-1] - t[0]) / (b[-1] - b[0]))
    log_fit = np.polyfit(np.log(b), np.log(t), 1)
    mistakes = [((t1, t0), "return (t0, t1): the fixed cost first, then the cost per sequence"),
                ((0.0, slope_origin), ("fit an intercept: t0, the cost of a step whatever its batch, is what the "
                                      "chapter is about (a line through the origin hides it)")),
                (per_token, "fit the step's seconds, not seconds per token (t / b)"),
                ((t[0] - ends * b[0], ends), "least squares uses every point, not only the first and the last"),
                ((float(log_fit[1]), float(log_fit[0])), "fit t against b on linear axes, not log(t) against log(b)")]
    for value, hint in mistakes:
        if all(_close(float(g), float(w), 1e-6) for g, w in zip(got, value)):
            return hint
    return "minimise the sum of squared residuals of t0 + b * t1 (np.polyfit(b, t, 1) returns [t1, t0])"


def check_fit_step_cost(fn: Callable[[list[int], list[float]], tuple[float, float]]) -> None:
    """Grade ``fn(batches, seconds) -> (t0, t1)`` against ``np.polyfit(batches, seconds, 1)`` on generated data: a
    perfect line, noisy seeded lines, unsorted batches with repeats; a ValueError for fewer than two batch sizes."""
    rng = np.random.default_rng(0)

    def case(b: list[int], t: list[float], what: str) -> Check:
        def run() -> None:
            got = fn(list(b), list(t))
            if not (isinstance(got, tuple) and len(got) == 2):
                raise AssertionError(f"{what}: expected a tuple (t0, t1), got {got!r:.120}")
            got = (_number(got[0], "t0"), _number(got[1], "t1"))
            want = _reference_fit(b, t)
            if not all(_close(g, w, 1e-7) or abs(g - w) < 1e-12 for g, w in zip(got, want)):
                hint = _fit_hint(got, np.asarray(b, float), np.asarray(t, float))
                raise AssertionError(f"{what}: (t0, t1) = ({got[0]:.6g}, {got[1]:.6g}), expected ({want[0]:.6g}, "
                                     f"{want[1]:.6g})\nhint: {hint}")
        return run

    def one_batch_size() -> None:
        try:
            got = fn([4, 4, 4], [0.011, 0.012, 0.010])
        except ValueError:
            return
        raise AssertionError(f"three timings all at batch 4 returned {got!r:.80}: a line through one batch size has "
                             "no slope\nhint: raise ValueError when there are fewer than two distinct batch sizes")

    line = [1, 2, 4, 8, 16, 32, 64]
    noisy = [[0.011 + 3e-4 * b + rng.normal(0, 4e-4) for b in line] for _ in range(20)]
    repeats = [5, 1, 3, 12, 1, 5, 3, 12]
    cases = [("a perfect line", case(line, [0.005 + 2e-4 * b for b in line], "a perfect line"))]
    cases += [("20 noisy lines (seeded)", lambda: [case(line, t, f"noisy line {i}")() for i, t in enumerate(noisy)])]
    cases += [("unsorted batches, repeated", case(repeats, [0.02 + 1e-3 * b + (0.002 if b == 12 else 0.0)
                                                            for b in repeats], "unsorted batches, repeated"))]
    cases += [("flat: a step that does not grow with the batch", case(line, [0.013 - 1e-6 * (b % 3) for b in line],
                                                                       "flat"))]
    cases += [("one batch size only: ValueError", one_batch_size)]
    run_checks("fit_step_cost", cases)


def check_crossover_batch(fn: Callable[[float, float], float]) -> None:
    """Grade ``fn(t0, t1)``: the batch ``t0 / t1`` where a step's per-sequence cost equals its fixed cost, infinite
    when the step does not grow with the batch (``t1 <= 0``: within the measured range, the fixed cost is all)."""

    def case(t0: float, t1: float) -> Check:
        def run() -> None:
            want = t0 / t1 if t1 > 0 else math.inf
            got = _number(fn(t0, t1), f"crossover_batch({t0:g}, {t1:g})")
            if math.isinf(want) or math.isinf(got):
                if got != want:
                    raise AssertionError(f"crossover_batch(t0={t0:g}, t1={t1:g}) = {got!r}, expected {want!r}\nhint: "
                                         "with t1 <= 0 the step never grows with the batch: return math.inf")
                return
            if not _close(got, want):
                hint = ("upside down: the crossover is where b * t1 = t0, b = t0 / t1"
                        if _close(got, t1 / t0) else "b * t1 = t0 at b = t0 / t1 (a float, not rounded)")
                raise AssertionError(f"crossover_batch(t0={t0:g}, t1={t1:g}) = {got!r}, expected {want:.6g}"
                                     f"\nhint: {hint}")
        return run

    run_checks("crossover_batch", [
        ("an overhead-bound step: large fixed cost", case(0.012, 1.5e-4)),
        ("a fractional crossover is not rounded", case(0.01, 3e-3)),
        ("a step that does not grow with the batch: inf", case(0.013, 0.0)),
        ("a negative slope from noise: inf", case(0.013, -2e-6)),
    ])
