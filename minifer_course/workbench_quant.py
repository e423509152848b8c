"""The learner's int4 pieces of chapter 05 inside the engine: their quantizer, their quantize-and-load step and their
Triton kernel, serving requests from ``LLM("tinystories-target", ...)`` (``int4_llm``).

Exercise 05 writes three pieces:

* ``quantize_int4_groupwise(w, group_size, symmetric) -> (packed, scales, zeros)``: minifer's int4 bytes;
* ``quantize_linears(model, quantize, group_size, symmetric, kernel)``: the load step that swaps every decoder
  projection for a ``QuantLinear`` holding ``quantize``'s bytes;
* ``int4_matmul(x, packed, scales, zeros, group_size, out, BLOCK_M, BLOCK_N, BLOCK_K)``: the wrapper that launches
  their Triton kernel, or, where Triton is not installed (macOS, Windows), ``int4_matmul_torch`` of the same
  signature, the same unpack-scale-dot in PyTorch (``pick_int4_matmul`` chooses, and says which). Either is graded
  by ``check_int4_matmul_kernel`` and goes in as the piece ``int4_matmul``.

The third goes in through the engine's quantized linear kernel seam (``Components.quant_kernel``, a ``QuantKernel``,
as vLLM's quantized linear methods). The first two have no engine seam (vLLM has none for its load step): the
workbench loads the float model and applies the learner's load step, with their quantizer, to it before the engine
serves anything (``quantize_with``), as a user quantizes a model before handing it over. A piece not given stays
minifer's: ``quantize_int4``, the load step below (``minifers_load_step``), the reference kernel. The engine's
weights are then the learner's bytes, multiplied by the learner's kernel, so its tokens are compared with minifer's
own int4 engine (int4 is not float32: the float engine would be the wrong reference).

Without a GPU the kernel runs under Triton's interpreter, which executes the grid's programs one after another in
numpy: the exercise's 16 x 16 tiles take about 10 s per decode step of the bundled model, so on the CPU the adapter
launches large tiles (up to 64 x 512 x 256: about 1 s a step, measured) and the pieces serve a small batch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minifer.quantization.formats import QuantizedWeight, quantize_int4
from minifer.quantization.linear import QuantKernel, QuantLinear, decoder_linears, set_module
from minifer.quantization.model import QuantizationConfig, group_for
from minifer_course import workbench
from minifer_course.workbench import PRELUDE, Piece

NO_SEAM = "none (applied to the loaded model before serving)"
QUANT_PIECES: dict[str, Piece] = {p.name: p for p in (
    Piece("quantize_int4_groupwise", "05_quantization", NO_SEAM, "the workbench quantizes the loaded model with it"),
    Piece("quantize_linears", "05_quantization", NO_SEAM, "the workbench quantizes the loaded model with it"),
    Piece("int4_matmul", "05_quantization", "quant_kernel"),
)}

# What a saved piece of exercise 05 may use besides workbench.PRELUDE: Triton (in its interpreter without a GPU,
# which must be chosen before a kernel is decorated; stand-ins where Triton is not installed, so that a file holding a
# kernel still loads there, and the kernel's launch is blocked) and minifer's quantized layer.
QUANT_PRELUDE = """\
import os

from torch import nn

from minifer.quantization import QuantizedWeight
from minifer.quantization.linear import QuantLinear
from minifer.quantization.model import group_for
from minifer_course.grading.quant import triton_modules

triton, tl, _ = triton_modules()
"""

INT4 = {"group_size": 128, "symmetric": True}  # LLM(quantization="int4"): g128, symmetric (the fallback: group_for)


# --- saving and loading -------------------------------------------------------------------------------------


def save_quant(obj: Any, name: str | None = None, path: str | Path | None = None, grade: bool = False) -> Path:
    """``workbench.save`` for exercise 05's pieces: the file also imports Triton and minifer's quantized layer, and
    ``int4_matmul``'s file carries the ``@triton.jit`` kernel it launches (found as any helper is)."""
    piece = name or obj.__name__
    if piece not in QUANT_PIECES:
        raise ValueError(f"{piece!r} is not a piece of exercise 05 (those are {', '.join(QUANT_PIECES)})")
    return workbench.save(obj, path=path, name=piece, grade=grade, prelude=PRELUDE + QUANT_PRELUDE,
                          saved_by="minifer_course.workbench_quant.save_quant")[0]


def pick_int4_matmul(triton_piece: Callable[..., Any], torch_piece: Callable[..., Any]) -> Callable[..., Any]:
    """The learner's kernel piece for this machine: the Triton wrapper where Triton is installed, else the PyTorch
    function (both take ``int4_matmul``'s arguments and fill ``out``); prints which, and why."""
    from minifer.kernels import HAS_TRITON, TRITON_ERROR  # triton_available()'s answer

    if HAS_TRITON:
        print(f"int4_matmul: your Triton kernel ({triton_piece.__name__}), since Triton is installed here")
        return triton_piece
    print(f"int4_matmul: your PyTorch {torch_piece.__name__}, since {TRITON_ERROR}")
    return torch_piece


def load_quant(path: str | Path | None = None, errors: dict[str, str] | None = None) -> dict[str, Any]:
    """The saved pieces of exercise 05, by name (``workbench.load_saved``). Without a GPU the kernel needs Triton's
    interpreter, chosen before triton is imported: if it was imported without it, a Triton kernel is left out (why,
    in ``errors``); a PyTorch one runs anyway."""
    kernel = workbench.folder(path) / "int4_matmul.py"
    late = (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" and "triton" in sys.modules
            and kernel.is_file() and "@triton.jit" in kernel.read_text())
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before a saved kernel is decorated
    found = workbench.load_saved(path, errors, names=QUANT_PIECES)
    if late and found.pop("int4_matmul", None) is not None and errors is not None:
        errors["int4_matmul"] = ("int4_matmul: Triton was imported before TRITON_INTERPRET=1 was set, so your kernel "
                                 "cannot run on the CPU: restart the kernel and run the notebook from its first cell")
    return found


# --- adapters: the exercise's signatures -> the engine's seams ------------------------------------------------


def interpreter_tiles(m: int, n: int, k: int) -> dict[str, int]:
    """Tiles for Triton's CPU interpreter, whose cost is per program and per operation, not per element: as few
    programs and K steps as the shapes allow (powers of two; the exercise's kernel masks what overhangs)."""
    def fit(size: int, low: int, high: int) -> int:
        return max(low, min(high, 1 << max(size - 1, 0).bit_length()))
    return {"BLOCK_M": fit(m, 16, 64), "BLOCK_N": fit(n, 16, 512), "BLOCK_K": fit(k, 32, 256)}


def quant_kernel_with(int4_matmul: Callable[..., Any]) -> QuantKernel:
    """A ``QuantKernel`` around the learner's ``int4_matmul(x, packed, scales, zeros, group_size, out, ...)``: the
    activations flattened to float32 rows ``[M, K]``, a float32 ``out`` ``[M, N]`` for the kernel to fill, then the
    bias added and the model's shape and dtype restored."""

    def kernel(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        if qw.fmt != "int4":
            raise ValueError(f"your int4_matmul multiplies int4 weights, not {qw.fmt}: serve it with "
                             f"quantization='int4'")
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()
        out = torch.empty(rows.shape[0], qw.shape[0], dtype=torch.float32, device=x.device)
        tiles = {} if x.is_cuda else interpreter_tiles(rows.shape[0], *qw.shape)
        int4_matmul(rows, qw.qweight, qw.scales, qw.zeros, qw.group_size, out, **tiles)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], qw.shape[0]).to(x.dtype)

    return kernel


def minifers_quantize(w: torch.Tensor, group_size: int, symmetric: bool):
    """``quantize_int4`` in the exercise's signature."""
    qw = quantize_int4(w, group_size, symmetric)
    return qw.qweight, qw.scales, qw.zeros


def minifers_load_step(model: nn.Module, quantize: Callable[..., Any], group_size: int = 128, symmetric: bool = True,
                       kernel: QuantKernel | None = None) -> None:
    """``quantize_model``'s int4 path with any quantizer: every decoder projection becomes a ``QuantLinear`` of
    ``quantize``'s bytes (at ``group_for``'s group), its bias kept; ``embed_tokens`` and ``lm_head`` stay."""
    for name, linear in decoder_linears(model).items():
        g = group_for(name, linear.in_features, group_size)
        packed, scales, zeros = quantize(linear.weight.detach().float(), g, symmetric)
        qw = QuantizedWeight("int4", packed, scales, zeros, g, tuple(linear.weight.shape))
        bias = None if linear.bias is None else linear.bias.detach().clone()
        set_module(model, name, QuantLinear(qw, bias, kernel))


def quantize_with(quantize_int4_groupwise: Callable[..., Any] | None = None,
                  quantize_linears: Callable[..., Any] | None = None) -> Callable[..., QuantizationConfig]:
    """A function of ``quantize_model``'s signature (``(model, method, kernel=...)``, in place) that runs the learner's
    load step with the learner's quantizer (minifer's for a piece not given), as ``quantization="int4"`` asks: g128,
    symmetric."""
    quantize = quantize_int4_groupwise or minifers_quantize
    load = quantize_linears or minifers_load_step

    def quantizer(model: nn.Module, method: str, kernel: QuantKernel | None = None) -> QuantizationConfig:
        if method != "int4":
            raise ValueError(f"your pieces quantize to int4, not {method}: serve them with quantization='int4'")
        shapes = decoder_linears(model)  # before the load step replaces them
        load(model, quantize, INT4["group_size"], INT4["symmetric"], kernel)
        cfg = QuantizationConfig("int4", INT4["group_size"], INT4["symmetric"], "rtn")
        cfg.layers = {n: {"shape": [m.out_features, m.in_features], "group_size": group_for(n, m.in_features, INT4["group_size"]),
                          "bias": m.bias is not None} for n, m in shapes.items()}
        cfg.kept = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        model.quantization_config = cfg
        return cfg

    return quantizer


def int4_llm(pieces: dict[str, Any]):
    """An int4 engine with these exercise-05 pieces (by name; a piece not given stays minifer's), in float32 (on a GPU
    too: the kernels' sums). Without a quantizer piece it is minifer's int4 engine with the learner's kernel; with one,
    the float model is loaded and quantized by the learner's step before it serves (CUDA graphs off: they would
    replay the float layers they captured)."""
    from minifer import LLM
    from minifer.engine.components import Components
    from minifer.kernels import quant_kernel_for

    p = pieces.get
    kernel = quant_kernel_with(p("int4_matmul")) if p("int4_matmul") else None
    if not (p("quantize_int4_groupwise") or p("quantize_linears")):
        return LLM("tinystories-target", quantization="int4", dtype="float32",
                   components=Components(quant_kernel=kernel))
    llm = LLM("tinystories-target", dtype="float32", enforce_eager=True)
    quantize_with(p("quantize_int4_groupwise"), p("quantize_linears"))(llm.model, "int4",
                                                                        kernel=kernel or quant_kernel_for(llm.device))
    return llm
