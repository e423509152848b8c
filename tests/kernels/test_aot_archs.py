"""Every Triton kernel compiles ahead of time for the GPUs learners have, without spills: sm_75 (T4), sm_80
(A100), sm_89 (L4), sm_90 (H100/H200). sm_80 and sm_90 are compiled by test_kernels.py and
test_quant_kernels.py; this compiles sm_75 and sm_89 and checks the committed four-architecture report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minifer_course.experiments import aot
from minifer.kernels import quant_matmul as qm

REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "aot_report_archs.json"
# shared memory one block may use: 64 KiB on Turing, 99 KiB on Ada, 163 KiB on A100, 227 KiB on Hopper
SHARED_LIMIT = {"sm_75": 64 * 1024, "sm_80": 163 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024}


def test_turing_compiles_in_float16_with_its_own_configs_and_fp8_is_native_from_sm89():
    t4 = {s.name: s for s in aot.kernel_specs(75)}
    a100 = {s.name: s for s in aot.kernel_specs(80)}
    assert all("*bf16" not in s.signature.values() for s in t4.values())
    assert all(s.constexprs.get("XKIND", qm.X_FP16) == qm.X_FP16 for s in t4.values())
    assert "quant_gemm[int8,tiled,32x64x32]" in t4 and "quant_gemm[int8,tiled,64x128x64]" in a100
    assert set(t4) != set(a100) and len(t4) == len(a100)  # the same kernels and paths, other tiles
    fp8 = next(s for s in a100.values() if s.name.startswith("quant_gemv[fp8"))
    assert {cc for cc, c in fp8.arch_constexprs.items() if c.get("FP8_NATIVE")} == {89, 90}
    assert qm.gpu_configs("tiled", turing=True) is qm.TURING_CONFIGS["tiled"]
    assert qm.gpu_configs("gemv", turing=True) is qm.GPU_GEMV_CONFIGS


@pytest.mark.slow
def test_every_kernel_compiles_for_sm75_and_sm89_without_spills():
    rows = aot.compile_all((75, 89))
    assert len(rows) == len(aot.kernel_specs(75)) + len(aot.kernel_specs(89))
    for r in rows:
        assert r["cubin_bytes"] > 0 and r["registers"] > 0, r
        assert not r["spills"], f"{r['kernel']} spills registers on {r['arch']}: {r}"
        assert r["shared_bytes"] <= SHARED_LIMIT[r["arch"]], r


def test_the_committed_report_covers_four_architectures_without_spills():
    """``python -m minifer_course.experiments.aot --ccs 75 80 89 90 --out benchmarks/results/aot_report_archs.json``:
    every kernel as each architecture compiles it, none spilling. A config list changed without regenerating it fails here."""
    report = json.loads(REPORT.read_text())
    rows = {(r["kernel"], r["arch"]): r for r in report["kernels"]}
    want = {(s.name, f"sm_{cc}") for cc in aot.ALL_CCS for s in aot.kernel_specs(cc)}
    assert set(rows) == want
    assert set(report["ptxas"]) == {f"sm_{cc}" for cc in aot.ALL_CCS}
    for (name, arch), r in rows.items():
        assert not r["spills"] and r["spill_stores"] == r["spill_loads"] == 0, (name, arch, r)
        assert 0 < r["registers"] <= 255 and r["shared_bytes"] <= SHARED_LIMIT[arch], (name, arch, r)
