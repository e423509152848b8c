"""Fused dequantize-matmul kernels in Triton: ``y = x @ dequant(W)^T`` for int8, int4 and fp8 weights.

W never exists in full precision in memory: each program loads its tile of codes, turns them into numbers in
registers and multiplies them at once. Decode is bound by the bytes of weights it reads (chapter 01), and a 4-bit
weight is a quarter of the bytes of a bf16 one (vLLM's int4 kernels of this kind: Marlin). Formats:
``minifer/quantization/formats.py``, whose ``quant_linear_reference`` is the oracle (``tests/kernels/test_quant_kernels.py``).

Three paths (``quant_matmul(..., path=)``):

- ``gemv`` (decode, M of 1 to a few): multiply-adds on CUDA cores. A program owns ``BLOCK_N`` outputs of one row
  of ``x`` and a slice of K (*split-K*: N = 4096 outputs alone would leave a GPU of 132 SMs too few programs to
  keep its memory system busy).
- ``splitk`` (decode, M up to 16): ``tl.dot`` on a 16-row tile (tensor cores; rows past M masked), split-K as
  above. Past a few rows, multiply-adds on CUDA cores cost more than the bytes.
- ``tiled`` (prefill): the Triton tutorial's tiled GEMM, the W tile dequantized just before each ``tl.dot``.

int4 in groups of a multiple of 64 takes ``quant_int4_mma_kernel`` on ``splitk`` and ``tiled``: the weights as
the MMA's wide operand, decoded in the registers that feed it, two codes per instruction.

Split-K partial sums go to a float32 workspace; the last program to finish an output tile (an atomic counter per
tile, which it resets to 0) adds them in a fixed order, adds the bias and writes the output: one launch, no
zero-filled buffer, the same bits on every run. The split (``choose_split``) fills each SM with ``SPLIT_PER_SM``
programs, a config entry, so the autotuner chooses it.

The kernels: ``quant_matmul_jit.py``; their measurements: ``benchmarks/results/README.md``. Chapter 05 and its
kernels appendix.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from minifer.kernels import INTERPRETING
from minifer.kernels.fp8 import fp8_native
from minifer.kernels.quant_matmul_jit import (FP8, INT4, INT8, MAGIC, X_BF16, X_FP16, X_FP32, quant_gemm_kernel,
                                              quant_gemv_kernel, quant_int4_mma_kernel)

if TYPE_CHECKING:  # the weights' format (minifer.quantization.formats); the kernels need only its fields at run time
    from minifer.quantization.formats import QuantizedWeight

_FMT = {"int8": INT8, "int4": INT4, "fp8": FP8}
_XKIND = {torch.bfloat16: X_BF16, torch.float16: X_FP16, torch.float32: X_FP32}
_PAIR_DTYPE = {torch.bfloat16: torch.int32, torch.float16: torch.int32, torch.float32: torch.int64}
PATHS = ("auto", "gemv", "splitk", "tiled")
# path="auto": the most rows that take gemv, by format (then splitk up to SPLITK_MAX_M rows, then tiled), from
# the timings in benchmarks/results/README.md.
GEMV_MAX_M = {"int4": 1, "int8": 0, "fp8": 0}
SPLITK_MAX_M = 16
MAX_SPLIT = 16
CHUNK_BYTES = 64  # int8/fp8 gemv: bytes of a row per chunk (int4 chunks are one quantization group)




# --- launch --------------------------------------------------------------------------------------------


def _bench(fn, quantiles):
    """A short timing per config keeps autotuning's first call of each shape to a few seconds."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _cfg(num_warps: int = 4, num_stages: int = 2, per_sm: int = 4, **kw) -> triton.Config:
    """``per_sm``: the programs per SM that ``choose_split`` fills the GPU with (``SPLIT_PER_SM``)."""
    return triton.Config({**kw, "SPLIT_PER_SM": per_sm}, num_warps=num_warps, num_stages=num_stages)


# The GPU's autotuning lists; the first of each is the one minifer_course/experiments/aot.py compiles. gemv: a
# chunk is 64 bytes of a row (an int4 group of 128, or 64 int8/fp8 codes); CHUNKS sets how long a contiguous run of each row one step
# reads, BLOCK_N how many rows. Each tile comes with several per_sm (the same compiled kernel: only a timing).
GPU_GEMV_CONFIGS = [_cfg(w, 2, p, BLOCK_N=n, CHUNKS=c) for n, c, w in
                    ((128, 1, 4), (64, 1, 4), (64, 2, 4), (128, 2, 8), (32, 4, 4), (32, 2, 2), (256, 1, 8),
                     (16, 8, 4), (32, 8, 8), (8, 16, 4)) for p in (4, 3, 2)]
GPU_SPLITK_CONFIGS = [_cfg(w, s, p, BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, GROUP_M=1) for n, k, w, s in
                      ((32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (32, 256, 4, 3), (128, 128, 8, 3),
                       (128, 64, 4, 4)) for p in (2, 4, 8)]
# int4 decode on tensor cores: BLOCK_M is the MMA's narrow side (8 or 16 rows of x). per_sm=1 lets a wide
# layer run unsplit (one program per tile, no partial sums to add), its loads kept in flight by the
# pipeline's stages instead (num_stages 5: five K-steps of words on their way per program).
GPU_INT4_MMA_CONFIGS = [_cfg(w, s, p, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k) for n, m, k, w, s in
                        ((128, 16, 128, 4, 3), (128, 8, 128, 4, 3), (64, 16, 128, 4, 3), (256, 16, 128, 8, 3),
                         (64, 8, 128, 4, 4), (128, 16, 64, 4, 4), (128, 8, 128, 4, 5)) for p in (4, 2, 8, 1)]
# ... and prefill: 32-128 rows of x per tile (a tile that spills registers on some GPU loses the autotuner's timing).
GPU_INT4_MMA_TILED_CONFIGS = [_cfg(w, s, 1, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k) for m, n, k, w, s in
                              ((64, 128, 128, 8, 3), (32, 128, 128, 4, 3), (128, 128, 128, 8, 3),
                               (64, 256, 128, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4))]
GPU_TILED_CONFIGS = [_cfg(w, s, 1, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8) for m, n, k, w, s in
                     ((64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 64, 128, 4, 3),
                      (128, 256, 64, 8, 3), (64, 256, 64, 8, 3))]
# Turing (sm_75, the T4): Triton has no tensor-core dot below sm_80, so tl.dot runs on the CUDA cores with its
# operands in registers, and the tiles above spill. These are the largest that do not (in float16); gemv's are the same.
TURING_CONFIGS = {
    "splitk": [_cfg(4, 2, p, BLOCK_M=16, BLOCK_N=32, BLOCK_K=k, GROUP_M=1) for k in (32, 64) for p in (2, 4, 8)],
    "tiled": [_cfg(4, 2, 1, BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, GROUP_M=8)],
    "int4_mma": [_cfg(4, 2, p, BLOCK_M=m, BLOCK_N=n, BLOCK_K=64) for m, n in ((8, 64), (16, 64), (16, 128))
                 for p in (4, 2, 8)],
    "int4_mma_tiled": [_cfg(4, 2, 1, BLOCK_M=32, BLOCK_N=64, BLOCK_K=64)],
}
CONFIG_PATHS = ("gemv", "splitk", "tiled", "int4_mma", "int4_mma_tiled")


def gpu_configs(path: str, turing: bool = False) -> list[triton.Config]:
    """The GPU's autotuning list of ``path`` (one of ``CONFIG_PATHS``): the Turing list below sm_80."""
    if turing and path in TURING_CONFIGS:
        return TURING_CONFIGS[path]
    return {"gemv": GPU_GEMV_CONFIGS, "splitk": GPU_SPLITK_CONFIGS, "tiled": GPU_TILED_CONFIGS,
            "int4_mma": GPU_INT4_MMA_CONFIGS, "int4_mma_tiled": GPU_INT4_MMA_TILED_CONFIGS}[path]


# One config each under the interpreter (it runs every program in numpy: tuning would only cost time) or with
# MINIFER_QUANT_AUTOTUNE=0 on a GPU (the first of each list: quick start-up, fixed kernels).
AUTOTUNE = not INTERPRETING and os.environ.get("MINIFER_QUANT_AUTOTUNE", "1") != "0"
INTERPRETER_CONFIGS = {
    "gemv": [_cfg(BLOCK_N=16, CHUNKS=2)],
    "splitk": [_cfg(per_sm=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1)],
    "tiled": [_cfg(per_sm=1, BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, GROUP_M=4)],
    "int4_mma": [_cfg(per_sm=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)],
    "int4_mma_tiled": [_cfg(per_sm=1, BLOCK_M=32, BLOCK_N=32, BLOCK_K=64)],
}


def _cap_block_k(configs: list[triton.Config], cap: int) -> list[triton.Config]:
    """int4 on tensor cores: a K-step must stay inside one quantization group, so BLOCK_K is cut to at most
    ``cap``, the largest power of two dividing the group size (configs that become equal are dropped)."""
    out, seen = [], set()
    for cfg in configs:
        kw = {**cfg.kwargs, "BLOCK_K": min(cfg.kwargs["BLOCK_K"], cap)}
        key = (tuple(sorted(kw.items())), cfg.num_warps, cfg.num_stages)
        if key not in seen:
            seen.add(key)
            out.append(triton.Config(kw, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return out


_KEY = ["M_KEY", "N", "K", "FMT", "GROUP", "XKIND"]
_tuners: dict[tuple[str, int, bool], tuple[object, list[triton.Config]]] = {}


def _tuner(path: str, block_k_cap: int = 0, turing: bool = False):
    """The autotuned kernel of ``path`` (``"int4_mma"`` / ``"int4_mma_tiled"``: int4's splitk / tiled, see ``plan``)
    and its configs; one per BLOCK_K cap and config family, built on first use."""
    if (path, block_k_cap, turing) not in _tuners:
        configs = INTERPRETER_CONFIGS[path] if INTERPRETING else gpu_configs(path, turing)[:None if AUTOTUNE else 1]
        if path == "gemv":
            kernel = quant_gemv_kernel
        elif path in ("int4_mma", "int4_mma_tiled"):
            kernel, configs = quant_int4_mma_kernel, _cap_block_k(configs, block_k_cap)
        else:
            kernel = quant_gemm_kernel
            if block_k_cap:
                configs = _cap_block_k(configs, block_k_cap)
        _tuners[path, block_k_cap, turing] = triton.autotune(configs, key=_KEY, do_bench=_bench)(kernel), configs
    return _tuners[path, block_k_cap, turing]


_locks: dict[torch.device, torch.Tensor] = {}
_outgrown_locks: list[torch.Tensor] = []  # never freed: a CUDA graph may have recorded their addresses


def _lock_buffer(device: torch.device, n: int) -> torch.Tensor:
    """Per-tile arrival counters for split-K, zero between launches (a tile's last program resets its own); per
    device, only grown. An outgrown buffer is never freed: a CUDA graph captured with it replays its address, and
    freed memory would go to a tensor whose bytes the counters would then read and reset. Launches on two streams
    at once would share it; minifer runs its model on one stream."""
    buf = _locks.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _outgrown_locks.append(buf)
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _locks[device] = buf
    return buf


def _workspace(numel: int, device: torch.device) -> torch.Tensor:
    """float32 scratch for split-K partial sums; every element the kernel reads it wrote first."""
    return torch.empty(numel, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so the CPU tests exercise the split-K reduction


@functools.lru_cache(maxsize=None)
def _one_dot(device: torch.device) -> bool:
    """``quant_int4_mma_kernel``'s ``ONE_DOT``: one dot per K-step where the MMA is ``wgmma`` (sm_90), one per code
    plane elsewhere: whichever issues fewer instructions per weight there. The interpreter runs the sm_90 form
    (the tests run both)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] == 9


@functools.lru_cache(maxsize=None)
def _turing(device: torch.device) -> bool:
    """A GPU below sm_80 (the T4): no tensor-core dot in Triton there, so the smaller ``TURING_CONFIGS``."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0)


def choose_split(tiles: int, k_steps: int, sms: int, per_sm: int) -> int:
    """Split K until ``tiles * split`` programs fill ``per_sm`` programs per SM, with at least two K-steps per
    split (one step is mostly overhead) and at most ``MAX_SPLIT``. How many programs an SM holds at once depends
    on the compiled kernel's registers, so each config names its ``per_sm`` and the autotuner picks. Overshooting
    by a few programs costs little: the GPU starts each waiting program as soon as one finishes."""
    want = -(-per_sm * sms // tiles)
    return max(1, min(want, k_steps // 2, MAX_SPLIT))


def _check(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> None:
    qw.validate(check_values=False)
    n, k = qw.shape
    if x.dtype not in _XKIND:
        raise ValueError(f"quant_matmul: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features but the weight expects K={k}")
    if x.device != qw.qweight.device:
        raise ValueError(f"quant_matmul: x is on {x.device} but the weight is on {qw.qweight.device}")
    if x.device.type != "cuda" and not INTERPRETING:
        raise ValueError("quant_matmul: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
                         "triton is imported, to run them on the CPU); use quant_linear_reference on the CPU")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.device != x.device):
        raise ValueError(f"quant_matmul: bias must have shape ({n},) on {x.device}, got {tuple(bias.shape)} "
                         f"on {bias.device}")
    if bias is not None and not bias.is_contiguous():  # the kernels read it as a packed row
        raise ValueError(f"quant_matmul: bias must be contiguous, got stride {bias.stride()}")


@dataclass(frozen=True)
class Plan:
    """How ``quant_matmul`` launches one path: the autotuned kernel (``tuner``: its path and BLOCK_K cap), the
    constexprs only it takes, its configs, W's row length in the units it reads (``words``: int32 words of 8
    codes, else bytes), whether ``x`` goes in as 32-bit pairs, and per config the output tiles and K-steps."""

    tuner: tuple[str, int]
    kernel: object
    extra: dict
    configs: list
    row: int
    words: bool
    x_pairs: bool
    tiles: Callable[[dict], int]
    k_steps: Callable[[dict], int]


def plan(path: str, m: int, n: int, k: int, fmt: int, group: int, one_dot: bool = True,
         turing: bool = False) -> Plan:
    """The launch plan of ``path`` (not ``"auto"``) for ``m`` rows, an ``n x k`` weight, format and group. int4
    on ``splitk`` and ``tiled`` takes ``quant_int4_mma_kernel`` when ``GROUP % 64 == 0`` (a K-step of 64 codes
    fits in a group), else ``quant_gemm_kernel``; ``one_dot``: its ``ONE_DOT``; ``turing``: ``TURING_CONFIGS``."""
    if path == "gemv":
        row = k // 8 if fmt == INT4 else k
        gw = group // 8 if fmt == INT4 else CHUNK_BYTES
        while row % gw:  # int8/fp8: chunks must tile the row exactly (no mask along a chunk)
            gw //= 2
        kernel, configs = _tuner("gemv", 0, turing)
        return Plan(("gemv", 0), kernel, dict(GW=gw, GW_P2=triton.next_power_of_2(gw)), configs, row, fmt == INT4,
                    fmt == INT4, lambda meta: m * triton.cdiv(n, meta["BLOCK_N"]),
                    lambda meta: triton.cdiv(row, gw * meta["CHUNKS"]))
    cap = group & -group if fmt == INT4 else 0
    tiles = lambda meta: triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])  # noqa: E731
    k_steps = lambda meta: triton.cdiv(k, meta["BLOCK_K"])  # noqa: E731
    if fmt == INT4 and group % 64 == 0:
        name = "int4_mma" if path == "splitk" else "int4_mma_tiled"
        kernel, configs = _tuner(name, cap, turing)
        return Plan((name, cap), kernel, dict(DOT_F32=INTERPRETING, ONE_DOT=one_dot), configs, k // 8, True, False,
                    tiles, k_steps)
    kernel, configs = _tuner(path, cap, turing)
    return Plan((path, cap), kernel, dict(DOT_F32=INTERPRETING), configs, k // 2 if fmt == INT4 else k, False,
                fmt == INT4, tiles, k_steps)


def _as_int(value) -> int:
    """A config's integer as the grid function sees it: an int on a GPU, a scalar tensor wrapper under the
    interpreter (which converts the kernel's arguments before it calls the grid)."""
    return int(value.handle.data.item()) if hasattr(value, "handle") else int(value)


def auto_path(m: int, qw: QuantizedWeight) -> str:
    """The path ``quant_matmul(path="auto")`` takes for ``m`` rows (see ``GEMV_MAX_M``). int4 groups that
    are not a multiple of 32 always take gemv: a K-step of ``tl.dot`` must stay inside one group."""
    if qw.fmt == "int4" and qw.group_size % 32:
        return "gemv"
    return "gemv" if m <= GEMV_MAX_M[qw.fmt] else "splitk" if m <= SPLITK_MAX_M else "tiled"


def _m_key(m: int) -> int:
    """The autotuner's key for ``m`` rows (``M_KEY``): a power of two up to 256, so that a batch size it has not
    seen reuses its bucket's tuning."""
    return min(triton.next_power_of_2(m), 256)


def _checked_out(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None, path: str, split_k: int | None,
                 out: torch.Tensor | None) -> torch.Tensor:
    """``quant_matmul``'s arguments checked; the tensor it writes into (``out``, or a new one)."""
    if path not in PATHS:
        raise ValueError(f"quant_matmul: path must be one of {PATHS}, got {path!r}")
    if split_k is not None and not 1 <= split_k <= MAX_SPLIT:
        raise ValueError(f"quant_matmul: split_k must be in 1..{MAX_SPLIT}, got {split_k}")
    _check(x, qw, bias)
    shape = (*x.shape[:-1], qw.shape[0])
    if out is None:
        return torch.empty(*shape, dtype=x.dtype, device=x.device)
    if out.shape != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"quant_matmul: out must be a contiguous {x.dtype} tensor of shape {shape} on "
                         f"{x.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def quant_matmul(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None, path: str = "auto",
                 split_k: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(qw)^T (+ bias)`` for ``x: [..., K]`` (float32 / bf16 / fp16), fused; returns ``[..., N]``
    in ``x.dtype`` (written into ``out`` if given: contiguous, that shape and dtype). ``path``: ``"gemv"`` /
    ``"splitk"`` (decode), ``"tiled"`` (prefill) or ``"auto"`` (``auto_path``: a static rule by format and rows;
    nothing is timed at run time). ``split_k`` overrides ``choose_split`` (capped at the number of K-steps)."""
    out = _checked_out(x, qw, bias, path, split_k, out)
    n, k = qw.shape
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if m == 0:
        return out
    fmt, group = _FMT[qw.fmt], qw.group_size or 0
    chosen = auto_path(m, qw) if path == "auto" else path
    if fmt == INT4 and group % 8:
        raise ValueError(f"quant_matmul: the int4 kernels need a group size that is a multiple of 8 (a group is "
                         f"whole 32-bit words of codes), got {group}; use quant_linear_reference")
    if fmt == INT4 and chosen != "gemv" and group % 32:
        raise ValueError(f"quant_matmul: path {path!r} needs an int4 group size that is a multiple of 32 "
                         f"(a K-step of tl.dot stays inside one group), got {group}; use path='gemv'")
    p = plan(chosen, m, n, k, fmt, group, _one_dot(x.device), _turing(x.device))
    sms = _num_sms(x.device)

    def splits(meta) -> int:
        if split_k is not None:
            s = split_k
        else:
            s = choose_split(p.tiles(meta), p.k_steps(meta), sms, _as_int(meta["SPLIT_PER_SM"]))
        return max(1, min(s, p.k_steps(meta)))

    most = max(splits(c.kwargs) for c in p.configs)
    part = _workspace(most * m * n if most > 1 else 1, x.device)
    locks = _lock_buffer(x.device, max(p.tiles(c.kwargs) for c in p.configs))
    # int4 gemv and tiled read x as pairs (see quant_matmul_jit's docstring); fp8 codes travel as int8 bits.
    xk = x2.view(_PAIR_DTYPE[x.dtype]) if p.x_pairs else x2
    q = qw.qweight
    if fmt == FP8:
        q = q.view(torch.int8)
    elif p.words:
        q = q.view(torch.int32)  # [N, K / 8]: 8 codes a word, code 0 in the lowest nibble
    z = qw.zeros if qw.zeros is not None else qw.scales  # a placeholder pointer, never read without HAS_ZEROS
    p.kernel[lambda meta: (p.tiles(meta), splits(meta))](
        xk, q, qw.scales, z, bias if bias is not None else qw.scales, out, part, locks, m, n, k,
        p.row, _m_key(m), *((MAGIC,) if chosen == "gemv" else ()), FMT=fmt, GROUP=group,
        HAS_ZEROS=qw.zeros is not None, HAS_BIAS=bias is not None, FP8_NATIVE=fp8_native(x.device),
        XKIND=_XKIND[x.dtype], **p.extra)
    return out
