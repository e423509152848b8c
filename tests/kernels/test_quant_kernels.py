"""Fused dequantize-matmul Triton kernels vs ``quant_linear_reference`` (the interpreter on CPU, native on a
GPU): every format, path and split, odd shapes, poisoned outputs and split-K workspace; bad inputs; the
ahead-of-time compile for sm_80 / sm_90; the GPU benchmark's pipeline on tiny shapes."""

from __future__ import annotations

import json

import pytest
import torch

from minifer.kernels import HAS_TRITON, TRITON_ERROR
from minifer.quantization import quant_linear_reference, quantize

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason=TRITON_ERROR)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}

# (format, symmetric, group size, K, N): K and N off the block sizes; int4 needs K % group == 0.
CASES = [("int8", True, None, 100, 37), ("fp8", True, None, 100, 37), ("int4", True, 32, 160, 37),
         ("int4", False, 64, 192, 45), ("int4", True, 128, 256, 24), ("int4", False, 32, 96, 33)]
RUNS = [("gemv", 1), ("gemv", 3), ("splitk", 1), ("splitk", 3), ("splitk", 16), ("tiled", 1), ("tiled", 17),
        ("tiled", 40)]


def _case(fmt, symmetric, group, k, n, m, dtype, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    w[1] = 0.0  # an all-zero output channel
    qw = quantize(w, fmt, group_size=group or 128, symmetric=symmetric).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, qw, b


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Split-K scratch filled with NaN: a partial sum read before it is written poisons the output."""
    from minifer.kernels import quant_matmul as qm

    monkeypatch.setattr(qm, "_workspace", lambda numel, device: torch.full((numel,), float("nan"), device=device))


def _run(x, qw, b, path, split_k=None):
    from minifer.kernels.quant_matmul import quant_matmul

    out = torch.full((x.shape[0], qw.shape[0]), float("nan"), dtype=x.dtype, device=x.device)  # poisoned
    res = quant_matmul(x, qw, b, path=path, split_k=split_k, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all(), "an output element was not written"
    return out


@pytest.mark.parametrize("fmt,symmetric,group,k,n", CASES)
@pytest.mark.parametrize("path,m", RUNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(fmt, symmetric, group, k, n, path, m, dtype, poisoned_workspace):
    x, qw, b = _case(fmt, symmetric, group, k, n, m, dtype, seed=k + m)
    out = _run(x, qw, b, path)
    ref = quant_linear_reference(x.float(), qw, b.float())  # float32 reference, float32 inputs
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("fmt,symmetric,group,k,n", CASES[:5])
@pytest.mark.parametrize("path", ["gemv", "splitk", "tiled"])
def test_float16_activations(fmt, symmetric, group, k, n, path):
    x, qw, b = _case(fmt, symmetric, group, k, n, 2, torch.float16, seed=7)
    assert _rel(_run(x, qw, b, path), quant_linear_reference(x.float(), qw, b.float())) < TOL[torch.float16]


@pytest.mark.parametrize("path", ["gemv", "splitk", "tiled"])
@pytest.mark.parametrize("split_k", [1, 2, 3, 16])
@pytest.mark.parametrize("fmt,symmetric,group", [("int4", False, 32), ("int4", False, 64), ("int8", True, None)])
def test_every_split_of_k_gives_the_same_answer(path, split_k, fmt, symmetric, group, poisoned_workspace):
    """1 (no workspace), uneven splits, and more splits than K-steps (capped, some programs get none)."""
    from minifer.kernels import quant_matmul as qm

    x, qw, b = _case(fmt, symmetric, group, 256, 40, 2, torch.float32, seed=split_k)
    out = _run(x, qw, b, path, split_k=split_k)
    assert _rel(out, quant_linear_reference(x, qw, b)) < 1e-5
    # The arrival counters were reset by the last program of each tile: the next launch starts clean.
    assert not qm._locks[x.device].any()
    torch.testing.assert_close(_run(x, qw, b, path, split_k=split_k), out, rtol=0, atol=0)  # deterministic


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU picks the fp8 decoding its architecture has")
@pytest.mark.parametrize("path", ["gemv", "tiled"])
def test_fp8_native_conversion_path(monkeypatch, path):
    """The hardware e4m3 conversion (sm_89+) and the bit-arithmetic one (sm_80) give the same numbers."""
    from minifer.kernels import quant_matmul as qm

    x, qw, b = _case("fp8", True, None, 96, 20, 3, torch.float32, seed=3)
    soft = _run(x, qw, b, path)
    monkeypatch.setattr(qm, "fp8_native", lambda device: True)
    native = _run(x, qw, b, path)
    torch.testing.assert_close(native, soft, rtol=1e-6, atol=1e-6)
    assert _rel(native, quant_linear_reference(x, qw, b)) < 1e-5


@pytest.mark.parametrize("path", ["gemv", "tiled"])
def test_every_fp8_bit_pattern_decodes_exactly(path):
    """All 254 non-NaN codes (subnormals, both zeros, +-448): row n of W holds code n in column 0, and
    x = e_0 reads that column out exactly."""
    from minifer.quantization import QuantizedWeight

    bits = torch.arange(256, dtype=torch.uint8)
    bits = bits[(bits & 0x7F) != 0x7F]  # the two NaN codes never occur in quantized weights
    codes = torch.zeros(bits.numel(), 64, dtype=torch.uint8)
    codes[:, 0] = bits
    n = bits.numel()
    qw = QuantizedWeight("fp8", codes.view(torch.float8_e4m3fn), torch.ones(n), None, None, (n, 64)).to(DEVICE)
    x = torch.zeros(1, 64, device=DEVICE)
    x[0, 0] = 1.0
    out = _run(x, qw, None, path)
    torch.testing.assert_close(out[0].cpu(), bits.view(torch.float8_e4m3fn).float(), rtol=0, atol=0)


def test_auto_path_batched_leading_dims_and_empty():
    from minifer.kernels.quant_matmul import quant_matmul

    x, qw, b = _case("int4", True, 32, 128, 24, 6, torch.float32, seed=1)
    y = quant_matmul(x.view(2, 3, 128), qw, b)
    assert y.shape == (2, 3, 24)
    assert _rel(y.view(6, 24), quant_linear_reference(x, qw, b)) < 1e-5
    assert quant_matmul(x[:0], qw).shape == (0, 24)
    # a group size the tensor-core paths cannot take: auto falls back to gemv
    x, qw, b = _case("int4", False, 16, 64, 24, 20, torch.float32, seed=2)
    assert _rel(quant_matmul(x, qw, b), quant_linear_reference(x, qw, b)) < 1e-5


def test_int4_decodes_on_tensor_cores_in_its_own_kernel_when_a_group_holds_64_codes():
    """splitk and tiled for int4 take quant_int4_mma_kernel (K-steps of 64 or 128 codes inside one group), each
    with its own configs; groups of 32 take quant_gemm_kernel, which reads bytes and activation pairs."""
    from minifer.kernels import quant_matmul as qm

    for group, tuner in ((64, ("int4_mma", 64)), (128, ("int4_mma", 128)), (192, ("int4_mma", 64)),
                         (32, ("splitk", 32))):
        p = qm.plan("splitk", 4, 24, 384, qm.INT4, group)
        assert p.tuner == tuner, group
        assert (p.words, p.x_pairs) == ((True, False) if tuner[0] == "int4_mma" else (False, True))
        assert all(group % c.kwargs["BLOCK_K"] == 0 and c.kwargs["BLOCK_K"] >= 32 for c in p.configs)
    assert qm.plan("tiled", 40, 24, 384, qm.INT4, 128).tuner == ("int4_mma_tiled", 128)
    assert qm.plan("tiled", 40, 24, 384, qm.INT4, 32).tuner == ("tiled", 32)
    assert qm.plan("gemv", 1, 24, 384, qm.INT4, 128).words
    assert qm.plan("splitk", 4, 24, 384, qm.INT8, 0).tuner == ("splitk", 0)
    assert all(c.kwargs["BLOCK_K"] >= 64 and c.kwargs["BLOCK_M"] in (8, 16) for c in qm.GPU_INT4_MMA_CONFIGS)
    assert all(c.kwargs["BLOCK_K"] >= 64 and c.kwargs["BLOCK_M"] >= 32 for c in qm.GPU_INT4_MMA_TILED_CONFIGS)


@pytest.mark.parametrize("one_dot", [True, False])
@pytest.mark.parametrize("group,symmetric", [(128, False), (192, True), (192, False), (256, True)])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_int4_tensor_core_decode_on_other_groups(group, symmetric, m, one_dot, monkeypatch, poisoned_workspace):
    """quant_int4_mma_kernel with K-steps of 64 codes inside groups of 192 (three per group), groups of 256,
    and zero points (subtracted after the dot as z * sum(x)); in both its forms (one dot per K-step, as on
    sm_90, and one per code plane, as on sm_80)."""
    from minifer.kernels import quant_matmul as qm

    monkeypatch.setattr(qm, "_one_dot", lambda device: one_dot)
    x, qw, b = _case("int4", symmetric, group, 2 * group if group > 128 else 384, 20, m, torch.float32, seed=m)
    assert _rel(_run(x, qw, b, "splitk"), quant_linear_reference(x, qw, b)) < 1e-5


@pytest.mark.parametrize("fmt,symmetric,group,k,n", [c for c in CASES if c[0] == "int4" and c[2] % 64 == 0])
@pytest.mark.parametrize("path,m", [r for r in RUNS if r[0] != "gemv"])
def test_int4_tensor_core_kernel_one_dot_per_code_plane(fmt, symmetric, group, k, n, path, m, monkeypatch,
                                                        poisoned_workspace):
    """The sm_80 form of quant_int4_mma_kernel (``ONE_DOT=False``; the CPU runs the sm_90 form by default,
    in ``test_kernel_matches_reference``) on the same cases, bf16 activations."""
    from minifer.kernels import quant_matmul as qm

    monkeypatch.setattr(qm, "_one_dot", lambda device: False)
    x, qw, b = _case(fmt, symmetric, group, k, n, m, torch.bfloat16, seed=k + m)
    assert _rel(_run(x, qw, b, path), quant_linear_reference(x.float(), qw, b.float())) < TOL[torch.bfloat16]


def test_auto_chooses_its_path_by_rule_and_times_nothing(monkeypatch):
    """path="auto" is a static rule (``auto_path``): even where the kernels are autotuned, its first call at one
    row times no kernel against another to choose a path."""
    import triton.testing

    from minifer.kernels import quant_matmul as qm

    def no_timing(*a, **k):
        raise AssertionError("quant_matmul timed a kernel to choose its path")

    monkeypatch.setattr(qm, "AUTOTUNE", True)
    monkeypatch.setattr(triton.testing, "do_bench", no_timing)
    x, qw, b = _case("int4", True, 128, 256, 24, 1, torch.float32, seed=4)
    assert qm.auto_path(1, qw) == "gemv"
    assert _rel(qm.quant_matmul(x, qw, b), quant_linear_reference(x, qw, b)) < 1e-5


def test_auto_path_by_format_and_rows():
    from minifer.kernels.quant_matmul import auto_path

    int4, int8 = quantize(torch.randn(8, 256), "int4", 128), quantize(torch.randn(8, 256), "int8")
    assert [auto_path(m, int4) for m in (1, 2, 16, 17)] == ["gemv", "splitk", "splitk", "tiled"]
    assert [auto_path(m, int8) for m in (1, 16, 17)] == ["splitk", "splitk", "tiled"]
    assert auto_path(64, quantize(torch.randn(8, 256), "int4", 16)) == "gemv"  # no tl.dot path for g=16


def test_choose_split():
    from minifer.kernels.quant_matmul import MAX_SPLIT, choose_split

    assert choose_split(tiles=1000, k_steps=64, sms=132, per_sm=1) == 1  # enough programs already
    assert choose_split(tiles=32, k_steps=64, sms=132, per_sm=4) == MAX_SPLIT
    assert choose_split(tiles=8, k_steps=3, sms=132, per_sm=4) == 1  # K too short to split
    # int4 M=1 on 4096x14336 (H200): 112 tiles of 128 rows; the configs' per_sm of 4, 3, 2 give 5, 4, 3 splits
    assert [choose_split(tiles=112, k_steps=32, sms=132, per_sm=p) for p in (4, 3, 2)] == [5, 4, 3]


def test_autotune_configs_try_several_splits():
    """Each tile config comes with several SPLIT_PER_SM values (a runtime argument: no extra compiles)."""
    from minifer.kernels import quant_matmul as qm

    for configs, values in ((qm.GPU_GEMV_CONFIGS, {2, 3, 4}), (qm.GPU_SPLITK_CONFIGS, {2, 4, 8}),
                            (qm.GPU_INT4_MMA_CONFIGS, {1, 2, 4, 8})):
        tiles = {}
        for c in configs:
            key = tuple(sorted((k, v) for k, v in c.kwargs.items() if k != "SPLIT_PER_SM")) + (c.num_warps,)
            tiles.setdefault(key, set()).add(c.kwargs["SPLIT_PER_SM"])
        assert len(tiles) > 1 and all(v == values for v in tiles.values()), tiles
    assert {c.kwargs["SPLIT_PER_SM"] for c in qm.GPU_TILED_CONFIGS} == {1}


def test_bad_inputs_raise_clear_errors():
    from minifer.kernels.quant_matmul import quant_matmul

    x, qw, b = _case("int4", True, 32, 64, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float16"):
        quant_matmul(x.to(torch.int32), qw)
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float16"):
        quant_matmul(x.double(), qw)
    with pytest.raises(ValueError, match="expects K=64"):
        quant_matmul(x[:, :32], qw)
    with pytest.raises(ValueError, match="bias must have shape"):
        quant_matmul(x, qw, b[:5])
    with pytest.raises(ValueError, match="path must be one of"):
        quant_matmul(x, qw, path="fast")
    with pytest.raises(ValueError, match="split_k must be in"):
        quant_matmul(x, qw, split_k=0)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        quant_matmul(x, qw, out=torch.empty(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="scales has shape"):
        qw.scales = qw.scales[:, :1]
        quant_matmul(x, qw)
    x, qw, _ = _case("int4", True, 16, 64, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="path 'tiled' needs an int4 group size that is a multiple of 32"):
        quant_matmul(x, qw, path="tiled")
    x, qw, _ = _case("int4", True, 6, 48, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        quant_matmul(x, qw)


def test_an_outgrown_split_k_counter_buffer_is_never_freed():
    """A CUDA graph records the counters' address; freeing an outgrown buffer would let another tensor take
    that memory while the graph's replays still count (and reset) in it."""
    import gc
    import weakref

    from minifer.kernels import quant_matmul as qm

    device = torch.device(DEVICE)
    first = qm._lock_buffer(device, 8)
    assert qm._lock_buffer(device, first.numel()) is first  # big enough: reused
    alive = weakref.ref(first)
    grown = qm._lock_buffer(device, first.numel() + 1)
    assert grown.numel() > first.numel() and qm._locks[device] is grown
    del first
    gc.collect()
    assert alive() is not None, "the outgrown buffer was freed"


def test_strided_weights_and_bias_are_refused():
    """The kernels index by shape alone: a strided view would be read as if packed, silently wrong."""
    from minifer.kernels.quant_matmul import quant_matmul

    x, qw, b = _case("int8", True, None, 64, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="bias must be contiguous"):
        quant_matmul(x, qw, torch.stack([b, b], 1)[:, 0])
    qw.qweight = torch.cat([qw.qweight, qw.qweight], 1)[:, :64]
    with pytest.raises(ValueError, match="qweight must be contiguous"):
        quant_matmul(x, qw)


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU-without-interpreter message")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    from minifer.kernels import quant_matmul as qm

    monkeypatch.setattr(qm, "INTERPRETING", False)
    x, qw, _ = _case("int8", True, None, 64, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        qm.quant_matmul(x, qw)


def test_aot_signatures_list_each_kernels_parameters_in_order():
    """The divisibility hints of an ahead-of-time compile are keyed by parameter position: a signature in
    another order than the kernel's parameters would put them on the wrong arguments."""
    from minifer_course.experiments import aot

    for spec in aot.kernel_specs():
        assert list(spec.signature) == aot._jit(spec.kernel).arg_names, spec.name


def test_quant_kernels_compile_ahead_of_time_for_sm80_and_sm90():
    from minifer_course.experiments.aot import compile_all, quant_matmul_specs

    specs = quant_matmul_specs()
    assert {s.kernel.__name__ if hasattr(s.kernel, "__name__") else s.kernel.fn.__name__ for s in specs} >= {
        "quant_gemv_kernel", "quant_gemm_kernel", "quant_int4_mma_kernel"}
    rows = compile_all(specs=specs)
    # {int8, int4, int4-asym, fp8} x {gemv, splitk, tiled}, and int4 in groups of 32 on {splitk, tiled}
    assert len(rows) == 2 * len(specs) == 2 * (4 * 3 + 2)
    for r in rows:
        assert r["cubin_bytes"] > 0 and r["registers"] > 0, r
        assert not r["spills"], f"{r['kernel']} spills registers on {r['arch']}: {r}"
        assert r["shared_bytes"] <= 100 * 1024, r
        assert r["loop_instructions"] > 0 and r["instructions_per_weight"] > 0, r
    # The point of the int4 tensor-core kernel: fewer instructions per weight than the CUDA-core gemv (on
    # sm_90 about 2.4 vs 4.6 symmetric, 2.5 vs 5.0 asymmetric, 51% and 50%); a main loop at 68% of gemv's
    # count or more fails here (the kernel's earlier form, one dot per code plane, was at 3.3 and 4.3: 72%
    # and 85%).
    per_weight = {(r["kernel"], r["arch"]): r["instructions_per_weight"] for r in rows}
    for fmt in ("int4", "int4-asym"):
        mma = per_weight[f"quant_int4_mma[{fmt},16x128x128]", "sm_90"]
        assert mma < 0.68 * per_weight[f"quant_gemv[{fmt},BN=128,chunks=1]", "sm_90"], per_weight
    # One logic op per two codes (_int4_pairs' lop3), which ptxas does not always find by itself: the AND
    # and the OR as two PTX ops came to 2.45 per weight on sm_90 with CUDA 13.4's ptxas (Triton 3.9's) and
    # to 2.85 with 12.8's (Triton 3.6's, the H200 machine's); written as one lop3, 2.36 with both.
    assert per_weight["quant_int4_mma[int4,16x128x128]", "sm_90"] <= 2.40, per_weight
    # Zero points cost one register operand: each code subtracts 128 + z, its row's, where the symmetric
    # kernel subtracts the immediate 136 (2.49 vs 2.36). Subtracting z * sum(x) from the product instead
    # came to 3.02.
    assert per_weight["quant_int4_mma[int4-asym,16x128x128]", "sm_90"] <= 1.1 * per_weight[
        "quant_int4_mma[int4,16x128x128]", "sm_90"], per_weight


def test_the_all_configs_report_covers_every_autotuning_config():
    """``aot_report_all_configs.json`` (``python -m minifer_course.experiments.aot --all-configs``) must hold every
    distinct config of the GPU's autotuning lists for both GPUs: a list changed without regenerating it fails here.
    The configs CI compiles (the first of each list) must not spill there either."""
    from pathlib import Path

    from minifer_course.experiments.aot import quant_matmul_specs

    report = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                         / "aot_report_all_configs.json").read_text())
    rows = {(r["kernel"], r["arch"]): r for r in report["kernels"]}
    names = [s.name for s in quant_matmul_specs(all_configs=True)]
    assert len(set(names)) == len(names)
    assert set(rows) == {(n, arch) for n in names for arch in ("sm_80", "sm_90")}
    firsts = {s.name.removesuffix("]") for s in quant_matmul_specs()}
    for (name, arch), r in rows.items():
        if name.rsplit(",", 1)[0] in firsts:
            assert not r["spills"], f"{name} on {arch}: the config CI compiles spills here"


def test_benchmark_smoke(tmp_path):
    """The GPU benchmark's whole pipeline (correctness check, timers, report, CLI) on tiny shapes."""
    from minifer.bench import quant_kernels as bench

    device = DEVICE
    res = bench.run(device, shapes=((128, 40),), ms=(1, 17), formats=("int4", "fp8"), group_size=64, rounds=2,
                    calls=1, extra_paths=False)
    json.dumps(res)
    assert [(r["format"], r["M"], r["path"]) for r in res["rows"]] == [
        ("int4", 1, "gemv"), ("int4", 17, "tiled"), ("fp8", 1, "splitk"), ("fp8", 17, "tiled")]
    for r in res["rows"]:
        assert r["rel_err"] < 1e-2 and r["us_quant"] > 0 and r["us_bf16"] > 0 and r["speedup"] > 0
        assert 1 < r["bytes_bound"] < 4
    assert res["copy_bandwidth_Bps"] > 0 and res["environment"]["triton"]
    from minifer.kernels.quant_matmul import _one_dot

    assert res["environment"]["int4_mma_one_dot"] is _one_dot(torch.device(device))  # the form that ran
    assert res["targets"][0]["measured_speedup"] is None  # the target shape was not run
    if device == "cpu":
        out = tmp_path / "q.json"
        assert bench.main(["--device", "cpu", "--smoke", "--formats", "int8", "--no-extra-paths", "--out",
                           str(out)]) == 0
        saved = json.loads(out.read_text())
        assert {r["M"] for r in saved["rows"]} == {1, 3, 17}
        assert saved["command"].startswith("python -m minifer.bench.quant_kernels --device cpu --smoke")
        assert saved["timestamp"] and saved["environment"]["git"]["commit"]
        if saved["environment"]["git"]["dirty"]:  # a tree that differs from its commit is fingerprinted
            assert len(saved["environment"]["git"]["diff_sha256"]) == 64
    assert res["split_sweeps"] == []  # the sweep runs only for cases among those benchmarked


def test_benchmark_runs_the_target_case_first_and_checkpoints_every_row(monkeypatch):
    """On a lent GPU with a time limit, the target's case comes first and every row is saved as it comes."""
    from minifer.bench import quant_kernels as bench

    monkeypatch.setattr(bench, "TARGETS", [{"format": "fp8", "K": 128, "N": 40, "M": 3, "min_speedup": 1.0,
                                            "why": "a test"}])
    saved = []
    res = bench.run(DEVICE, shapes=((128, 40),), ms=(1, 3), formats=("int8", "fp8"), group_size=64, rounds=1,
                    calls=1, extra_paths=False, sweeps=(), checkpoint=lambda partial: saved.append(json.dumps(partial)))
    assert [(r["format"], r["M"]) for r in res["rows"]] == [("fp8", 3), ("int8", 1), ("int8", 3), ("fp8", 1)]
    assert [len(json.loads(p)["rows"]) for p in saved] == [1, 2, 3, 4]
    assert json.loads(saved[0])["targets"][0]["measured_speedup"] is not None  # the target, measured first


def test_a_target_is_met_only_by_a_fast_and_correct_kernel(monkeypatch):
    from minifer.bench import quant_kernels as bench

    monkeypatch.setattr(bench, "TARGETS", [{"format": "int4", "K": 64, "N": 32, "M": 1, "min_speedup": 3.0,
                                            "why": "a test"}])
    row = {"format": "int4", "K": 64, "N": 32, "M": 1, "auto": True, "speedup": 3.2, "rel_err": 3e-3}
    assert bench.check_targets([row])[0]["met"] is True
    assert bench.check_targets([{**row, "speedup": 2.9}])[0]["met"] is False
    wrong = bench.check_targets([{**row, "rel_err": 0.5}])[0]  # fast and wrong
    assert wrong["met"] is False and wrong["rel_err"] == 0.5
    assert bench.check_targets([{**row, "auto": False}])[0]["met"] is None  # not the auto path: not measured


def test_split_sweep_times_every_split():
    from minifer.bench import quant_kernels as bench
    from minifer.kernels.quant_matmul import choose_split

    sweep = bench.split_sweep(256, 96, 1, "int4", torch.device(DEVICE), group_size=32, rounds=2, calls=1)
    json.dumps(sweep)
    assert sweep["path"] == "gemv" and sweep["k_steps"] >= 2
    assert [r["split"] for r in sweep["rows"]] == list(range(1, min(16, sweep["k_steps"]) + 1))
    assert all(r["us"] > 0 and r["speedup"] > 0 for r in sweep["rows"])
    per_sm = int(sweep["config"].split("SPLIT_PER_SM: ")[1].split(",")[0])
    assert sweep["chosen"] == choose_split(sweep["tiles"], sweep["k_steps"], sweep["sms"], per_sm)
