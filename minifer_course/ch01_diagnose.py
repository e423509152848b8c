"""Chapter 01's plots: time per token, the roofline, matrix-vector bandwidth, decode's arithmetic intensity."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily at run time: matplotlib and ipywidgets are course extras
    from matplotlib.figure import Figure

    from minifer_course.roofline import Ceilings, Hardware, StepTiming


# --- roofline plots (chapter 01) ---------------------------------------------------------------------


def _fmt_si(x: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def plot_time_per_token(prefill: Sequence["StepTiming"], decode_by_batch: Mapping[int, Sequence["StepTiming"]],
                        decode_by_context: Sequence["StepTiming"] = ()) -> "Figure":
    """Left: time per token against the number of tokens that share one step: prompt length for prefill
    (batch 1), batch size for decode. Both phases get cheaper per token when more tokens share one read of
    the weights; decode starts far higher. Right: a batch-1 decode step against the context it attends to."""
    import matplotlib.pyplot as plt

    ncols = 2 if decode_by_context else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 3.8))
    axes = list(axes) if ncols > 1 else [axes]
    ax = axes[0]
    ax.plot([t.tokens for t in prefill], [t.seconds_per_token * 1e6 for t in prefill], "o-", label="prefill (batch 1)")
    for ctx, ts in decode_by_batch.items():
        ax.plot([t.batch for t in ts], [t.seconds_per_token * 1e6 for t in ts], "s--",
                label=f"decode (context {ctx})")
    ax.set(xscale="log", yscale="log", xlabel="tokens per step (prompt length, or decode batch)",
           ylabel="µs per token", title="time per token")
    ax.legend(fontsize=8)
    if decode_by_context:
        ax = axes[1]
        ctxs = [t.cost.context for t in decode_by_context]
        ax.plot(ctxs, [t.seconds * 1e3 for t in decode_by_context], "s-", color="tab:red")
        ax.set(xlabel="context (tokens in the KV cache)", ylabel="ms per decode step",
               title="batch-1 decode step vs context")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    return fig


def plot_roofline(ceilings: "Ceilings", series: Mapping[str, Sequence["StepTiming"]],
                  annotate: bool = True) -> "Figure":
    """The roofline of this machine (log-log): attainable FLOP/s = min(matmul rate, intensity x bandwidth),
    drawn with the measured ceilings, and each measured step placed at its counted intensity and its
    achieved FLOP/s. Points far below the roof are limited by something the roofline does not model
    (per-op overhead, a kernel that cannot use all the bandwidth)."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    all_i = [t.cost.intensity for ts in series.values() for t in ts]
    lo, hi = min(all_i + [ceilings.ridge]) / 3, max(all_i + [ceilings.ridge]) * 3
    xs = np.logspace(np.log10(lo), np.log10(hi), 200)
    ax.plot(xs, np.minimum(ceilings.matmul_flops, xs * ceilings.copy_bandwidth), "k-", lw=2,
            label=f"roof: {_fmt_si(ceilings.copy_bandwidth, 'B/s')} copy, "
                  f"{_fmt_si(ceilings.matmul_flops, 'FLOP/s')} matmul")
    ax.plot(xs, np.minimum(ceilings.matmul_flops, xs * ceilings.gemv_bandwidth), "k:", lw=1,
            label=f"matrix-vector bandwidth {_fmt_si(ceilings.gemv_bandwidth, 'B/s')}")
    ax.axvline(ceilings.ridge, color="0.5", lw=0.8, ls="--")
    ax.text(ceilings.ridge * 1.08, ceilings.matmul_flops * 0.02, f"ridge\n{ceilings.ridge:.1f} FLOP/B", fontsize=8,
            color="0.35")
    markers = "os^vD"
    for k, (name, ts) in enumerate(series.items()):
        xs_p = [t.cost.intensity for t in ts]
        ys_p = [t.achieved_flops for t in ts]
        ax.plot(xs_p, ys_p, markers[k % len(markers)] + "-", ms=5, lw=0.8, label=name)
        if annotate:
            for t, x_, y_ in zip(ts, xs_p, ys_p):
                lab = f"{t.cost.new_tokens}" if t.phase == "prefill" else f"b{t.batch}"
                ax.annotate(lab, (x_, y_), textcoords="offset points", xytext=(3, -9), fontsize=6.5)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP / byte)", ylabel="FLOP/s",
           title=f"roofline: {ceilings.device}, {ceilings.dtype}")
    ax.legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    return fig


def plot_matvec(size_sweep: Sequence[Mapping[str, float]], batch_sweep: Sequence[Mapping[str, float]],
                bandwidth: float, mark_bytes: Iterable[float] = ()) -> "Figure":
    """Left: time of one matrix-vector product against the matrix's size: flat while a fixed per-call cost
    dominates, then rising with slope 1 at the memory bandwidth. ``mark_bytes`` marks the sizes of the
    model's own weight matrices. Right: one large matrix times a batch of vectors: the time barely moves
    while the weights dominate, so tokens per second rise with the batch."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    sizes = np.array([r["bytes"] for r in size_sweep])
    a.plot(sizes, [r["seconds"] * 1e6 for r in size_sweep], "o-", label="measured")
    a.plot(sizes, sizes / bandwidth * 1e6, "k--", lw=1, label=f"bytes / {_fmt_si(bandwidth, 'B/s')}")
    for m in mark_bytes:
        a.axvline(m, color="tab:orange", lw=0.8, alpha=0.7)
    a.set(xscale="log", yscale="log", xlabel="weight matrix size (bytes)", ylabel="µs per product",
          title="matrix x vector: overhead, cache, then bandwidth")
    a.legend(fontsize=8)
    bs = [r["batch"] for r in batch_sweep]
    b.plot(bs, [r["seconds"] * 1e6 for r in batch_sweep], "o-", label="µs per product")
    b.set(xscale="log", xlabel="vectors per product (batch)", ylabel="µs per product",
          title=f"one {_fmt_si(batch_sweep[0]['bytes'], 'B')} matrix x a batch")
    b.set_ylim(bottom=0)
    b2 = b.twinx()
    b2.plot(bs, [r["batch"] / r["seconds"] for r in batch_sweep], "s--", color="tab:green", label="vectors / s")
    b2.set_ylabel("vectors per second", color="tab:green")
    b2.set_ylim(bottom=0)
    b2.grid(False)
    fig.tight_layout()
    return fig


def plot_decode_intensity(name: str, cfg: Any, hw: "Hardware", contexts: Sequence[int] = (0, 1024, 8192, 32768),
                          batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)) -> "Figure":
    """Decode intensity (weights + KV cache, bf16) against batch size for one published model, one line per
    context length, with the hardware's ridge. Batching raises intensity only while the weights dominate
    the bytes; each sequence's KV cache is read for that sequence alone, so long contexts cap it."""
    import matplotlib.pyplot as plt

    from minifer_course.roofline import decode_cost

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in contexts:
        ax.plot(batches, [decode_cost(cfg, b, c, 2).intensity_weights_kv for b in batches], "o-", ms=3,
                label=f"context {c:,}")
    ax.axhline(hw.ridge, color="k", ls="--", lw=1)
    ax.text(batches[0], hw.ridge * 1.1, f"{hw.name} ridge ≈ {hw.ridge:.0f} FLOP/byte", fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel="decode batch (sequences per step)", ylabel="FLOP / byte",
           title=f"{name}, bf16: decode intensity vs batch")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


# --- a real-shape model beside the bundled one (chapter 01, section 5) --------------------------------


def load_real_shape(device: Any, name: str = "Qwen/Qwen3-0.6B") -> Any:
    """A model of a published shape with random weights (``load_format="dummy"``, the config shipped in
    ``minifer/assets/configs``: no download), float32 on a CPU like the bundled model, the GPU's own dtype
    otherwise. Its KV cache is kept to a few blocks: the timings below bring their own cache."""
    from minifer import LLM

    dtype = "float32" if str(device) == "cpu" else "auto"
    return LLM(name, load_format="dummy", dtype=dtype, device=device, num_kv_blocks=16)


def _weight_read_replay(model: Any) -> Any:
    """One matrix-vector product per weight matrix a batch-1 decode step multiplies by, in the model's
    order and with nothing else: the time the step would take if reading the weights were all it did."""
    import torch

    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    vectors = {w.shape[1]: torch.ones(1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}

    def run() -> None:
        for w in weights:
            torch.nn.functional.linear(vectors[w.shape[1]], w)
    return run


def _timed(fn: Any, device: Any) -> float:
    import time

    import torch

    t0 = time.perf_counter()
    fn()
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def decode_vs_weight_reads(model: Any, context: int = 128, rounds: int = 5) -> dict[str, Any]:
    """A batch-1 decode step, the same model's weight matrices read by bare matrix-vector products, and one
    large matrix-vector product (64 MiB, out of any cache: the bandwidth bound as the machine gives it right
    now), timed in alternating rounds so that a burst of load from elsewhere hits all three; medians.

    ``share`` is the fraction of the step that its matrix products account for: near 1, decode is its weight
    reads; far below 1, the rest of the step (small operations launched from Python) dominates.
    ``bandwidth`` is the large product's bytes per second, measured beside the step rather than at a quiet
    moment (``measure_ceilings`` keeps the best of several runs instead)."""
    import statistics

    import torch

    from minifer_course import roofline as rl

    w = model.lm_head.weight
    big = torch.full((4096, 4096 * 4 // w.element_size()), 0.01, dtype=w.dtype, device=w.device)
    vec = torch.ones(1, big.shape[1], dtype=w.dtype, device=w.device)
    replay = _weight_read_replay(model)
    steps, reads, streams = [], [], []
    with torch.inference_mode():
        replay()
        for _ in range(rounds):
            steps.append(rl.time_decode(model, 1, context, repeats=1, warmup=1))
            reads.append(_timed(replay, w.device))
            streams += [_timed(lambda: torch.nn.functional.linear(vec, big), w.device) for _ in range(3)]
    step = sorted(steps, key=lambda t: t.seconds)[len(steps) // 2]
    read = statistics.median(reads)
    moved = step.cost.weight_bytes + step.cost.kv_read_bytes + step.cost.kv_write_bytes
    bandwidth = big.numel() * big.element_size() / statistics.median(streams)
    return {"step": step, "step_seconds": step.seconds, "read_seconds": read, "share": read / step.seconds,
            "weight_bytes": step.cost.weight_bytes, "bandwidth": bandwidth, "floor_seconds": moved / bandwidth}


def decode_comparison_rows(runs: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows for ``format_table``: each model's batch-1 decode beside its weight reads and its bandwidth bound."""
    return [{"model": name, "mb": r["weight_bytes"] / 1e6, "floor_ms": r["floor_seconds"] * 1e3,
             "read_ms": r["read_seconds"] * 1e3, "ms": r["step_seconds"] * 1e3, "share": 100 * r["share"],
             "tok_s": 1 / r["step_seconds"], "of_bound": 100 * r["floor_seconds"] / r["step_seconds"]}
            for name, r in runs.items()]


DECODE_COMPARISON_COLUMNS = {
    "model": "model", "mb": "weights MB:,.0f", "floor_ms": "bytes/bandwidth ms:.1f",
    "read_ms": "its matrix products ms:.1f", "ms": "decode step ms:.1f", "share": "products/step %:.0f",
    "tok_s": "tokens/s:,.1f", "of_bound": "% of bound:.0f"}


def load_fused(llm: Any) -> Any:
    """The same model compiled by ``torch.compile`` (``compilation_config={"level": 3}``,
    ``minifer.compilation.compiled_decoder``: the element-wise ops of each layer fused, attention left as it is), or
    None off the CPU, where CUDA graphs remove the per-op overhead instead. Compiling happens at the first step
    (tens of seconds on a small CPU)."""
    from minifer import LLM

    if llm.device.type != "cpu":
        return None
    return LLM(llm.model_path, dtype=llm.dtype, device=llm.device, num_kv_blocks=16, compilation_config={"level": 3})


def decode_eager_vs_fused(model: Any, fused: Any, context: int = 128, rounds: int = 7) -> dict[str, float]:
    """Batch-1 decode steps of the eager model and of its compiled twin, alternating round by round so a burst of
    load from elsewhere hits both; medians, and the median of the per-round ratios (eager time / fused time)."""
    import statistics

    from minifer_course import roofline as rl

    rl.time_decode(fused, 1, context, repeats=1, warmup=1)  # compiles the one-token graph, outside the rounds
    eager_s, fused_s = [], []
    for _ in range(rounds):
        eager_s.append(rl.time_decode(model, 1, context, repeats=1, warmup=1).seconds)
        fused_s.append(rl.time_decode(fused, 1, context, repeats=1, warmup=1).seconds)
    ratios = sorted(e / f for e, f in zip(eager_s, fused_s))
    return {"eager_ms": 1e3 * statistics.median(eager_s), "fused_ms": 1e3 * statistics.median(fused_s),
            "speedup": statistics.median(ratios), "speedup_min": ratios[0], "speedup_max": ratios[-1]}

