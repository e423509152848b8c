"""Chapter 05's notebook helpers (minifer_course): byte counts against the formats and the quantized model,
round-trip errors and their half-step guarantee, the int4 packing drawing, the live kernel check (and that it
catches a wrong kernel), the readers of the committed kernel, AOT and quality results, the live quality
comparison and the KV-cache runs (their bookkeeping, never their speed)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest
import torch

import minifer
from minifer.kernels import HAS_TRITON, TRITON_ERROR
from minifer.model_loader import load_config, resolve_model
from minifer_course.ch05_quantization import (aot_table, check_quant_kernels, decode_weight_bytes,
    decoder_linear_shapes, int4_packing_text, kernel_speedup_table, kernel_time_fit, kv_cache_runs, live_quality,
    plot_kernel_speedups, plot_quant_quality, plot_roundtrip_errors, quality_table, quantized_linear_bytes,
    register_limited_warps, roundtrip_errors)
from minifer_course.common import ModelPair
from minifer.quantization import quantize
from minifer.quantization.linear import weight_bytes
from minifer.quantization.model import quantize_model

matplotlib.use("Agg")

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.mark.parametrize("n,k,fmt,g,sym", [(37, 96, "int8", None, True), (37, 96, "fp8", None, True),
                                           (37, 96, "int4", 32, True), (37, 96, "int4", 32, False),
                                           (8, 256, "int4", 128, False), (5, 704, "int4", 64, True)])
def test_quantized_linear_bytes_is_what_the_formats_store(n, k, fmt, g, sym):
    qw = quantize(torch.randn(n, k), fmt, group_size=g or 128, symmetric=sym)
    assert quantized_linear_bytes(n, k, fmt, g or 128, sym) == qw.nbytes()
    assert quantized_linear_bytes(n, k, "bf16") == 2 * n * k
    with pytest.raises(ValueError, match="unknown format"):
        quantized_linear_bytes(n, k, "int3")
    with pytest.raises(ValueError, match="divisible"):
        quantized_linear_bytes(4, 96, "int4", 64)


@pytest.mark.parametrize("fmt,sym", [("int8", True), ("fp8", True), ("int4", True), ("int4", False)])
def test_decode_weight_bytes_matches_a_quantized_model(fmt, sym):
    """The closed form (from config.json) and the bytes the quantized bundled model actually holds; the bundled
    down_proj has K = 704, so int4 g128 falls back to g64 there in both."""
    llm = minifer.LLM("tinystories-target", batching="static")
    quantize_model(llm.model, fmt, 128, sym)
    held = weight_bytes(llm.model)
    got = decode_weight_bytes(llm.model_config, fmt, 128, sym)
    assert got["decoder_linears"] == held["decoder_linears"]
    cfg = llm.model_config
    # kept in bf16: the lm_head and norms, and of an untied embedding table only the row a step looks up
    table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size - cfg.hidden_size
    assert got["rest_bf16"] == 2 * (held["embed_lm_head_params"] + held["other_params"] - table)
    assert got["total"] == got["decoder_linears"] + got["rest_bf16"]
    bf16 = decode_weight_bytes(cfg, "bf16")
    assert bf16["linears_vs_bf16"] == 1.0 and bf16["total_vs_bf16"] == 1.0
    assert got["total_vs_bf16"] == pytest.approx(bf16["total"] / got["total"])
    assert 1 < got["total_vs_bf16"] < got["linears_vs_bf16"]  # what stays in bf16 caps the step's gain


def test_decode_weight_bytes_llama_8b():
    cfg = load_config(resolve_model("meta-llama/Llama-3.1-8B", need_weights=False))
    shapes = decoder_linear_shapes(cfg)
    assert shapes["mlp.gate_up_proj"] == (2 * 14336, 4096) and shapes["self_attn.qkv_proj"] == (4096 + 2 * 1024, 4096)
    int4 = decode_weight_bytes(cfg, "int4", 128, True)
    assert int4["bits_per_weight"] == pytest.approx(4.25)
    assert int4["linears_vs_bf16"] == pytest.approx(16 / 4.25)
    # untied: the lm_head (vocab x hidden), the norms and one embedding row stay in bf16
    norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size
    assert int4["rest_bf16"] == 2 * (cfg.vocab_size * cfg.hidden_size + norms + cfg.hidden_size)


def test_roundtrip_errors_rows_and_guarantee():
    w = torch.randn(32, 192, generator=torch.Generator().manual_seed(0))
    rows = roundtrip_errors(w, group_sizes=(32, 64, 128))
    names = [r["name"] for r in rows]
    # 128 does not divide 192: skipped; one group per row is always there
    assert names == ["int8", "fp8", "int4 sym g32", "int4 sym g64", "int4 sym per row", "int4 asym g32",
                     "int4 asym g64", "int4 asym per row"]
    by = {r["name"]: r for r in rows}
    assert all(r["within_half_step"] for r in rows if r["format"] != "fp8")
    assert by["fp8"]["within_half_step"] is None
    assert by["int8"]["rel_error"] < by["fp8"]["rel_error"] < by["int4 asym g32"]["rel_error"]
    assert by["int4 asym g32"]["rel_error"] < by["int4 sym g32"]["rel_error"]
    assert by["int4 sym g32"]["rel_error"] < by["int4 sym per row"]["rel_error"]
    assert by["int4 sym g32"]["bits_per_weight"] == pytest.approx(4 + 32 / 32)
    assert by["int4 asym g64"]["bits_per_weight"] == pytest.approx(4 + 40 / 64)
    assert by["int4 sym per row"]["group_size"] == 192
    fig = plot_roundtrip_errors({"a": rows, "b": roundtrip_errors(w[:, :64], (32,))})
    assert len(fig.axes) == 2


def test_int4_packing_text_shows_the_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0, 7, 8]], dtype=torch.float32)
    qw = quantize(codes - 8, "int4", group_size=8)  # absmax 8 -> scale 8/7: codes are not the inputs, just check bytes
    text = int4_packing_text(qw, row=0, columns=8)
    packed = qw.qweight[0].tolist()
    for j, b in enumerate(packed):
        assert f"0x{b:02x}" in text
        assert f"{b >> 4:x}|{b & 0xF:x} (q{2 * j + 1}|q{2 * j})" in text
    with pytest.raises(ValueError, match="int4"):
        int4_packing_text(quantize(codes, "int8"))


@pytest.mark.skipif(not HAS_TRITON, reason=TRITON_ERROR)
def test_check_quant_kernels_passes_and_catches_a_wrong_kernel(monkeypatch):
    kc = check_quant_kernels(variants=(("int8", None, True), ("int4", 32, False)), runs=(("gemv", 1), ("tiled", 5)))
    assert kc.ran and kc.ok and len(kc.rows) == 4
    assert {r["path"] for r in kc.rows} == {"gemv", "tiled"}
    from minifer.kernels import quant_matmul as qm

    def half_written(x, qw, bias=None, path="auto", out=None, **kw):  # forgets the last output column
        ref = minifer.quantization.quant_linear_reference(x, qw, bias)
        out[:, :-1] = ref[:, :-1]
        return out

    monkeypatch.setattr(qm, "quant_matmul", half_written)
    bad = check_quant_kernels(variants=(("int8", None, True),), runs=(("gemv", 1),))
    assert bad.ran and not bad.ok and not bad.rows[0]["ok"]


def _row(k, n, fmt, m, path, us, us_bf16=10.0):
    nbytes = k * n // (2 if fmt == "int4" else 1)
    return {"K": k, "N": n, "format": fmt, "M": m, "path": path, "us_quant": us, "us_bf16": us_bf16,
            "speedup": us_bf16 / us, "bytes_bound": 2.0, "GBps_quant": nbytes / us / 1e3,
            "GBps_bf16": 2 * k * n / us_bf16 / 1e3, "config": f"{path} cfg"}


def test_kernel_speedup_table_takes_the_later_run_and_the_faster_path():
    old = {"copy_bandwidth_Bps": 1e12, "rows": [_row(64, 32, "int8", 1, "gemv", 4.0),
                                               _row(64, 32, "int8", 1, "splitk", 5.0),
                                               _row(64, 32, "int8", 64, "tiled", 20.0),
                                               _row(64, 32, "int4", 1, "gemv", 3.0)]}
    new = {"copy_bandwidth_Bps": 2e12, "rows": [_row(64, 32, "int8", 1, "gemv", 6.0),
                                               _row(64, 32, "int8", 1, "splitk", 5.5)]}
    rows = kernel_speedup_table({"old": old, "new": new})
    by = {(r["format"], r["M"]): r for r in rows}
    assert [(r["format"], r["M"]) for r in rows] == [("int8", 1), ("int8", 64), ("int4", 1)]
    # the later run replaced both decode measurements; splitk is now the faster one
    assert by["int8", 1]["path"] == "splitk" and by["int8", 1]["us_quant"] == 5.5 and by["int8", 1]["source"] == "new"
    assert by["int8", 1]["paths_measured"] == "gemv/splitk"
    assert by["int8", 64]["source"] == "old"
    assert by["int8", 1]["of_copy_quant"] == pytest.approx(by["int8", 1]["GBps_quant"] / 2e3)
    assert by["int4", 1]["config"] == "gemv cfg"
    assert len(plot_kernel_speedups(rows).axes) == 1


def test_kernel_time_fit_recovers_a_line():
    fixed, gbps = 5.0, 2000.0
    rows = []
    for k, n in ((1024, 1024), (1024, 4096), (4096, 1024), (4096, 4096)):
        nbytes = k * n
        us = fixed + nbytes / (gbps * 1e3)
        rows.append({**_row(k, n, "int8", 1, "splitk", us), "GBps_quant": nbytes / us / 1e3})
    fit = {f["kernel"]: f for f in kernel_time_fit(rows)}
    assert fit["bf16 torch.matmul"]["marginal_GBps"] is None  # _row's bf16 time does not grow with the bytes
    assert fit["int8 (splitk)"]["fixed_us"] == pytest.approx(fixed)
    assert fit["int8 (splitk)"]["marginal_GBps"] == pytest.approx(gbps)
    assert fit["int8 (splitk)"]["points"] == 4
    assert kernel_time_fit(rows, m=16) == []


def test_register_limited_warps_and_aot_table():
    assert register_limited_warps(188, 4) == 8  # 192 registers x 32 threads = 6 KiB registers per warp -> 10 -> 8
    assert register_limited_warps(50, 4) == 36
    assert register_limited_warps(16, 4) == 64  # capped at 64 warps per SM
    assert register_limited_warps(255, 8) == 8
    report = {"kernels": [
        {"kernel": "quant_gemv[x]", "arch": "sm_80", "num_warps": 4, "num_stages": 2, "registers": 188,
         "shared_bytes": 512, "spill_stores": 0, "spill_loads": 0},
        {"kernel": "quant_gemv[x]", "arch": "sm_90", "num_warps": 4, "num_stages": 2, "registers": 128,
         "shared_bytes": 512, "spill_stores": 2, "spill_loads": 3, "instructions_per_weight": 4.6},
        {"kernel": "paged_decode", "arch": "sm_80", "num_warps": 4, "num_stages": 3, "registers": 64,
         "shared_bytes": 0, "spill_stores": 0, "spill_loads": 0}]}
    rows = aot_table(report)
    assert rows == [{"kernel": "quant_gemv[x]", "num_warps": 4, "num_stages": 2, "regs_80": 188, "smem_80": 512,
                     "spills_80": 0, "warps_80": 8, "ipw_80": None, "regs_90": 128, "smem_90": 512, "spills_90": 5,
                     "warps_90": 16, "ipw_90": 4.6}]
    committed = aot_table(json.loads((RESULTS / "aot_report.json").read_text()))
    assert committed and all(r["kernel"].startswith("quant_") for r in committed)


def test_quality_table_and_plot_on_the_committed_result():
    res = json.loads((RESULTS / "quant_quality.json").read_text())
    rows = quality_table(res)
    by = {r["name"]: r for r in rows}
    assert by["fp32"]["code_over_stories"] is None
    r = by["int4 g128 sym"]
    assert r["code_over_stories"] == pytest.approx((1 - r["code_agreement_teacher_forced"])
                                                   / (1 - r["agreement_teacher_forced"]))
    assert r["heldout_se_pct"] == pytest.approx(100 * r["heldout_nll_change_se"])
    assert "quantization" not in r and "weight_bytes" not in r
    assert len(plot_quant_quality(res).axes) == 2


def test_live_quality_against_itself_and_int8():
    import minifer.eval as ev

    ref = minifer.LLM("tinystories-target", batching="static")
    q8 = minifer.LLM("tinystories-target", batching="static", quantization="int8")
    tok = ref.get_tokenizer()
    windows = {"stories": ev.heldout_windows(tok, max_len=32, max_tokens=96)}
    prompts = ev.heldout_prompts(tok, n=2, length=6)
    rows = live_quality({"ref": ref, "int8": q8.model}, "ref", windows, prompts, n_tokens=4)
    assert [r["model"] for r in rows] == ["ref", "int8"]
    assert rows[0]["stories_change_pct"] == 0 and rows[0]["stories_top1"] == 1 and rows[0]["generation_agreement"] == 1
    assert rows[0]["stories_ppl"] == pytest.approx(ev.perplexity(ref, windows["stories"]))
    assert rows[1]["stories_ppl"] == pytest.approx(ev.perplexity(q8, windows["stories"]))
    assert 0.9 < rows[1]["stories_top1"] <= 1
    with pytest.raises(ValueError, match="reference"):
        live_quality({"a": ref}, "b", windows, prompts)


def test_kv_cache_runs_budget_buys_more_int8_blocks():
    pair = ModelPair("tinystories-target", "tinystories-draft", "cpu", "test")
    rows = kv_cache_runs(pair, ("auto", "int8"), ["Once upon a time", "The dog"], max_tokens=6, max_num_seqs=4,
                         enable_prefix_caching=False, kv_cache_memory=4 * 2**20)
    auto, int8 = rows
    assert auto["model_dtype"] == "float32" and auto["bytes_per_token"] == 6144 and int8["bytes_per_token"] == 1632
    # whole blocks of the budget, less the cache's scratch and null blocks (PagedKVCache.RESERVED_BLOCKS)
    assert auto["kv_blocks_total"] == 4 * 2**20 // (6144 * 16) - 2
    assert int8["kv_blocks_total"] == 4 * 2**20 // (1632 * 16) - 2
    assert auto["token_agreement"] == 1.0 and auto["identical_sequences"] == auto["sequences"] == 2
    assert 0 <= int8["token_agreement"] <= 1
