"""Chapter 05's helpers: bytes per token, round-trip errors, int4 packing, kernel checks and timings, quality,
the 8-bit KV cache."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minifer.sampling_params import SamplingParams
from minifer_course.common import ModelPair
from minifer_course.weight_bytes import decoder_linear_shapes, quantized_linear_bytes  # noqa: F401 (chapter 05 shows them)

if TYPE_CHECKING:  # imported lazily at run time: matplotlib and ipywidgets are course extras
    from matplotlib.figure import Figure


# --- quantization (chapter 05) -----------------------------------------------------------------------


def decode_weight_bytes(cfg: Any, fmt: str, group_size: int = 128, symmetric: bool = True) -> dict[str, Any]:
    """The weight bytes one batch-1 decode step reads when the decoder linears are stored in ``fmt`` and
    every other weight stays in bf16, as ``quantize_model`` leaves them: the lm_head (or the tied
    embedding), the norms and one embedding row. int4 groups that do not divide a layer's K fall back as in
    ``quantize_model`` (the largest power of two that divides it)."""
    from minifer.quantization.model import group_for
    from minifer_course.roofline import layer_matmul_params, weight_bytes

    shapes = decoder_linear_shapes(cfg)
    layers = cfg.num_hidden_layers
    params = layers * sum(n * k for n, k in shapes.values())
    assert params == layers * layer_matmul_params(cfg)
    lin = layers * sum(quantized_linear_bytes(n, k, fmt, group_for(name, k, group_size) if fmt == "int4"
                                              else group_size, symmetric) for name, (n, k) in shapes.items())
    embedding_row = 0 if cfg.tie_word_embeddings else 2 * cfg.hidden_size
    rest = weight_bytes(cfg, 2) - 2 * params + embedding_row
    return {"format": fmt, "decoder_linears": lin, "rest_bf16": rest, "total": lin + rest,
            "bits_per_weight": 8 * lin / params, "linears_vs_bf16": 2 * params / lin,
            "total_vs_bf16": (2 * params + rest) / (lin + rest)}


def roundtrip_errors(w: torch.Tensor, group_sizes: Sequence[int] = (32, 64, 128, 256)) -> list[dict[str, Any]]:
    """Quantize ``w`` ``[N, K]`` in every format (int8, fp8, then int4 symmetric and asymmetric at each group
    size that divides K, and one group per row) and dequantize it again. Per row of the result: the bits per
    weight actually stored, the relative error ``||W - W_hat|| / ||W||`` (Frobenius), the largest error as a
    fraction of the quantization step (``within_half_step``: every element within half a step of its original,
    the formats' guarantee; None for fp8, whose step depends on the value)."""
    from minifer.quantization import dequantize, quantize

    wf = w.detach().float()
    k = wf.shape[1]
    variants: list[tuple[str, int | None, bool]] = [("int8", None, True), ("fp8", None, True)]
    groups = [g for g in group_sizes if k % g == 0 and g < k] + [k]
    variants += [("int4", g, s) for s in (True, False) for g in groups]
    rows = []
    for fmt, g, sym in variants:
        qw = quantize(wf, fmt, group_size=g or 128, symmetric=sym)
        err = (wf - dequantize(qw)).abs()
        if fmt == "fp8":
            half = None
        else:
            step = qw.scales[:, None] if fmt == "int8" else qw.scales.repeat_interleave(g, dim=1)
            half = float((err / step).max()) <= 0.5 + 1e-4
        name = fmt if fmt != "int4" else f"int4 {'sym' if sym else 'asym'} " + (f"g{g}" if g < k else "per row")
        rows.append({"name": name, "format": fmt, "group_size": g, "symmetric": sym,
                     "bits_per_weight": 8 * qw.nbytes() / wf.numel(),
                     "rel_error": float(err.norm() / wf.norm()), "max_abs_error": float(err.max()),
                     "within_half_step": half})
    return rows


def plot_roundtrip_errors(panels: Mapping[str, Sequence[Mapping[str, Any]]]) -> "Figure":
    """One panel per matrix (rows of :func:`roundtrip_errors`): int4's relative round-trip error against
    its group size, symmetric and asymmetric, with int8 and fp8 (one scale per row) as horizontal lines,
    and the bits per weight of each point written beside it."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 3.8), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels.items()):
        for fmt, color in (("int8", "tab:green"), ("fp8", "tab:purple")):
            r = next(r for r in rows if r["format"] == fmt)
            ax.axhline(r["rel_error"], color=color, ls="--", lw=1.2,
                       label=f"{fmt}, per row ({r['bits_per_weight']:.2f} bits)")
        for sym, color in ((True, "tab:blue"), (False, "tab:orange")):
            pts = [r for r in rows if r["format"] == "int4" and r["symmetric"] == sym]
            xs = list(range(len(pts)))
            ax.plot(xs, [r["rel_error"] for r in pts], "o-", color=color,
                    label=f"int4 {'symmetric' if sym else 'asymmetric (zero points)'}")
            for x, r in zip(xs, pts):
                ax.annotate(f"{r['bits_per_weight']:.2f}b", (x, r["rel_error"]), fontsize=7, xytext=(3, 4),
                            textcoords="offset points", color=color)
            ax.set_xticks(xs, [str(r["group_size"]) if "per row" not in r["name"] else f"row ({r['group_size']})"
                               for r in pts])
        ax.set(yscale="log", xlabel="int4 group size (inputs per scale)", ylabel="||W - W_hat|| / ||W||",
               title=title)
        ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    return fig


def int4_packing_text(qw: Any, row: int = 0, columns: int = 8) -> str:
    """The first ``columns`` codes of one row of an int4 ``QuantizedWeight`` and the bytes that hold them:
    byte ``j`` is ``code[2j] | code[2j + 1] << 4``, the even column in the low nibble."""
    from minifer.quantization import unpack_int4

    if qw.fmt != "int4":
        raise ValueError(f"int4_packing_text takes an int4 weight, got {qw.fmt}")
    columns = min(columns - columns % 2, qw.shape[1])
    codes = unpack_int4(qw.qweight[row:row + 1, : columns // 2].cpu())[0].tolist()
    packed = qw.qweight[row, : columns // 2].cpu().tolist()
    lines = ["column k   " + "".join(f"{k:>5d}" for k in range(columns)),
             "code q     " + "".join(f"{q:>5d}" for q in codes),
             "byte j     " + "".join(f"{'0x%02x' % b:>10s}" for b in packed),
             "  = high|low nibble: " + "  ".join(f"{b >> 4:x}|{b & 0xF:x} (q{2 * j + 1}|q{2 * j})"
                                                 for j, b in enumerate(packed))]
    return "\n".join(lines)


@dataclass
class KernelCheck:
    """The fused dequantize-matmul kernels against ``quant_linear_reference``: whether they could run here,
    why not if they could not, and one row per (format, path)."""

    ran: bool
    message: str
    rows: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return self.ran and all(r["ok"] for r in self.rows)


def check_quant_kernels(variants: Sequence[tuple[str, int | None, bool]] = (
        ("int8", None, True), ("fp8", None, True), ("int4", 32, True), ("int4", 64, False)),
        runs: Sequence[tuple[str, int]] = (("gemv", 1), ("splitk", 3), ("tiled", 17)), *, k: int = 192,
        n: int = 45, seed: int = 0, tol: float = 1e-5) -> KernelCheck:
    """Run ``quant_matmul`` on an odd shape (``n`` outputs, ``k`` inputs, float32 activations with a bias) for
    every format variant ``(format, group_size, symmetric)`` and ``(path, M)`` of ``runs``, and compare with
    ``quant_linear_reference``: ``ok`` when the relative error is below ``tol`` and every output element was
    written (the output starts as NaN). On a CUDA GPU natively, on the CPU under Triton's interpreter, which
    must have been switched on before triton was first imported (``kv_memory.enable_triton_interpreter``);
    without Triton (macOS) it returns ``ran=False`` and the reason."""
    from minifer.bench.machine import enable_triton_interpreter

    available, message = enable_triton_interpreter()
    if not available:
        return KernelCheck(False, message, [])
    from minifer.kernels import INTERPRETING

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not INTERPRETING:
        return KernelCheck(False, "skipped: triton was imported before TRITON_INTERPRET=1 was set; restart the "
                                  "kernel and run the first cell first", [])
    from minifer.kernels.quant_matmul import quant_matmul
    from minifer.quantization import quant_linear_reference, quantize

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    bias = torch.randn(n, generator=gen)
    rows = []
    for fmt, g, sym in variants:
        qw = quantize(w, fmt, group_size=g or 128, symmetric=sym).to(device)
        for path, m in runs:
            x = torch.randn(m, k, generator=gen).to(device)
            out = torch.full((m, n), float("nan"), device=device)
            quant_matmul(x, qw, bias.to(device), path=path, out=out)
            ref = quant_linear_reference(x, qw, bias.to(device))
            err = float((out.double() - ref.double()).norm() / ref.double().norm())
            name = fmt if fmt != "int4" else f"int4 {'sym' if sym else 'asym'} g{g}"
            rows.append({"format": name, "path": path, "M": m, "shape": f"{m}x{k} @ ({n}x{k})^T", "rel_error": err,
                         "ok": bool(torch.isfinite(out).all()) and err < tol})
    return KernelCheck(True, message, rows)


def kernel_speedup_table(results: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (weight shape, format, M) of ``python -m minifer.bench.quant_kernels`` results: the
    fastest path measured for it (M <= 16 is measured on both decode paths, gemv and splitk), with its time,
    the bf16 ``torch.matmul`` time, speed-up, bytes bound and bandwidths. ``results`` maps a label to a
    result; a later result replaces an earlier one's measurement of the same (shape, format, M, path), so
    pass the older sweep first. Each row says which result it came from (``source``)."""
    cases: dict[tuple, dict[str, Any]] = {}
    for label, res in results.items():
        for r in res["rows"]:
            cases[(r["K"], r["N"], r["format"], r["M"], r["path"])] = {
                **r, "source": label, "copy_bw_GBps": res["copy_bandwidth_Bps"] / 1e9}
    best: dict[tuple, dict[str, Any]] = {}
    paths: dict[tuple, list[str]] = {}
    for (k, n, fmt, m, path), r in cases.items():
        key = (k, n, fmt, m)
        paths.setdefault(key, []).append(path)
        if key not in best or r["us_quant"] < best[key]["us_quant"]:
            best[key] = r
    fmt_order = {"int8": 0, "int4": 1, "fp8": 2}
    shape_order = {s: i for i, s in enumerate(dict.fromkeys((k, n) for k, n, _, _ in best))}
    rows = []
    for key in sorted(best, key=lambda t: (shape_order[t[:2]], fmt_order.get(t[2], 9), t[3])):
        r = best[key]
        rows.append({"shape": f"{r['K']}x{r['N']}", "K": r["K"], "N": r["N"], "format": r["format"], "M": r["M"],
                     "path": r["path"], "paths_measured": "/".join(sorted(paths[key])), "us_quant": r["us_quant"],
                     "us_bf16": r["us_bf16"], "speedup": r["speedup"], "bytes_bound": r["bytes_bound"],
                     "GBps_quant": r["GBps_quant"], "GBps_bf16": r["GBps_bf16"],
                     "of_copy_quant": r["GBps_quant"] / r["copy_bw_GBps"],
                     "of_copy_bf16": r["GBps_bf16"] / r["copy_bw_GBps"], "config": r.get("config"),
                     "source": r["source"]})
    return rows


def plot_kernel_speedups(rows: Sequence[Mapping[str, Any]]) -> "Figure":
    """Speed-up over bf16 ``torch.matmul`` against the rows M, one panel per weight shape (rows of
    :func:`kernel_speedup_table`), a line per format, with each format's bytes bound dashed and 1x (where
    quantized weights stop paying) in grey."""
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    colors = {"int8": "tab:green", "int4": "tab:blue", "fp8": "tab:purple"}
    markers = {"gemv": "D", "splitk": "o", "tiled": "s"}
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.6 * len(shapes), 3.8), sharey=True, squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for fmt, color in colors.items():
            pts = sorted((r for r in rows if r["shape"] == shape and r["format"] == fmt), key=lambda r: r["M"])
            if not pts:
                continue
            ms = [r["M"] for r in pts]
            ax.plot(ms, [r["speedup"] for r in pts], "-", color=color, label=fmt)
            ax.plot(ms, [r["bytes_bound"] for r in pts], "--", color=color, lw=1, alpha=0.7)
            for r in pts:
                ax.plot(r["M"], r["speedup"], markers.get(r["path"], "x"), color=color, ms=6)
        ax.axhline(1.0, color="0.4", lw=0.9)
        ax.set(xscale="log", xlabel="rows M (tokens in the step)", title=f"K x N = {shape}")
        ax.set_xticks(ms, [str(m) for m in ms])
    axes[0][0].set_ylabel("speed-up over bf16 (dashed: bytes bound)")
    for path, marker in markers.items():
        axes[0][0].plot([], [], marker, color="0.3", ls="none", label=f"path {path}")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def kernel_time_fit(rows: Sequence[Mapping[str, Any]], m: int = 1) -> list[dict[str, Any]]:
    """Split the measured time at ``m`` rows into a fixed part and a part proportional to the bytes read:
    a least-squares line ``time = fixed + bytes / bandwidth`` through the weight shapes of each format (rows
    of :func:`kernel_speedup_table`), and through bf16 ``torch.matmul``'s times on the same shapes. The slope's
    ``marginal_GBps`` is the bandwidth the kernel reaches on each *extra* byte; ``fixed_us`` is what a call
    costs however small (launch, grid tail, split-K reduction). None where the time does not grow with the bytes."""

    def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x in xs)
        return my - slope * mx, slope

    at_m = [r for r in rows if r["M"] == m]
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in at_m:
        nbytes = r["GBps_quant"] * 1e3 * r["us_quant"]
        groups.setdefault(f"{r['format']} ({r['path']})", []).append((nbytes, r["us_quant"]))
        groups.setdefault("bf16 torch.matmul", []).append((r["GBps_bf16"] * 1e3 * r["us_bf16"], r["us_bf16"]))
    out = []
    for name, pts in groups.items():
        if len({round(x) for x, _ in pts}) < 2:
            continue
        fixed, slope = fit(pts)
        out.append({"kernel": name, "points": len(pts), "fixed_us": fixed,
                    "marginal_GBps": 1e-3 / slope if slope > 0 else None})
    return out


def register_limited_warps(registers: int, num_warps: int, regs_per_sm: int = 65536, max_warps: int = 64) -> int:
    """Warps an SM can hold at once when registers are the only limit (sm_80 and sm_90 alike: 64K 32-bit
    registers and at most 64 warps per SM): whole blocks of ``num_warps`` warps, each thread's registers
    rounded up to a multiple of 8 as the hardware allocates them. Shared memory can lower it further."""
    per_warp = 32 * -(-registers // 8) * 8
    return min(max_warps, (regs_per_sm // per_warp) // num_warps * num_warps)


def aot_table(report: Mapping[str, Any], match: str = "quant_") -> list[dict[str, Any]]:
    """``python -m minifer_course.experiments.aot``'s report as one row per kernel whose name contains ``match``, with
    registers per thread, shared memory, spills, the register-limited warps per SM
    (:func:`register_limited_warps`) and the main loop's instructions per weight (None where not counted)
    side by side for each architecture compiled (``regs_80``, ``smem_80``, ``spills_80``, ``warps_80``,
    ``ipw_80``, ...)."""
    rows: dict[str, dict[str, Any]] = {}
    for k in report["kernels"]:
        if match not in k["kernel"]:
            continue
        cc = k["arch"].removeprefix("sm_")
        row = rows.setdefault(k["kernel"], {"kernel": k["kernel"], "num_warps": k["num_warps"],
                                            "num_stages": k["num_stages"]})
        row.update({f"regs_{cc}": k["registers"], f"smem_{cc}": k["shared_bytes"],
                    f"spills_{cc}": k["spill_stores"] + k["spill_loads"],
                    f"warps_{cc}": register_limited_warps(k["registers"], k["num_warps"]),
                    f"ipw_{cc}": k.get("instructions_per_weight")})
    return list(rows.values())


def quality_table(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rows of ``python -m minifer.bench.quality``'s result with what the chapter reads off them: the
    share of positions whose top-1 next token differs from the fp32 model's on stories and on code, and how
    many times more often it differs on code (``code_over_stories``; None where neither differs)."""
    out = []
    for r in result["rows"]:
        ds, dc = 1 - r["agreement_teacher_forced"], 1 - r["code_agreement_teacher_forced"]
        out.append({**{k: v for k, v in r.items() if k not in ("quantization", "weight_bytes", "vs_rtn")},
                    "disagree_stories": ds, "disagree_code": dc,
                    "code_over_stories": dc / ds if ds > 0 else None,
                    "heldout_se_pct": 100 * r["heldout_nll_change_se"], "code_se_pct": 100 * r["code_nll_change_se"]})
    return out


def plot_quant_quality(result: Mapping[str, Any]) -> "Figure":
    """Left: the held-out perplexity change against how many times smaller than bf16 the decoder linears are
    (error bars: one paired standard error; circles symmetric, squares asymmetric, stars GPTQ). Right: how
    often the top-1 next token differs from fp32's, on stories and on Python code."""
    import matplotlib.pyplot as plt

    rows = [r for r in quality_table(result) if r["format"] not in ("fp32", "bf16")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    for r in rows:
        marker = "*" if r["method"] == "gptq" else "o" if r["symmetric"] else "s"
        a.errorbar(r["ratio_vs_bf16"], r["heldout_ppl_change_pct"], yerr=r["heldout_se_pct"], fmt=marker,
                   ms=10 if marker == "*" else 5, capsize=2)
        a.annotate(r["name"], (r["ratio_vs_bf16"], r["heldout_ppl_change_pct"]), fontsize=7,
                   xytext=(5, -9) if r["method"] == "gptq" else (-4, 5), textcoords="offset points",
                   ha="left" if r["method"] == "gptq" else "right")
    a.axhline(0, color="0.5", lw=0.8)
    a.set(xlabel="decoder linears: times smaller than bf16", ylabel="held-out perplexity change (%)",
          title="stories: bytes against perplexity")
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [100 * r["disagree_stories"] for r in rows], 0.4, label="stories (held-out)")
    b.bar([i + 0.2 for i in x], [100 * r["disagree_code"] for r in rows], 0.4, label="Python stdlib code")
    b.set_xticks(list(x), [r["name"] for r in rows], rotation=50, ha="right", fontsize=7)
    b.set(ylabel="top-1 differs from fp32 (%)", title="the same models on two workloads")
    b.legend(fontsize=8)
    fig.tight_layout()
    return fig


def live_quality(models: Mapping[str, Any], reference: str, windows: Mapping[str, torch.Tensor],
                 prompts: torch.Tensor, n_tokens: int = 32, batch_size: int = 8) -> list[dict[str, Any]]:
    """A small version of ``minifer.bench.quality`` on already-built models (``LLM``s or models): for each
    model, on each set of token ``windows`` (``minifer.eval.heldout_windows`` / ``stdlib_windows``), the
    perplexity, its change against ``reference`` in percent with one paired standard error (over windows), and
    the teacher-forced top-1 agreement; then the free-running greedy agreement over ``n_tokens`` from
    ``prompts`` (``minifer.eval.generation_agreement``'s definition)."""
    from minifer.eval import greedy_continuations, prefix_agreement, score_windows

    nets = {name: m if isinstance(m, torch.nn.Module) else m.model for name, m in models.items()}
    if reference not in nets:
        raise ValueError(f"reference {reference!r} is not one of {list(nets)}")
    scores = {name: {dom: score_windows(net, w, batch_size) for dom, w in windows.items()}
              for name, net in nets.items()}
    gens = {name: greedy_continuations(net, prompts, n_tokens) for name, net in nets.items()}
    rows = []
    for name in nets:
        row: dict[str, Any] = {"model": name}
        for dom in windows:
            s, ref = scores[name][dom], scores[reference][dom]
            d = s.nll.double().mean(1) - ref.nll.double().mean(1)
            row.update({f"{dom}_ppl": s.perplexity, f"{dom}_change_pct": 100 * (s.perplexity / ref.perplexity - 1),
                        f"{dom}_se_pct": 100 * float(d.std() / len(d) ** 0.5) if len(d) > 1 else 0.0,
                        f"{dom}_top1": s.agreement(ref)})
        row["generation_agreement"] = prefix_agreement(gens[name], gens[reference])
        rows.append(row)
    return rows


def kv_cache_runs(pair: ModelPair, kv_cache_dtypes: Sequence[str], prompts: Sequence[str], max_tokens: int = 32,
                  **engine_kw: Any) -> list[dict[str, Any]]:
    """Build the pair's target once per KV-cache format, in turn (each engine is freed before the next, so
    on a GPU each sees the same free memory), with the same cache budget ``engine_kw`` (``kv_cache_memory``
    on the CPU, ``gpu_memory_utilization`` on CUDA); generate greedily (EOS ignored) and report the blocks the
    budget bought (``stats()["kv_blocks_total"]``), the bytes per cached token, and how many tokens and whole
    sequences match the first format's."""
    import gc

    from minifer.attention.backends.paged import PagedKVCache

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rows, first = [], None
    for kv in kv_cache_dtypes:
        llm = pair.load("target", kv_cache_dtype=kv, **engine_kw)
        cfg, bm = llm.model_config, llm.engine.kv_cache_manager
        tokens = [o.outputs[0].token_ids for o in llm.generate(list(prompts), params, use_tqdm=False)]
        per_block = PagedKVCache.bytes_per_block(cfg.num_hidden_layers, bm.block_size, cfg.num_key_value_heads,
                                                 cfg.head_dim, llm.dtype, kv)
        first = tokens if first is None else first
        rows.append({"kv_cache_dtype": kv, "model_dtype": str(llm.dtype).replace("torch.", ""),
                     "kv_blocks_total": llm.stats()["kv_blocks_total"], "bytes_per_token": per_block / bm.block_size,
                     "token_agreement": sum(a == b for x, y in zip(tokens, first) for a, b in zip(x, y))
                     / sum(map(len, first)),
                     "identical_sequences": sum(x == y for x, y in zip(tokens, first)), "sequences": len(first)})
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


# --- ceilings on other GPUs and the summary against the literature (chapter 05) -----------------------

# Datasheet memory bandwidths of the GPUs learners most often have (specs, not measurements): NVIDIA T4 Tensor Core
# GPU datasheet (320 GB/s GDDR6; 65 TFLOPS fp16 mixed-precision tensor) and NVIDIA L4 Tensor Core GPU datasheet
# (300 GB/s; 121 TFLOPS fp16/bf16 tensor dense, 242 fp8 dense: the sheet's 242 and 485 are with sparsity).
# references/literature.md lists both sheets.
SPEC_GPUS = {"T4 (spec)": 320e9, "L4 (spec)": 300e9}


def decode_ceiling_rows(step: Sequence[Mapping[str, Any]], measured: Mapping[str, float]) -> list[dict[str, Any]]:
    """Batch-1 decode ceilings (bandwidth / bytes per token) for each weight format of ``step`` on each GPU:
    ``measured`` bandwidths first (labelled as measured by the caller), then the datasheet rows of ``SPEC_GPUS``."""
    return [{"gpu": gpu, "format": r["label"], "gb": r["total"] / 1e9, "bw": bw / 1e9, "tok_s": bw / r["total"],
             "vs_bf16": r["total_vs_bf16"]}
            for gpu, bw in {**measured, **SPEC_GPUS}.items() for r in step]


DECODE_CEILING_COLUMNS = {"gpu": "GPU", "bw": "GB/s:,.0f", "format": "decoder linears in", "gb": "GB per token:.2f",
                          "tok_s": "batch-1 ceiling tok/s:,.0f", "vs_bf16": "x bf16's ceiling:.2f"}


def int4_target(kern: Mapping[str, Any], krows: Sequence[Mapping[str, Any]]) -> tuple[dict, dict]:
    """The project's int4 kernel target from the decode run, and the kernel table's row for its case."""
    t = kern["targets"][0]
    r4 = next(r for r in krows if (r["format"], r["M"], r["K"], r["N"]) == (t["format"], t["M"], t["K"], t["N"]))
    return t, r4


def literature_summary(*, qt: Sequence[Mapping[str, Any]], krows: Sequence[Mapping[str, Any]],
                       kvq: Mapping[str, Any], qual: Mapping[str, Any], kern: Mapping[str, Any],
                       step: Sequence[Mapping[str, Any]], flips: Sequence[float], name: str) -> str:
    """Section 7's table as Markdown: each claim of the article, the literature's figure with its conditions, and
    ours from the committed benchmarks (quality ``qual``/``qt``, kernels ``kern``/``krows``, KV cache ``kvq``) and
    the chapter's byte count (``step``, for model ``name``)."""
    from pathlib import Path

    t, r4 = int4_target(kern, krows)
    meta, qc = qual["metadata"], qual["config"]
    Q = {r["name"]: r for r in qt}
    K = {(r["format"], r["M"]): r["speedup"] for r in krows if (r["K"], r["N"]) == (4096, 14336)}
    xs = lambda m: " / ".join(f"{K[f, m]:.2f}x" for f in ("int4", "int8", "fp8"))  # noqa: E731
    ppl = lambda v: f"{Q[v]['heldout_ppl_change_pct']:+.2f}%"  # noqa: E731
    ratio = lambda v: f"{Q[v]['ratio_vs_bf16']:.2f}x"  # noqa: E731
    mem = {(r["kv_cache_dtype"], r["kv_cache_scales"]): r for r in kvq["memory"]["Qwen/Qwen3-0.6B"]
           if r["model_dtype"] == "bfloat16"}
    agree = {(r["kv_cache_dtype"], r["kv_cache_scales"]): r["token_agreement"] for r in kvq["agreement"]}
    tg = {k: v["met"] for k, v in qual["targets"].items()}
    met = lambda ok: "met" if ok else "**not met**"  # noqa: E731
    qcond = (f"{Path(qc['model']).name}, {qc['dtype']} on {qc['device']}, {qc['heldout_tokens']:,} held-out + "
             f"{qc['code_tokens']:,} code tokens, `{meta['command']}`")
    kcond = f"{kern['environment']['gpu']}, CUDA graphs, vs bf16 torch.matmul, `python -m minifer.bench.quant_kernels`"
    g128 = Q["int4 g128 sym"]
    table = [
        ("FP8 / INT4: 2-4x less memory",
         "int4 kernel bound ≈ 3.87x over fp16 (g128, fp16 scales; Marlin); FP8: \"2x reduction in model memory\" "
         "(vLLM docs)",
         f"decoder linears: int8/fp8 **{ratio('int8')}**, int4 g128 sym **{ratio('int4 g128 sym')}** (≥ 3.7x target "
         f"{met(tg['int4_g128_sym_bytes_ratio_ge_3.7'])}), asym {ratio('int4 g128 asym')} "
         f"({met(tg['int4_g128_asym_bytes_ratio_ge_3.7'])}); the whole bundled model "
         f"{g128['whole_model_ratio_vs_bf16']:.2f}x (embeddings and lm_head kept); a {name} decode step "
         f"{step[2]['total_vs_bf16']:.2f}x fewer bytes (from its config)"),
        ("about half the cost",
         "A100, batch 1: Llama-2-7B 107 → 171 (int8) → 201 (int4 g64) tok/s (pytorch/ao); gpt-fast 105 → 156 → 197; "
         "Llama-3.1-8B on an H100 in vLLM: FP8 decode 1.21x, int8 weight-only 0.65x; FP8 up to 1.6x throughput (vLLM)",
         f"one 4096x14336 matmul, int4 / int8 / fp8: M = 1 **{xs(1)}** (int4 ≥ 3x target {met(t['met'])}, bytes "
         f"bound {r4['bytes_bound']:.2f}x); M = 16 {xs(16)}; prefill M = 256 {xs(256)} (slower). Kernel level, not "
         f"end to end ({kcond})"),
        ("quality must be re-measured",
         "Llama-2-7B int4 g128, WikiText-2: 5.47 → RTN 5.73, GPTQ 5.69, AWQ 5.60 (AWQ, Table 4); Llama-3-8B: 7.44 → "
         "int4 g64 8.32 (+12%), GPTQ 7.92, int8 7.45 (pytorch/ao); Llama-3.1-8B fp8 7.33 → 7.42",
         f"held-out perplexity: int8 {ppl('int8')} (≤ 0.5% target {met(tg['int8_ppl_change_le_0.5pct'])}), fp8 "
         f"{ppl('fp8')}; int4 g128 sym RTN {ppl('int4 g128 sym')} → GPTQ {ppl('int4 g128 sym gptq')}, asym RTN "
         f"{ppl('int4 g128 asym')} → GPTQ {ppl('int4 g128 asym gptq')} (≤ 3% targets "
         f"{met(tg['int4_g128_sym_gptq_ppl_change_le_3pct'] and tg['int4_g128_asym_gptq_ppl_change_le_3pct'])}) "
         f"({qcond})"),
        ("a loss harmless in summarisation can show in code", "— (the article's warning; no source in the notes "
         "measures it)",
         f"the top-1 next token differs from fp32's {min(flips):.1f}-{max(flips):.1f}x more often on stdlib code "
         f"than on stories; int4 g128 sym: {100 * g128['disagree_stories']:.1f}% of positions on stories, "
         f"{100 * g128['disagree_code']:.1f}% on code ({qcond})"),
        ("the KV cache, the largest consumer at long context", "— (no 8-bit KV cache measurement in the notes)",
         f"int8/fp8 KV, a scale per (token, head): {mem['int8', 'token']['vs_model_dtype']:.2f}x the sequences of "
         f"bf16 in the same memory; static per-head scales: **{mem['int8', 'head']['vs_model_dtype']:.2f}x** "
         f"(Qwen3-0.6B shapes, ShareGPT-like lengths). Greedy tokens agreeing position by position: "
         f"{agree['int8', 'token']:.1%} / {agree['fp8', 'token']:.1%} (int8 / fp8, per token), "
         f"{agree['int8', 'head']:.1%} / {agree['fp8', 'head']:.1%} (static per head) on the bundled model "
         f"(`python -m minifer_course.kv_quant`)"),
    ]
    return ("| claim (article) | literature (source, conditions) | ours (measured, conditions) |\n|---|---|---|\n"
            + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in table))
