"""The chapter helpers added for the core path: the predict-then-run verdict, chapter 01's real-shape
comparison, chapter 05's datasheet ceilings and its literature table built from the committed JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from minifer_course.common import check_prediction

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_a_missing_prediction_is_not_an_error():
    assert "no prediction written" in check_prediction(None, 75.3, "tokens/s")
    assert "must be positive" in check_prediction(0, 75.3, "tokens/s")


@pytest.mark.parametrize("prediction, verdict", [(500, "far lower"), (60, "within 2x"), (10, "far higher")])
def test_a_prediction_is_set_beside_the_measurement(prediction, verdict):
    text = check_prediction(prediction, 75.0, "tokens/s")
    assert verdict in text and f"{75.0 / prediction:.2f}x your number" in text


def test_spec_ceilings_are_labelled_and_computed_from_the_datasheet_bandwidths():
    from minifer_course.ch05_quantization import SPEC_GPUS, decode_ceiling_rows

    step = [{"label": "bf16", "total": 16e9, "total_vs_bf16": 1.0}, {"label": "int4", "total": 5e9, "total_vs_bf16": 3.2}]
    rows = decode_ceiling_rows(step, {"H200 (measured)": 4.3e12})
    assert [r["gpu"] for r in rows] == ["H200 (measured)"] * 2 + ["T4 (spec)"] * 2 + ["L4 (spec)"] * 2
    assert SPEC_GPUS == {"T4 (spec)": 320e9, "L4 (spec)": 300e9}
    t4_int4 = next(r for r in rows if r["gpu"] == "T4 (spec)" and r["format"] == "int4")
    assert t4_int4["tok_s"] == pytest.approx(320e9 / 5e9)


def test_chapter05_literature_table_renders_from_the_committed_results():
    from minifer_course import ch05_quantization as ch5
    from minifer.model_loader import load_config, resolve_model

    qual = json.loads((RESULTS / "quant_quality.json").read_text())
    kern = json.loads((RESULTS / "quant_kernels_h200_decode.json").read_text())
    sweep = json.loads((RESULTS / "quant_kernels_h200.json").read_text())
    kvq = json.loads((RESULTS / "kv_quant.json").read_text())
    qt = ch5.quality_table(qual)
    krows = ch5.kernel_speedup_table({"sweep": sweep, "decode": kern})
    cfg = load_config(resolve_model("meta-llama/Llama-3.1-8B", need_weights=False))
    step = [ch5.decode_weight_bytes(cfg, fmt, 128, True) for fmt in ("bf16", "int8", "int4")]
    flips = [r["code_over_stories"] for r in qt if r["code_over_stories"] is not None]
    table = ch5.literature_summary(qt=qt, krows=krows, kvq=kvq, qual=qual, kern=kern, step=step, flips=flips,
                                   name="meta-llama/Llama-3.1-8B")
    assert table.count("\n| ") == 5 and "not met" in table  # five claims; the int4 kernel target is missed


def test_real_shape_comparison_reports_what_the_chapter_prints():
    """On the bundled model (seconds): every figure is there and finite; no verdict depends on the timings."""
    from minifer import LLM
    from minifer_course.ch01_diagnose import DECODE_COMPARISON_COLUMNS, decode_comparison_rows, decode_vs_weight_reads

    llm = LLM("tinystories-target", device="cpu", num_kv_blocks=16)
    run = decode_vs_weight_reads(llm.model, context=16, rounds=2)
    row = decode_comparison_rows({"bundled": run})[0]
    assert set(DECODE_COMPARISON_COLUMNS) == set(row)
    assert all(math.isfinite(v) and v > 0 for k, v in row.items() if k != "model")
    assert run["weight_bytes"] == run["step"].cost.weight_bytes
