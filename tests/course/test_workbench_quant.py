"""Exercise 05's pieces inside the engine (``minifer_course.workbench_quant``, ``minifer_course.grading.quant_engine``):
the solutions of the quantizer, the load step and the Triton kernel (under the interpreter) serve minifer's int4
engine's tokens with log-probabilities within the bound; a wrong piece is stopped by its grader, hint first, before
any engine is built; a piece that passes its grader but breaks in the engine is named; a kernel that passes the
grader's tolerance but rounds to bf16 is caught by the teacher-forced bound; saved pieces load in a fresh namespace,
and ``solution=True`` fills the gaps.

The pieces come from the exercise source itself (``tools/build_exercises.py`` renders each twin's cells).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from minifer_course import workbench, workbench_quant, workbench_save
from minifer_course.grading import engine as graded
from minifer_course.grading import quant_engine
from minifer_course.grading.quant import triton_modules
from minifer.kernels import HAS_TRITON, TRITON_ERROR
from minifer.quantization.formats import QuantizedWeight, quant_linear_reference, quantize, quantize_int4
from minifer.quantization.linear import QuantLinear, decoder_linears

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_workbench import definitions  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=TRITON_ERROR)
STEM = "05_quantization"


def exercise_pieces(variant: str) -> dict:
    """Exercise 05's pieces in ``variant`` (``solution`` or ``exercise``), defined as its notebook defines them (its
    first cell makes ``triton`` and ``tl``)."""
    triton, tl, _ = triton_modules()
    scope = definitions(variant, [STEM], {"triton": triton, "tl": tl})
    return {name: scope[name] for name in [*workbench_quant.QUANT_PIECES, "int4_matmul_torch"]}


@pytest.fixture(scope="module")
def solutions():
    return exercise_pieces("solution")


@pytest.fixture(scope="module")
def stubs():
    return exercise_pieces("exercise")


@pytest.fixture(autouse=True)
def my_engine(tmp_path, monkeypatch):
    monkeypatch.setenv(workbench.FOLDER_ENV, str(tmp_path / "my_engine"))
    return tmp_path / "my_engine"


def _minifer_int4_matmul(x, packed, scales, zeros, group_size, out, **tiles):
    qw = QuantizedWeight("int4", packed, scales, zeros, group_size, (packed.shape[0], x.shape[1]))
    out.copy_(quant_linear_reference(x, qw))
    return out


# --- the adapters -------------------------------------------------------------------------------------------


def test_the_kernel_adapter_flattens_adds_the_bias_and_restores_shape_and_dtype():
    gen = torch.Generator().manual_seed(0)
    qw = quantize_int4(torch.randn(40, 96, generator=gen), 32, False)
    x = torch.randn(2, 3, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen)
    got = workbench_quant.quant_kernel_with(_minifer_int4_matmul)(x, qw, bias)
    assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, quant_linear_reference(x, qw, bias))
    with pytest.raises(ValueError, match="int4 weights, not int8"):
        workbench_quant.quant_kernel_with(_minifer_int4_matmul)(x, quantize(torch.randn(40, 96), "int8"), None)


def test_interpreter_tiles_are_powers_of_two_within_bounds():
    assert workbench_quant.interpreter_tiles(1, 384, 256) == {"BLOCK_M": 16, "BLOCK_N": 512, "BLOCK_K": 256}
    assert workbench_quant.interpreter_tiles(60, 1408, 704) == {"BLOCK_M": 64, "BLOCK_N": 512, "BLOCK_K": 256}
    assert workbench_quant.interpreter_tiles(17, 20, 33) == {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64}


def test_the_learners_quantizer_is_applied_to_the_loaded_model_before_it_serves():
    """No engine seam: ``int4_llm`` loads the float model and quantizes it with the learner's step and quantizer
    before the engine serves; a quantizer whose bytes differ from minifer's (asymmetric) is what the engine holds."""
    calls = []

    def asymmetric(w, g, symmetric):
        calls.append(tuple(w.shape))
        return workbench_quant.minifers_quantize(w, g, False)

    llm = workbench_quant.int4_llm({"quantize_int4_groupwise": asymmetric})
    assert len(calls) == 48  # 12 layers x 4 projections
    layers = decoder_linears(llm.model)
    assert all(isinstance(m, QuantLinear) and m.zeros is not None for m in layers.values())
    assert layers["model.layers.0.mlp.down_proj"].group_size == 64  # K = 704: group_for's fallback
    assert type(llm.model.lm_head) is torch.nn.Linear
    assert llm.model.quantization_config.layers["model.layers.0.mlp.down_proj"]["group_size"] == 64
    assert llm.engine.runner.model is llm.model  # the engine runs the quantized layers
    with pytest.raises(ValueError, match="quantize to int4, not int8"):
        workbench_quant.quantize_with(asymmetric)(llm.model, "int8")


# --- each piece in the engine -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["quantize_int4_groupwise", "quantize_linears",
                                  pytest.param("int4_matmul", marks=needs_triton)])
def test_every_solution_piece_serves_minifers_int4_tokens(name, solutions, capsys, my_engine):
    quant_engine.check_quant_in_engine(name, solutions[name])
    out = capsys.readouterr().out
    assert out.rstrip().endswith("4/4 checks passed"), out
    assert "tokens are minifer's int4 engine's" in out and "log-probability within" in out
    assert (my_engine / f"{name}.py").is_file()


@pytest.mark.parametrize("name", [*workbench_quant.QUANT_PIECES, "int4_matmul_torch"])
def test_untouched_stubs_are_not_implemented_yet(name, stubs, monkeypatch):
    if name == "int4_matmul" and not HAS_TRITON:
        pytest.skip(TRITON_ERROR)
    monkeypatch.setattr(quant_engine, "int4_engine", _no_engine)
    with pytest.raises(AssertionError, match="not implemented yet"):
        quant_engine.check_quant_in_engine(name.removesuffix("_torch"), stubs[name])


def _no_engine(pieces):
    raise RuntimeError("a piece that fails its grader must not reach the engine")


def _swapped_nibbles(w, group_size, symmetric):
    from minifer.quantization import quantize_int4  # self-contained: the tests save it and load it in a fresh namespace

    qw = quantize_int4(w, group_size, symmetric)
    return (qw.qweight >> 4) | ((qw.qweight & 0xF) << 4), qw.scales, qw.zeros


def _forgets_the_bias(model, quantize, group_size=128, symmetric=True, kernel=None):
    workbench_quant.minifers_load_step(model, quantize, group_size, symmetric, kernel)
    for name, module in decoder_linears(model).items():
        module.bias = None


@pytest.mark.parametrize("name, wrong, hint", [
    ("quantize_int4_groupwise", _swapped_nibbles, "LOW nibble"),
    ("quantize_linears", _forgets_the_bias, "pass the float layer's bias"),
])
def test_a_wrong_piece_is_stopped_by_its_grader_before_the_engine(name, wrong, hint, monkeypatch):
    monkeypatch.setattr(quant_engine, "int4_engine", _no_engine)
    with pytest.raises(AssertionError, match="does not go into the engine until it passes its checks") as e:
        quant_engine.check_quant_in_engine(name, wrong)
    assert hint in str(e.value)


@pytest.mark.slow
@needs_triton
def test_a_wrong_kernel_is_stopped_by_its_grader_with_the_hint(solutions, monkeypatch):
    def swapped(x, packed, scales, zeros, group_size, out, **tiles):
        return solutions["int4_matmul"](x, (packed >> 4) | ((packed & 0xF) << 4), scales, zeros, group_size, out)

    monkeypatch.setattr(quant_engine, "int4_engine", _no_engine)
    with pytest.raises(AssertionError, match="nibbles are swapped"):
        quant_engine.check_quant_in_engine("int4_matmul", swapped)


def test_a_kernel_that_breaks_in_the_engine_is_named(monkeypatch):
    """It passes its grader (whose shapes have at most 17 rows), then fails on the engine's prefill."""
    def small_batches_only(x, packed, scales, zeros, group_size, out, **tiles):
        if x.shape[0] > 17:
            raise IndexError("row tile out of range")
        return _minifer_int4_matmul(x, packed, scales, zeros, group_size, out)

    monkeypatch.setattr(graded, "grade_quietly", lambda name, piece: None)
    monkeypatch.setenv(workbench_save.CHECK_ENV, "0")  # nor graded again from its file
    with pytest.raises(AssertionError, match="the engine stopped inside your int4_matmul: IndexError") as e:
        quant_engine.check_quant_in_engine("int4_matmul", small_batches_only)
    assert "engine calls it on shapes or states they do not cover" in str(e.value)


def test_a_kernel_that_rounds_to_bf16_misses_the_logprob_bound(monkeypatch):
    """Within the grader's tolerance (5e-3 of the largest output), but not float32: teacher-forced, its
    log-probabilities are further from minifer's int4 engine's than float32 rounding explains."""
    def bf16(x, packed, scales, zeros, group_size, out, **tiles):
        qw = QuantizedWeight("int4", packed, scales, zeros, group_size, (packed.shape[0], x.shape[1]))
        out.copy_(quant_linear_reference(x.bfloat16().float(), qw).bfloat16().float())
        return out

    monkeypatch.setattr(graded, "grade_quietly", lambda name, piece: None)
    monkeypatch.setenv(workbench_save.CHECK_ENV, "0")  # nor graded again from its file
    with pytest.raises(AssertionError, match="nats away from minifer's int4 engine's") as e:
        quant_engine.check_quant_in_engine("int4_matmul", bf16)
    assert "accumulate in float32" in str(e.value)


# --- saving, loading, the capstone's int4 cell --------------------------------------------------------------


@needs_triton
def test_saved_pieces_load_in_a_fresh_namespace_and_pass_their_checks(solutions, my_engine):
    for name in workbench_quant.QUANT_PIECES:
        workbench_quant.save_quant(solutions[name], name=name)
    assert "@triton.jit" in (my_engine / "int4_matmul.py").read_text()
    errors: dict = {}
    loaded = workbench_quant.load_quant(errors=errors)
    assert not errors and set(loaded) == set(workbench_quant.QUANT_PIECES)
    assert loaded["int4_matmul"] is not solutions["int4_matmul"]
    pieces, origin = quant_engine.load_quant_pieces()
    assert set(origin.values()) == {"yours"} and set(pieces) == set(workbench_quant.QUANT_PIECES)


def test_solution_fills_missing_and_failing_pieces(my_engine):
    workbench_quant.save_quant(_swapped_nibbles, name="quantize_int4_groupwise")
    with pytest.raises(AssertionError, match="LOW nibble"):
        quant_engine.load_quant_pieces()
    pieces, origin = quant_engine.load_quant_pieces(solution=True)
    assert pieces == {}
    assert origin == {"quantize_int4_groupwise": "minifer's (yours fails its checks)",
                      "quantize_linears": "minifer's (not saved yet)", "int4_matmul": "minifer's (not saved yet)"}
    with pytest.raises(ValueError, match="not a piece of exercise 05"):
        workbench_quant.save_quant(_swapped_nibbles, name="rms_norm")


def test_the_int4_capstone_with_minifers_pieces_and_its_throughput(capsys):
    quant_engine.check_int4_engine(solution=True)
    quant_engine.print_int4_origins()
    ratio = quant_engine.int4_throughput(solution=True)
    out = capsys.readouterr().out
    assert "your int4 engine: 4/4 checks passed" in out
    assert out.count("minifer's (not saved yet)") == 3
    assert ratio is not None and ratio > 0 and "not a check" in out  # measured, never compared with a number


@needs_triton
def test_a_kernel_saved_for_a_process_that_imported_triton_without_the_interpreter_says_so(solutions, monkeypatch):
    workbench_quant.save_quant(solutions["int4_matmul"], name="int4_matmul")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton is imported already (conftest)
    errors: dict = {}
    assert "int4_matmul" not in workbench_quant.load_quant(errors=errors)
    assert "restart the kernel and run the notebook from its first cell" in errors["int4_matmul"]


# --- the PyTorch path, for machines without Triton ---------------------------------------------------------


def test_the_pytorch_kernel_passes_the_kernels_grader(solutions, capsys):
    from minifer_course.grading.quant import check_int4_matmul_kernel

    check_int4_matmul_kernel(solutions["int4_matmul_torch"])
    out = capsys.readouterr().out
    assert out.rstrip().endswith("int4_matmul_kernel: 5/5 checks passed") and "blocked" not in out


@pytest.mark.slow
def test_the_pytorch_kernel_serves_minifers_int4_tokens_and_loads_as_the_piece(solutions, capsys, my_engine):
    quant_engine.check_quant_in_engine("int4_matmul", solutions["int4_matmul_torch"])
    out = capsys.readouterr().out
    assert out.rstrip().endswith("int4_matmul in the int4 engine: 4/4 checks passed"), out
    saved = (my_engine / "int4_matmul.py").read_text()
    assert "def int4_matmul_torch(" in saved and "int4_matmul = int4_matmul_torch" in saved
    pieces, origin = quant_engine.load_quant_pieces(solution=True)
    assert origin["int4_matmul"] == "yours" and pieces["int4_matmul"] is not solutions["int4_matmul_torch"]


def test_a_wrong_pytorch_kernel_is_stopped_by_the_same_grader(solutions, monkeypatch):
    def returns_a_new_tensor(x, packed, scales, zeros, group_size, out, **tiles):
        return solutions["int4_matmul_torch"](x, packed, scales, zeros, group_size, torch.empty_like(out))

    monkeypatch.setattr(quant_engine, "int4_engine", _no_engine)
    with pytest.raises(AssertionError, match=r"never written(?s:.*)out\.copy_"):
        quant_engine.check_quant_in_engine("int4_matmul", returns_a_new_tensor)


@pytest.fixture
def no_triton(monkeypatch):
    """This process as one without Triton: the detection's answer says so (the notebooks' own run under the import
    shim is ``tests/no_triton``)."""
    import minifer.kernels

    monkeypatch.setattr(minifer.kernels, "HAS_TRITON", False)
    monkeypatch.setattr(minifer.kernels, "TRITON_ERROR", "Triton is not installed (test)")


def test_without_triton_the_kernel_is_blocked_and_the_pytorch_piece_is_picked(no_triton, capsys):
    from minifer_course.grading.quant import check_int4_matmul_kernel

    pieces = exercise_pieces("solution")  # the kernel defined with the stand-ins, as the notebook's cells do there
    check_int4_matmul_kernel(pieces["int4_matmul"])  # blocked: returns, raises nothing
    out = capsys.readouterr().out
    assert "int4_matmul_kernel: 0/5 checks passed, 5 blocked (Triton is not installed (test)): not failed" in out
    check_int4_matmul_kernel(pieces["int4_matmul_torch"])
    assert capsys.readouterr().out.rstrip().endswith("int4_matmul_kernel: 5/5 checks passed")
    assert workbench_quant.pick_int4_matmul(pieces["int4_matmul"], pieces["int4_matmul_torch"]) \
        is pieces["int4_matmul_torch"]
    assert "your PyTorch int4_matmul_torch, since Triton is not installed (test)" in capsys.readouterr().out


def test_with_triton_the_triton_piece_is_picked(solutions, capsys):
    if not HAS_TRITON:
        pytest.skip(TRITON_ERROR)
    assert workbench_quant.pick_int4_matmul(solutions["int4_matmul"], solutions["int4_matmul_torch"]) \
        is solutions["int4_matmul"]
    assert "your Triton kernel (int4_matmul)" in capsys.readouterr().out


def test_without_triton_a_saved_kernel_file_loads_and_its_launch_is_blocked(no_triton, my_engine, monkeypatch):
    """The stand-in ``@triton.jit`` is saved as the kernel's source; the file loads where Triton is missing (its
    prelude takes the stand-ins too), and grading it there is blocked, not failed."""
    from minifer_course.grading.base import Blocked
    from minifer_course.grading.engine import grade_quietly

    monkeypatch.setenv(workbench_save.CHECK_ENV, "0")  # the fresh process would have the real Triton
    pieces = exercise_pieces("solution")
    workbench_quant.save_quant(pieces["int4_matmul"], name="int4_matmul")
    text = (my_engine / "int4_matmul.py").read_text()
    assert "@triton.jit" in text and "triton, tl, _ = triton_modules()" in text and "\nimport triton" not in text
    errors: dict = {}
    loaded = workbench_quant.load_quant(errors=errors)
    assert not errors and "int4_matmul" in loaded
    with pytest.raises(Blocked, match="Triton is not installed"):
        grade_quietly("int4_matmul", loaded["int4_matmul"])
