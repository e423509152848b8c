"""Quantization: what each format saves in bytes and costs in quality, on two workloads (chapter 05).

    python -m minifer.bench.quality --out benchmarks/results/quant_quality.json --plot

On the bundled target, for every variant: the bytes of the decoder-layer linear weights (the part
quantized, see ``minifer.quantization.linear``) and their ratio to bf16 (2 bytes per parameter), the whole model's
bytes with the kept layers (embeddings, lm_head, norms) in bf16, held-out perplexity and its change,
greedy agreement with the float32 model (teacher-forced, and free-running over ``--gen-tokens``; see
``minifer.eval``), and the perplexity change on Python standard-library source, a domain the model never
saw. Variants:

- ``fp32``: the model as loaded, the reference of every change;
- ``bf16``: the decoder linears' weights rounded to bfloat16 and computed in float32 (what storing them in
  bf16 costs in quality; the bytes are 2 per parameter, not measured on a bf16 model);
- ``int8``, ``fp8``: one scale per output channel, round-to-nearest (RTN);
- ``int4 g32/g64/g128``, symmetric and asymmetric (zero points), RTN;
- ``int4 g128 ... gptq``: GPTQ with act order on ``--calib-sequences`` x ``--calib-len`` tokens of the
  *training* split (``minifer.compress.gptq``).

On the code the fp32 model is worse than a uniform guess (perplexity above the 2048-token vocabulary: it is
confidently wrong), so small changes to its logits move that perplexity by several percent either way;
the teacher-forced top-1 agreement shows the workload effect more plainly: quantization flips the model's
next-token choice several times more often on code than on stories.

Every variant is scored on the same token windows as the reference, so a change is a paired difference:
``*_nll_change_se`` is the standard error of the mean per-window NLL change, and GPTQ rows carry the same
comparison against their RTN twin. The held-out text is subsampled to ``--heldout-tokens`` by windows
spread evenly over the file. Targets (``targets`` in the JSON): int4 g128 decoder-linear bytes >= 3.7x
smaller than bf16, int8 perplexity change <= 0.5%, int4 g128 with GPTQ <= 3%.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minifer.compress import gptq_quantize_model
from minifer.eval import (
    STDLIB_FILES,
    WindowScores,
    greedy_continuations,
    heldout_prompts,
    heldout_windows,
    prefix_agreement,
    score_windows,
    stdlib_windows,
)
from minifer.kernels import quant_kernel_for
from minifer.quantization.linear import decoder_linears, weight_bytes
from minifer.quantization.model import quantize_model


@dataclass(frozen=True)
class Variant:
    name: str
    fmt: str  # "fp32" | "bf16" | a quantization format
    group_size: int | None = None
    symmetric: bool = True
    calibration: str | None = None


VARIANTS = (
    Variant("fp32", "fp32"), Variant("bf16", "bf16"), Variant("int8", "int8"), Variant("fp8", "fp8"),
    *(Variant(f"int4 g{g} {'sym' if s else 'asym'}", "int4", g, s) for s in (True, False) for g in (32, 64, 128)),
    Variant("int4 g128 sym gptq", "int4", 128, True, "gptq"),
    Variant("int4 g128 asym gptq", "int4", 128, False, "gptq"),
)


def build_variant(base: torch.nn.Module, v: Variant, calib: torch.Tensor | None) -> tuple[torch.nn.Module, dict]:
    """A copy of ``base`` in variant ``v`` and what was done (the quantization config, or a note)."""
    model = copy.deepcopy(base)
    if v.fmt == "fp32":
        return model, {"note": "the model as loaded"}
    if v.fmt == "bf16":
        with torch.no_grad():
            for lin in decoder_linears(model).values():
                lin.weight.copy_(lin.weight.to(torch.bfloat16).float())
        return model, {"note": "decoder linear weights rounded to bf16, computed in float32; bytes = 2 / param"}
    kernel = quant_kernel_for(model.lm_head.weight.device)
    if v.calibration == "gptq":
        cfg = gptq_quantize_model(model, v.fmt, v.group_size or 128, v.symmetric, calib_data=calib, kernel=kernel)
    else:
        cfg = quantize_model(model, v.fmt, v.group_size or 128, v.symmetric, kernel=kernel)
    return model, cfg.to_dict()


def _change(s: WindowScores, ref: WindowScores) -> dict[str, float]:
    d = s.nll.double().mean(1) - ref.nll.double().mean(1)
    return {"nll_change": float(d.mean()), "nll_change_se": float(d.std() / len(d) ** 0.5)}


def _bytes(model: torch.nn.Module, v: Variant) -> dict[str, Any]:
    wb = weight_bytes(model)
    lin = 2 * wb["decoder_linears_params"] if v.fmt == "bf16" else wb["decoder_linears"]
    rest_bf16 = 2 * (wb["embed_lm_head_params"] + wb["other_params"])
    whole = lin + rest_bf16
    return {"decoder_linear_bytes": lin, "bits_per_weight": 8 * lin / wb["decoder_linears_params"],
            "ratio_vs_bf16": 2 * wb["decoder_linears_params"] / lin,
            "whole_model_bytes_bf16_rest": whole, "whole_model_ratio_vs_bf16": 2 * wb["total_params"] / whole,
            "stored_bytes": wb["total"] if v.fmt != "bf16" else None, "weight_bytes": wb}


def run_quality(llm, variants=VARIANTS, *, heldout_tokens: int = 50_000, code_tokens: int = 12_000,
                max_len: int = 512, calib_sequences: int = 32, calib_len: int = 512, prompts: int = 32,
                prompt_len: int = 12, gen_tokens: int = 32, batch_size: int = 8, log=print) -> dict[str, Any]:
    from minifer.eval import calibration_data

    tok, base = llm.tokenizer, llm.model
    if tok is None:
        raise ValueError("the quality benchmark needs a tokenizer (not a dummy model)")
    held = heldout_windows(tok, max_len, heldout_tokens)
    code = stdlib_windows(tok, max_len, code_tokens)
    prompt_ids = heldout_prompts(tok, prompts, prompt_len)
    calib = None
    if any(v.calibration for v in variants):
        calib = calibration_data(tok, calib_sequences, calib_len)
    ref_held, ref_code = score_windows(base, held, batch_size), score_windows(base, code, batch_size)
    ref_gen = greedy_continuations(base, prompt_ids, gen_tokens)
    rows: list[dict[str, Any]] = []
    for v in variants:
        t0 = time.perf_counter()
        model, how = build_variant(base, v, calib)
        t1 = time.perf_counter()
        sh, sc = score_windows(model, held, batch_size), score_windows(model, code, batch_size)
        gen = greedy_continuations(model, prompt_ids, gen_tokens)
        row = {"name": v.name, "format": v.fmt, "group_size": v.group_size, "symmetric": v.symmetric,
               "method": v.calibration or ("rtn" if v.fmt in ("int8", "int4", "fp8") else None),
               **_bytes(model, v),
               "heldout_ppl": sh.perplexity, "heldout_ppl_change_pct": 100 * (sh.perplexity / ref_held.perplexity - 1),
               **{f"heldout_{k}": x for k, x in _change(sh, ref_held).items()},
               "agreement_teacher_forced": sh.agreement(ref_held),
               "generation_agreement": prefix_agreement(gen, ref_gen),
               "code_ppl": sc.perplexity, "code_ppl_change_pct": 100 * (sc.perplexity / ref_code.perplexity - 1),
               **{f"code_{k}": x for k, x in _change(sc, ref_code).items()},
               "code_agreement_teacher_forced": sc.agreement(ref_code),
               "quantize_seconds": t1 - t0, "eval_seconds": time.perf_counter() - t1, "quantization": how}
        if v.calibration:
            twin = next((r for r in rows if r["format"] == v.fmt and r["group_size"] == v.group_size
                         and r["symmetric"] == v.symmetric and r["method"] == "rtn"), None)
            if twin is not None:
                row["vs_rtn"] = {"heldout": _change(sh, twin["_scores"][0]), "code": _change(sc, twin["_scores"][1]),
                                 "rtn_heldout_ppl_change_pct": twin["heldout_ppl_change_pct"]}
        row["_scores"] = (sh, sc)
        rows.append(row)
        log(f"{v.name:>20}: {row['ratio_vs_bf16']:.2f}x smaller than bf16, held-out ppl {sh.perplexity:.4f} "
            f"({row['heldout_ppl_change_pct']:+.2f}%), agreement {row['agreement_teacher_forced']:.3f} / "
            f"{row['generation_agreement']:.3f}, code ppl {row['code_ppl_change_pct']:+.2f}% "
            f"[{row['quantize_seconds']:.0f}+{row['eval_seconds']:.0f} s]")
        del model
    for r in rows:
        del r["_scores"]
    config = {"model": str(llm.model_path), "dtype": str(llm.dtype).replace("torch.", ""), "device": str(llm.device),
              "max_len": max_len, "heldout_windows": len(held), "heldout_tokens": held[:, 1:].numel(),
              "code_windows": len(code), "code_tokens": code[:, 1:].numel(), "code_files": list(STDLIB_FILES),
              "prompts": prompts, "prompt_len": prompt_len, "gen_tokens": gen_tokens,
              "calibration": None if calib is None else {"source": "data/tinystories/train.txt",
                                                         "sequences": calib_sequences, "seq_len": calib_len}}
    baseline = {"heldout_ppl": ref_held.perplexity, "code_ppl": ref_code.perplexity,
                "vocab_size": llm.model_config.vocab_size}
    return {"kind": "quant_quality", "config": config, "baseline": baseline, "rows": rows, "targets": targets(rows)}


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The chapter's targets, each with the measured value and whether it is met (None: variant not run)."""
    by = {r["name"]: r for r in rows}

    def check(name: str, key: str, ok) -> dict[str, Any]:
        if name not in by:
            return {"variant": name, "value": None, "met": None}
        return {"variant": name, "value": by[name][key], "met": bool(ok(by[name][key]))}

    return {
        "int4_g128_sym_bytes_ratio_ge_3.7": check("int4 g128 sym", "ratio_vs_bf16", lambda x: x >= 3.7),
        "int4_g128_asym_bytes_ratio_ge_3.7": check("int4 g128 asym", "ratio_vs_bf16", lambda x: x >= 3.7),
        "int8_ppl_change_le_0.5pct": check("int8", "heldout_ppl_change_pct", lambda x: x <= 0.5),
        "int4_g128_sym_gptq_ppl_change_le_3pct": check("int4 g128 sym gptq", "heldout_ppl_change_pct",
                                                       lambda x: x <= 3),
        "int4_g128_asym_gptq_ppl_change_le_3pct": check("int4 g128 asym gptq", "heldout_ppl_change_pct",
                                                        lambda x: x <= 3),
    }


def plot(result: dict[str, Any], out: str | Path) -> Path:
    """Perplexity change against compression on stories and on code (error bars: one paired standard error),
    and how often each variant's top-1 token differs from fp32's on the two workloads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["format"] != "fp32"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, dom, title in ((axes[0], "heldout", "held-out stories"), (axes[1], "code", "Python stdlib source")):
        for r in rows:
            marker = "*" if r["method"] == "gptq" else "o" if r["symmetric"] else "s"
            ax.errorbar(r["ratio_vs_bf16"], r[f"{dom}_ppl_change_pct"], yerr=100 * r[f"{dom}_nll_change_se"],
                        fmt=marker, ms=9 if marker == "*" else 5, capsize=2)
            ax.annotate(r["name"], (r["ratio_vs_bf16"], r[f"{dom}_ppl_change_pct"]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(f"{title} (fp32 perplexity {result['baseline'][f'{dom}_ppl']:.4g})")
        ax.set_xlabel("decoder-linear weights: x smaller than bf16")
        ax.set_ylabel("perplexity change vs fp32 (%)")
        ax.grid(alpha=0.3)
    ax, x = axes[2], range(len(rows))
    ax.bar([i - 0.2 for i in x], [100 * (1 - r["agreement_teacher_forced"]) for r in rows], 0.4, label="stories")
    ax.bar([i + 0.2 for i in x], [100 * (1 - r["code_agreement_teacher_forced"]) for r in rows], 0.4, label="code")
    ax.set_xticks(list(x), [r["name"] for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("top-1 next token differs from fp32 (%)")
    ax.set_title("greedy disagreement (teacher-forced)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle("Weight-only quantization of tinystories-target: bytes vs quality (o sym, s asym, * GPTQ)")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    from minifer import LLM
    from minifer.bench.machine import default_results_path, default_threads
    from minifer.bench.serving import metadata, save_result

    parser = argparse.ArgumentParser(prog="python -m minifer.bench.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tinystories-target", help="bundled name or local folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--heldout-tokens", type=int, default=50_000)
    parser.add_argument("--code-tokens", type=int, default=12_000)
    parser.add_argument("--max-len", type=int, default=512, help="tokens predicted per window")
    parser.add_argument("--calib-sequences", type=int, default=32)
    parser.add_argument("--calib-len", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts for generation agreement")
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--only", nargs="+", default=None, help="variant names to run (default: all)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(default_results_path("quant_quality.json")))
    parser.add_argument("--plot", action="store_true", help="also write the PNG next to the JSON")
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads or default_threads())
    variants = VARIANTS if args.only is None else tuple(v for v in VARIANTS if v.name in args.only)
    unknown = set(args.only or ()) - {v.name for v in VARIANTS}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {[v.name for v in VARIANTS]}")
    meta = {**metadata(argv), "command": "python -m minifer.bench.quality " + " ".join(argv)}
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype, batching="static")
    res = run_quality(llm, variants, heldout_tokens=args.heldout_tokens, code_tokens=args.code_tokens,
                      max_len=args.max_len, calib_sequences=args.calib_sequences, calib_len=args.calib_len,
                      prompts=args.prompts, gen_tokens=args.gen_tokens)
    res = {"kind": res.pop("kind"), "metadata": {**meta, "seconds": time.perf_counter() - t0}, **res}
    path = save_result(res, args.out)
    print(f"wrote {path}")
    for k, t in res["targets"].items():
        print(f"target {k}: {t['value']} -> {'met' if t['met'] else 'NOT met' if t['met'] is False else 'not run'}")
    if args.plot:
        print(f"wrote {plot(res, Path(path).with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
