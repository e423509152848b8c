# Source of exercises/05_quantization.ipynb and solutions/05_quantization.ipynb.
# Edit this file, never the notebooks, then run `make exercises` (see exercises/README.md).

# %% [markdown]
# # Exercises 05 · Quantization
#
# Chapter 01 measured why decoding is slow: every generated token is a forward pass that reads all of the
# model's weights, and on a GPU that read, not the arithmetic, sets the time. Fewer bytes per weight means
# fewer bytes read per token. **Weight-only quantization** stores each weight in 8 or 4 bits instead of the 16
# of bf16, and turns it back into a number only inside the matmul, in registers; activations stay in
# floating point. int8 halves the bytes of bf16, int4 in groups of 128 divides them by 3.76.
#
# A quantized model is a *different* model, though, and how much worse it is depends on the text it reads.
# Three pieces of minifer's quantization, rebuilt from scratch:
#
# 1. **int4 group-wise quantization**, in minifer's exact format: the bytes a kernel reads;
# 2. **quantize and load**: the step that swaps a loaded model's float linear layers for `QuantLinear` layers
#    holding those bytes;
# 3. **a Triton kernel** that multiplies by those bytes directly, unpacking and scaling them tile by tile
#    (a puzzle in the style of Sasha Rush's *Triton puzzles*: the skeleton is given, you fill in the body); on a
#    machine without Triton (macOS, Windows) the same unpack-scale-dot **in PyTorch** instead (section 3b);
# 4. **perplexity**, the measurement that says what the quantization cost.
#
# The first three then run inside a real engine, `LLM("tinystories-target", ...)`: its weights quantized by your
# function and put in the model by your step (neither has an engine seam, as in vLLM: the course applies them to the
# loaded model before it serves), multiplied by your kernel (the engine's quantized linear kernel seam,
# `LLM(components=Components(quant_kernel=...))`), serving requests whose tokens must be those of minifer's own int4 engine.
#
# Each exercise explains the idea, gives a function whose body you write, then a **check cell** that grades
# it against minifer's own (`minifer/quantization/formats.py`, `minifer/kernels/quant_matmul.py`, `minifer/eval.py`).
# A check prints `ok` per passing check and stops at the first failure with what differs and a hint.

# %% [markdown] exercise-only
# Run the cells from the top. Stuck? The solved twin is
# [`solutions/05_quantization.ipynb`](../solutions/05_quantization.ipynb).

# %% [markdown] solution-only
# *This is the solved twin of [`exercises/05_quantization.ipynb`](../exercises/05_quantization.ipynb),
# generated from `exercises/source/05_quantization.py` by `make exercises`: edit the source, not this notebook.*

# %% [markdown]
# Without a GPU, Triton runs kernels on the CPU with its **interpreter**, which executes each program of the
# grid one after the other in numpy. It has to be switched on (`TRITON_INTERPRET=1`) before `triton` is
# imported, so this cell comes first. On macOS and Windows, where Triton publishes no wheels, the kernel cell
# still defines its function, the kernel's check says **blocked** (not failed), and you write the same computation
# in PyTorch (section 3b) instead: this cell says which path this machine takes.

# %%
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels then run on the CPU

import torch.nn.functional as F
import transformers

import minifer
import minifer.kernels
from minifer.eval import causal_forward, heldout_windows, perplexity as minifer_perplexity, stdlib_windows
from minifer_course.grading.quant import triton_modules
from minifer.quantization import dequantize, quantize, quantize_int4
from minifer.quantization.model import quantize_model

torch.set_num_threads(1)
transformers.utils.logging.set_verbosity_error()  # no tokenizer warnings in the outputs
triton, tl, triton_status = triton_modules()  # the real modules (or stand-ins where Triton is missing)
print(triton_status)
print("your int4 kernel: section 3, in Triton (section 3b, in PyTorch, is optional here)" if minifer.kernels.HAS_TRITON
      else "your int4 kernel: section 3b, in PyTorch (section 3's Triton checks say blocked on this machine)")
llm = minifer.LLM("tinystories-target", device="cpu")  # the bundled model, float32 (on the CPU even with a GPU)
model = llm.model

from minifer_course.common import setup_notebook

print(setup_notebook())  # CPU threads (one on a machine of two cores or fewer), quiet progress bars

# %% [markdown]
# ## 1 · int4 in groups: scales, zero points, two codes per byte
#
# A 4-bit code has 16 values. Mapping a whole row of a weight matrix onto 16 levels with one scale would let
# a single large weight (and trained models have such outliers) stretch the step for all the others. So the
# scale is shared by a **group** of `g` consecutive inputs of a row (along K, the dimension the matmul sums
# over); with `g = 128` a float32 scale adds 32 bits per 128 weights, 0.25 bits each.
#
# minifer's format keeps `nn.Linear`'s layout, `W: [N, K]` (out_features × in_features), and for each
# group:
#
# * **symmetric**: `s = absmax(group) / 7`, `q = clamp(round(w / s), −8, 7) + 8`. The signed values −8…7
#   are offset by 8 so that every code is in 0…15, and the weight it stands for is `(q − 8) · s`. Dividing
#   by 7, not 8, maps the largest magnitude onto ±7, which needs no clamping;
# * **asymmetric**: the group's range `[lo, hi]` is first widened to include 0 (`lo = min(group min, 0)`,
#   `hi = max(group max, 0)`), then `s = (hi − lo) / 15`, a **zero point** `z = clamp(round(−lo / s), 0, 15)`
#   (the code that stands for 0.0), and `q = clamp(round(w / s) + z, 0, 15)`; the weight is `(q − z) · s`.
#   Including 0 keeps an exact zero, and keeps `z` a valid 4-bit code for a group whose weights all have one
#   sign (GPTQ does the same).
#
# Both keep every weight within `s / 2` of its original value. A group of zeros has `absmax = 0` (or
# `hi − lo = 0`): its scale is 1 instead, so nothing is divided by zero and its codes stand for exact zeros.
# Round with `torch.round` (halves to even), as minifer does.
#
# Two codes share a byte, the **even column in the low nibble**:
#
# ```
# k (column):   0    1    2    3    4    5   ...   K-2  K-1
# code q:      q0   q1   q2   q3   q4   q5   ...
#
# byte j:      [ q1 | q0 ]  [ q3 | q2 ]  [ q5 | q4 ]  ...     packed uint8 [N, K / 2]
#               hi    lo                                     packed[n, j] = q[n, 2j] | q[n, 2j + 1] << 4
#
# groups:      |<------ g ------>|<------ g ------>|  ...     scales float32 [N, K / g]
#                                                             zeros  uint8   [N, K / g] (asymmetric) or None
# ```
#
# Write `quantize_int4_groupwise(w, group_size, symmetric)` for a float32 `w` whose `K` is a multiple of
# `group_size`; return `(packed, scales, zeros)`, with `zeros = None` when symmetric. The check compares
# your bytes with minifer's `quantize_int4`, which must agree exactly (the kernel below reads them).

# %%
def quantize_int4_groupwise(w: torch.Tensor, group_size: int, symmetric: bool):
    """Group-wise int4 of ``w`` ``[N, K]`` (float32): returns ``packed`` uint8 ``[N, K // 2]`` (column 2j in
    the low nibble of byte j), ``scales`` float32 ``[N, K // group_size]`` and ``zeros`` uint8 of the same
    shape (asymmetric) or None (symmetric)."""
    ### BEGIN SOLUTION
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)  # g consecutive inputs of a row
    if symmetric:
        absmax = groups.abs().amax(dim=2)
        scales = torch.where(absmax > 0, absmax / 7, torch.ones_like(absmax))
        q = torch.clamp(torch.round(groups / scales[..., None]), -8, 7) + 8
        zeros = None
    else:
        lo = groups.amin(dim=2).clamp(max=0.0)  # the range always includes 0
        hi = groups.amax(dim=2).clamp(min=0.0)
        scales = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(lo))
        z = torch.clamp(torch.round(-lo / scales), 0, 15)
        q = torch.clamp(torch.round(groups / scales[..., None]) + z[..., None], 0, 15)
        zeros = z.to(torch.uint8)
    q = q.reshape(n, k).to(torch.uint8)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # even column in the low nibble
    return packed, scales, zeros
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.quant import check_quantize_int4

check_quantize_int4(quantize_int4_groupwise)

# %% [markdown]
# ### Now your quantizer serves requests
#
# The next cell saves `quantize_int4_groupwise` to `my_engine/` (the capstone finds it there), grades it again,
# then serves requests with it. Seam: none (vLLM's load step has none either); the course loads
# `LLM("tinystories-target")` in float32 and, before it serves, quantizes every weight of the loaded model through
# your function (minifer's load step and kernel do the rest). It serves 4
# greedy requests of 8 tokens. int4 is not float32, so the reference is minifer's own int4 engine: the tokens must
# be the same, request by request, and scored teacher-forced (each engine gives every token of the reference's
# answers a log-probability) the two may differ by float rounding only. A function that fails its checks never
# reaches the engine: the cell stops with the grader's hint.

# %% nbval-check-output
from minifer_course.grading.quant_engine import check_quant_in_engine

check_quant_in_engine("quantize_int4_groupwise", quantize_int4_groupwise)

# %% [markdown]
# What the formats cost and keep, on a real weight: the first MLP projection of the bundled model
# (`gate_up_proj` of layer 0, `[1408, 256]`), with minifer's `quantize`. Bits per weight count the codes and
# the scales and zero points; the error is `‖W − dequantize(Q)‖ / ‖W‖`. Smaller groups buy accuracy with
# bits, and asymmetric groups use all 16 levels where a group's weights are skewed.

# %%
w = model.model.layers[0].mlp.gate_up_proj.weight.detach()
print(f"{'format':<22}{'bits / weight':>14}{'relative error':>16}")
for name, qw in [("int8, per row", quantize(w, "int8")), ("fp8 e4m3, per row", quantize(w, "fp8")),
                 ("int4 g128 symmetric", quantize_int4(w, 128, True)),
                 ("int4 g128 asymmetric", quantize_int4(w, 128, False)),
                 ("int4 g32 symmetric", quantize_int4(w, 32, True))]:
    err = float((dequantize(qw) - w).norm() / w.norm())
    print(f"{name:<22}{8 * qw.nbytes() / w.numel():>14.3f}{err:>16.4f}")

# %% [markdown]
# ## 2 · Quantize and load: `QuantLinear` in place of `nn.Linear`
#
# A quantizer makes bytes; a model has to hold them. minifer loads a checkpoint into an ordinary float model, then,
# when `LLM(..., quantization="int4")` asks for it, walks the decoder and swaps each projection for a `QuantLinear`
# (`minifer/quantization/linear.py`): a module that keeps the codes, scales and zero points as buffers and whose forward
# multiplies through a **kernel** handed to it (`QuantLinear(qw, bias, kernel)`, `qw` a `QuantizedWeight`). Write
# that step, `quantize_linears(model, quantize, group_size, symmetric, kernel)`, in place:
#
# * **which layers**: every `nn.Linear` inside the decoder layers, `model.model.layers[i]` (`self_attn.qkv_proj`,
#   `self_attn.o_proj`, `mlp.gate_up_proj`, `mlp.down_proj`): 89% of the parameters, read once per generated
#   token. Two stay in float, as in GPTQ, AWQ and vLLM: `model.model.embed_tokens` is a lookup that reads one row
#   per token (quantizing it saves memory, not bandwidth), and `model.lm_head` writes the logits, where no later
#   layer averages its error away;
# * **groups along K**: quantize the weight as `nn.Linear` stores it, `[N, K]` (float32: `linear.weight.detach()
#   .float()`), so that a group is `g` consecutive *inputs* of a row, the numbers one dot product sums. `group_size`
#   must divide K, and `down_proj`'s K is 704 = 11 × 64: `group_for(name, K, group_size)` (`minifer.quantization.model`)
#   gives each layer its group, falling back to the largest power of two that divides K (64 here), as minifer does;
# * **the bias**: only the weight is quantized; a layer's bias (Qwen2's `qkv_proj` has one) goes to the
#   `QuantLinear` as it is;
# * **replace the module**: `setattr(parent, child, QuantLinear(...))`, with `parent = layer.get_submodule(...)`.
#   The float layer must then be gone: nothing may keep its weight, or the model holds the float bytes *and* the
#   int4 ones, more than before quantizing;
# * **the kernel**: each `QuantLinear` multiplies through `kernel` (None: minifer's reference).
#
# `QuantizedWeight("int4", packed, scales, zeros, group, (N, K))` wraps the three tensors your quantizer returns.
# The check runs your step with minifer's quantizer on copies of the bundled model and compares the layers, their
# bytes, the bytes the model holds and its logits with minifer's `quantize_model(model, "int4")`.

# %%
from torch import nn

from minifer.quantization import QuantizedWeight
from minifer.quantization.linear import QuantLinear
from minifer.quantization.model import group_for


def quantize_linears(model, quantize, group_size=128, symmetric=True, kernel=None):
    """In place: every nn.Linear of the decoder layers (model.model.layers) becomes a QuantLinear holding
    quantize(weight [N, K], group, symmetric)'s int4 bytes (group: group_for), its bias kept, multiplying through
    kernel; embed_tokens and lm_head stay as they are. Returns None."""
    ### BEGIN SOLUTION
    for i, layer in enumerate(model.model.layers):
        for name, linear in list(layer.named_modules()):  # a list: the loop swaps modules
            if not isinstance(linear, nn.Linear):
                continue
            group = group_for(f"model.layers.{i}.{name}", linear.in_features, group_size)
            packed, scales, zeros = quantize(linear.weight.detach().float(), group, symmetric)
            qw = QuantizedWeight("int4", packed, scales, zeros, group, tuple(linear.weight.shape))
            bias = None if linear.bias is None else linear.bias.detach().clone()
            parent, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent), child, QuantLinear(qw, bias, kernel))
    ### END SOLUTION


# %% nbval-check-output
from minifer_course.grading.quant_load import check_quantize_linears

check_quantize_linears(quantize_linears)

# %% [markdown]
# ### Now your load step serves requests
#
# The same engine and requests as for the quantizer, with your `quantize_linears` as the load step the course
# applies to the loaded model before it serves (no engine seam; minifer's quantizer and kernel around it): the tokens
# must be minifer's int4 engine's.

# %% nbval-check-output
check_quant_in_engine("quantize_linears", quantize_linears)

# %% [markdown]
# ## 3 · The puzzle: a Triton kernel that multiplies by int4 bytes
#
# Dequantizing `W` into a float tensor and then calling `x @ W.T` would write the full-precision weight to
# memory and read it back: more bytes than bf16 had to begin with. A **fused** kernel reads the packed bytes,
# turns them into numbers in registers, and multiplies at once. Nothing but the 4-bit codes (and the
# scales) ever travels from memory.
#
# `out[M, N] = x[M, K] @ dequantize(W)^T`, tiled as in the Triton matmul tutorial: the grid has one
# **program** per `[BLOCK_M, BLOCK_N]` tile of `out`, and each program walks along K in tiles of `BLOCK_K`
# columns, that is `BLOCK_K / 2` bytes of each row of `W`:
#
# ```
#                 K tile k0 .. k0 + BLOCK_K                      byte kb = k0/2 + j, j = 0 .. BLOCK_K/2 - 1
#             +---------------------------+                      holds columns 2kb (low nibble) and 2kb + 1 (high)
#   x   rm -> | e o e o e o ...           |   [BLOCK_M, BLOCK_K]
#             +---------------------------+     e: even columns 2kb -> x_even [BLOCK_M, BLOCK_K/2]
#                                               o: odd columns 2kb + 1 -> x_odd [BLOCK_M, BLOCK_K/2]
#             +-------------+
#   W^T tile  | b b b ...   |  rows kb, columns rn: the bytes, [BLOCK_K/2, BLOCK_N]
#  (packed)   +-------------+     b & 0xF -> w_even, b >> 4 -> w_odd   (each [BLOCK_K/2, BLOCK_N])
#
#   acc[BLOCK_M, BLOCK_N] += x_even @ w_even + x_odd @ w_odd
# ```
#
# For each K tile, the program you write does:
#
# 1. the byte indices of the tile, `kb = k0 // 2 + j`, and their even columns `ke = 2 * kb` (the odd ones are
#    `ke + 1`); `K` need not be a multiple of `BLOCK_K`, so mask the columns `ke < K`;
# 2. load the bytes as a `[BLOCK_K // 2, BLOCK_N]` tile, `W` read transposed: byte `kb` of row `rn` is at
#    `q_ptr + rn * stride_qn + kb`. Mask it with the columns and the rows `rn < N` (`other=0`);
# 3. unpack: `b & 0xF` is column `ke`, `b >> 4` column `ke + 1`;
# 4. dequantize: subtract the zero point (`8.0` when `HAS_ZEROS` is false; otherwise the group's, from
#    `z_ptr`) and multiply by the scale. Column `k` belongs to group `k // GROUP`, and a K tile may straddle
#    groups, so load a scale per column, `s_ptr + rn * stride_sn + ke // GROUP` (both columns of a byte share
#    their group, since `GROUP` is even); zero points have the same layout;
# 5. load `x`'s even and odd columns (`x_ptr + rm * stride_xm + ke`, and `+ 1`), masked with `other=0`, and
#    accumulate `tl.dot(x_even, w_even) + tl.dot(x_odd, w_odd)` in float32 (`input_precision="ieee"` keeps
#    a GPU from rounding the float32 inputs to tf32); a broadcast product summed with `tl.sum` works too.
#
# After the loop, store `acc` into `out` with a mask for the rows `rm < M` and columns `rn < N`: the last
# tiles overhang the matrix. The check poisons `out` with NaN and surrounds every tensor with NaN-filled
# memory, so a missing mask shows up. Each tensor it passes is a view into a wider buffer, so consecutive rows
# are the `stride_*` arguments apart, not `K` or `N`: index rows with the strides.
#
# Under the interpreter, `print(...)` inside the kernel works (it runs as Python, one program at a time):
# handy for looking at a tile's shape. minifer's own kernels (`minifer/kernels/quant_matmul.py`) do the same
# with more tricks: codes turned into floats by bit manipulation, split-K for decode, tensor-core tiles.

# %%
@triton.jit
def int4_matmul_kernel(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K,
                       stride_xm, stride_qn, stride_sn, stride_om,
                       GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of out = x @ dequantize(W)^T; x float32 [M, K], W packed uint8 [N, K // 2],
    scales float32 (and zeros uint8) [N, K // GROUP], out float32 [M, N]. Row strides in elements."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x and of out
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W = columns of out
    j = tl.arange(0, BLOCK_K // 2)  # the bytes of a K tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ### BEGIN SOLUTION
        kb = k0 // 2 + j  # byte indices in a row of W
        ke = 2 * kb  # their even columns; the odd ones are ke + 1
        k_ok = ke < K
        w_mask = k_ok[:, None] & (rn < N)[None, :]
        b = tl.load(q_ptr + rn[None, :] * stride_qn + kb[:, None], mask=w_mask, other=0)  # [BLOCK_K/2, BLOCK_N]
        g = ke // GROUP  # each column's own group
        s = tl.load(s_ptr + rn[None, :] * stride_sn + g[:, None], mask=w_mask, other=0.0)
        if HAS_ZEROS:
            z = tl.load(z_ptr + rn[None, :] * stride_sn + g[:, None], mask=w_mask, other=0).to(tl.float32)
        else:
            z = 8.0
        w_even = ((b & 0xF).to(tl.float32) - z) * s
        w_odd = ((b >> 4).to(tl.float32) - z) * s
        x_mask = (rm < M)[:, None] & k_ok[None, :]
        x_even = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :], mask=x_mask, other=0.0)
        x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + ke[None, :] + 1, mask=x_mask, other=0.0)
        acc += tl.dot(x_even, w_even, input_precision="ieee")
        acc += tl.dot(x_odd, w_odd, input_precision="ieee")
        ### END SOLUTION
        ### BEGIN STUB
        # 1. kb: the byte indices of this K tile; ke = 2 * kb, their even columns; a mask for ke < K
        # 2. b: the bytes, [BLOCK_K // 2, BLOCK_N], masked (columns < K, rows rn < N), other=0
        # 3. unpack: b & 0xF (column ke) and b >> 4 (column ke + 1)
        # 4. subtract the zero point (8.0, or the group's from z_ptr), multiply by the scale of group ke // GROUP
        # 5. x_even, x_odd: x's columns ke and ke + 1 (masked, other=0); acc += the two products
        # YOUR CODE HERE
        raise NotImplementedError("implement int4_matmul_kernel")
        ### END STUB
    ### BEGIN SOLUTION
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])
    ### END SOLUTION
    ### BEGIN STUB
    # 6. store acc into out[rm, rn], masked to rows < M and columns < N
    ### END STUB


# %% [markdown]
# The wrapper is given: it allocates nothing (the caller passes `out`), picks the grid, and passes the
# pointers and row strides. A symmetric weight has no zero points; its `z_ptr` gets the scales as a
# placeholder that the kernel never reads (`HAS_ZEROS` is a compile-time constant, so the branch is removed).

# %%
def int4_matmul(x, packed, scales, zeros, group_size, out, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32):
    """out[M, N] = x[M, K] @ dequantize(W)^T for W in minifer's int4 format (packed, scales, zeros)."""
    M, K = x.shape
    N = packed.shape[0]
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))  # one program per tile of out
    int4_matmul_kernel[grid](x, packed, scales, scales if zeros is None else zeros, out, M, N, K,
                             x.stride(0), packed.stride(0), scales.stride(0), out.stride(0),  # zeros: as scales
                             GROUP=group_size, HAS_ZEROS=zeros is not None,
                             BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


# %% [markdown]
# The check runs five shapes (decode's `M = 1`, `N` not a multiple of `BLOCK_N`, K tiles straddling groups,
# `K` not a multiple of `BLOCK_K`, two row tiles), symmetric and asymmetric, against `quant_linear_reference`,
# minifer's plain-PyTorch `x @ dequantize(W)^T`.

# %% nbval-check-output
from minifer_course.grading.quant import check_int4_matmul_kernel

check_int4_matmul_kernel(int4_matmul)

# %% [markdown]
# ## 3b · Without Triton: the same unpack-scale-dot in PyTorch
#
# Triton publishes wheels for Linux only. On macOS and Windows the cells above define the kernel with stand-ins and
# its check says **blocked**: not failed, just not runnable there. There, write the kernel's computation in PyTorch,
# `int4_matmul_torch`: the wrapper's arguments (the tile sizes are accepted and unused), `out` filled in place. It
# is the kernel's loop body for the whole of K at once, even and odd columns apart as the kernel keeps them:
#
# 1. byte `j` of a row holds columns `2j` (low nibble) and `2j + 1` (high nibble), both in group `2j // group_size`
#    (`group_size` is even): index `scales` (and `zeros`) with each byte's group to get `[N, K // 2]` tensors;
# 2. unpack and dequantize: `w_even = ((packed & 0xF) - z) * s` and `w_odd = ((packed >> 4) - z) * s` in float32,
#    `z` being 8 when `zeros` is None;
# 3. `x`'s even columns times `w_even^T` plus its odd columns times `w_odd^T`, written into `out` (`out.copy_(...)`:
#    the check hands you a view inside a larger buffer, and reads that buffer, not a tensor you return).
#
# This builds the float weight in memory, what the fused kernel exists to avoid: on a CPU that costs little (minifer's
# own CPU path, `quant_linear_reference`, dequantizes the same way). The check is the kernel's, on the same shapes.
# Where Triton runs this section is optional: its check fails with "not implemented yet" until you write it.

# %%
def int4_matmul_torch(x, packed, scales, zeros, group_size, out, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32):
    """out[M, N] = x[M, K] @ dequantize(W)^T in PyTorch, the kernel's unpack-scale-dot without Triton: the arguments
    of int4_matmul (the tile sizes unused); out is filled in place and returned."""
    ### BEGIN SOLUTION
    group = (2 * torch.arange(packed.shape[1], device=packed.device)) // group_size  # byte j: column 2j's group
    s = scales[:, group]  # [N, K // 2], the scale of each byte's two columns
    z = 8.0 if zeros is None else zeros[:, group].float()
    w_even = ((packed & 0xF).float() - z) * s  # columns 0, 2, 4, ...
    w_odd = ((packed >> 4).float() - z) * s  # columns 1, 3, 5, ...
    out.copy_(x[:, 0::2] @ w_even.T + x[:, 1::2] @ w_odd.T)
    return out
    ### END SOLUTION
    ### BEGIN STUB
    # 1. each byte's group, (2 * j) // group_size, and its scale s and zero point z ([N, K // 2]; z = 8.0 if no zeros)
    # 2. w_even = ((packed & 0xF) - z) * s and w_odd = ((packed >> 4) - z) * s, in float32
    # 3. out.copy_(x's even columns @ w_even.T + x's odd columns @ w_odd.T); return out
    # YOUR CODE HERE
    raise NotImplementedError("implement int4_matmul_torch")
    ### END STUB


# %% nbval-check-output
check_int4_matmul_kernel(int4_matmul_torch)

# %% [markdown]
# ### Now your kernel serves requests
#
# Every `QuantLinear` of the int4 engine now multiplies through your kernel (minifer's quantizer and load step
# around it): 48 projections per step. Which kernel: your Triton `int4_matmul` where Triton is installed, your
# `int4_matmul_torch` elsewhere (the next cell says which; either is saved as the piece `int4_matmul`). Seam: the
# quantized linear kernel (`LLM(components=Components(quant_kernel=...))`, a `QuantKernel`, as vLLM's quantized linear
# methods pick a kernel). Without a GPU each Triton launch runs in Triton's interpreter, one program after another,
# so the engine launches your kernel with large tiles (up to 64 × 512 × 256; with 16 × 16 tiles a step would take
# ten times longer) and the cell takes a minute or so. The tokens must be minifer's int4 engine's, and
# teacher-forced log-probabilities may differ by float32 rounding only (your kernel sums in another order).

# %%
from minifer_course.workbench_quant import pick_int4_matmul

your_int4_matmul = pick_int4_matmul(int4_matmul, int4_matmul_torch)

# %% nbval-check-output
check_quant_in_engine("int4_matmul", your_int4_matmul)

# %% [markdown]
# ### All three together
#
# Your quantizer makes the bytes, your load step puts them in the model, your kernel multiplies by them: the
# engine's whole int4 path is yours (the capstone runs this cell again beside your other pieces).

# %% nbval-check-output
from minifer_course.grading.quant_engine import check_int4_engine

check_int4_engine()

# %% [markdown]
# ## 4 · Perplexity: what did quantization cost?
#
# A language model assigns each token a probability given the tokens before it. On a text of `T` predicted
# tokens, the **mean negative log-likelihood** is `NLL = −(1/T) Σ_t log p(x_t | x_<t)` (nats per token), and
# the **perplexity** is `exp(NLL)`: the number of equally likely tokens the model is, on average, as unsure as.
# A uniform guess over `V` tokens has perplexity `V`; the bundled model's held-out loss, 2.063 nats per token, is a
# perplexity of 7.9.
#
# A model sees a bounded context, so a long text is cut into **windows**. minifer's framing
# (`minifer/eval.py`, the one the bundled models were trained with): windows of `window + 1` tokens from the
# start of the stream, consecutive windows **sharing one token**, and the tail that does not fill a window
# dropped. Each window is run as its own sequence from position 0 and predicts its last `window` tokens:
#
# ```
# stream     <eot> a  b  c  d  e  f  g  h  i  j        window = 4: n = (11 - 1) // 4 = 2 windows
# window 0  [<eot> a  b  c  d]                          predicts a b c d   (<eot> is context only)
# window 1                 [d  e  f  g  h]              predicts e f g h   (d is context only)
# tail                                   i  j           dropped (fewer than window + 1 tokens left)
# ```
#
# The perplexity is **token-weighted**: the NLL is averaged over all `n · window` predicted tokens, then
# exponentiated once. (The mean of the windows' perplexities is larger: exp is convex.)
#
# Write `perplexity(model_fn, token_ids, window)`. `model_fn(ids)` takes a batch of sequences `[B, T]` and
# returns logits `[B, T, V]`, where position `t` holds the prediction of token `t + 1`; `token_ids` is a 1-D
# tensor. Return a float. `F.cross_entropy(logits, targets, reduction="none")` gives the NLL of each target.

# %%
@torch.inference_mode()
def model_fn(ids: torch.Tensor) -> torch.Tensor:
    """The bundled model's logits [B, T, V] for B independent sequences [B, T], each from position 0."""
    return model.compute_logits(causal_forward(model, ids)).view(*ids.shape, -1)


# %%
def perplexity(model_fn, token_ids: torch.Tensor, window: int) -> float:
    """Token-weighted perplexity of ``token_ids`` (1-D) under ``model_fn``, in windows of ``window + 1``
    tokens that share one token with the next (the tail that fills no window is dropped)."""
    ### BEGIN SOLUTION
    n = (len(token_ids) - 1) // window
    windows = torch.stack([token_ids[i * window : i * window + window + 1] for i in range(n)])
    logits = model_fn(windows[:, :-1]).float()  # [n, window, V]: position t predicts token t + 1
    nll = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none")
    return float(nll.double().mean().exp())
    ### END SOLUTION


# %% [markdown]
# The check uses a synthetic model first (a bigram table plus a bias per position, so that where a window
# starts matters, as it does for a real model), then the bundled model against `minifer.eval.perplexity`.

# %% nbval-check-output
from minifer_course.grading.quant import check_perplexity

check_perplexity(perplexity)

# %% [markdown]
# Now the measurement this chapter is about, with minifer's `perplexity` (the same computation, batched) on
# 2 048 held-out story tokens and 2 048 tokens of Python standard-library code (a domain the model never
# saw), for the model in float32 and quantized copies (round-to-nearest, every decoder linear layer; the
# embeddings and `lm_head` stay in float32). The numbers are computed on this machine when the cell runs.

# %%
import copy

domains = {"stories": heldout_windows(llm.tokenizer, max_len=256, max_tokens=2048),
           "stdlib code": stdlib_windows(llm.tokenizer, max_len=256, max_tokens=2048)}
base = {name: minifer_perplexity(model, w) for name, w in domains.items()}
print(f"{'weights':<22}" + "".join(f"{name:>24}" for name in domains))
print(f"{'float32':<22}" + "".join(f"{base[name]:>24.3f}" for name in domains))
for label, method, group, symmetric in [("int8", "int8", 128, True), ("int4 g128 symmetric", "int4", 128, True),
                                        ("int4 g128 asymmetric", "int4", 128, False),
                                        ("int4 g32 symmetric", "int4", 32, True)]:
    quantized = copy.deepcopy(model)
    quantize_model(quantized, method, group, symmetric)
    cells = []
    for name, w in domains.items():
        p = minifer_perplexity(quantized, w)
        cells.append(f"{p:.3f} ({100 * (p / base[name] - 1):+.1f}%)")
    print(f"{label:<22}" + "".join(f"{c:>24}" for c in cells))

# %% [markdown]
# On the stories, int8 is close to free and int4 costs about a percent of perplexity; smaller groups and zero
# points win a little of it back for a few more bits per weight. On code the model is hopeless to begin with
# (a perplexity far above its 2048-token vocabulary: it is confidently wrong), and there the quantized models
# move by several percent, in both directions. Far from its training data a model's predictions are fragile,
# and the change measured on one workload says little about another: measure quantization on *your*
# workload before shipping it. Calibrated methods (GPTQ, `minifer/compress/gptq.py`; AWQ) lose less than
# round-to-nearest.
#
# ## Where these live in the engine
#
# * `quantize_int4_groupwise` is `minifer.quantization.formats.quantize_int4` (with `pack_int4`, `unpack_int4`,
#   `dequantize`); `quantize_linears` is the int4 path of `quantize_model` (`minifer/quantization/model.py`), which the
#   loader calls when `LLM(quantization="int4")` asks (your step ran on the loaded model instead: no seam);
# * `int4_matmul_kernel` is a simple version of `minifer/kernels/quant_matmul.py`: its `tiled` path is the
#   same loop with tensor-core tiles, and its `gemv` path for decode splits K across programs and decodes a
#   32-bit word of eight codes at a time; `int4_matmul_torch` is what `quant_linear_reference`
#   (`minifer/quantization/formats.py`) does, minifer's CPU path and the kernels' oracle;
# * `perplexity` is `minifer.eval.perplexity` (with `token_windows`, `score_windows`), beside greedy and
#   generation agreement, the other two quality measures of chapter 05.
