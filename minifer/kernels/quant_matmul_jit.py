"""The Triton kernels of ``quant_matmul.py`` (whose docstring has the three paths): codes to numbers in registers,
then multiply-adds or tensor-core dots.

The dequantization must be as cheap as the loads: at batch 1 an H200 must turn ~10^13 codes a second into floats
to keep up with its memory, and integer-to-float conversion runs at 1/8 of the rate of a multiply-add. So codes
become floats by *bit tricks*: ``0x4B000000 | q`` read as a float32 is exactly ``2^23 + q`` (the low mantissa bits
of 2^23 count in units of 1), and one subtraction of ``2^23 + zero_point`` leaves ``q - z`` exactly; fp8 e4m3
shifted into a float16's bits is its value times 2^-8 (``fp8.py``). For the tensor cores int4 goes straight to
bfloat16: ``0x4300 | q`` is ``128 + q``, and two codes 16 bits apart in a word become two bfloat16 with one AND-OR.
int4's two codes per byte pair up with two neighbouring activations, so ``x`` is read as 32-bit *pairs* (a bf16
pair is one word, split by a shift and a mask) instead of with stride-2 loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from minifer.kernels.fp8 import fp8_to_f32

INT8, INT4, FP8 = 0, 1, 2
X_BF16, X_FP16, X_FP32 = 0, 1, 2
MAGIC = 0x4B000000  # float32 bits of 2^23


# --- bits to numbers (run in registers, shared by both kernels) ----------------------------------------


@triton.jit
def _int8_to_f32(b):
    """int8 code (sign-extended to int32) -> float32: 2^23 + 128 + q as bits, minus 2^23 + 128."""
    return (b + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _int4_to_f32(b, z):
    """A byte of two codes -> ``(q_lo - z, 16 * (q_hi - z))`` in float32, exactly. The high code is left in
    place (times 16) to save a shift; callers scale its products by 1/16."""
    lo = ((b & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + z)
    hi = ((b & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + 16.0 * z)
    return lo, hi


@triton.jit
def _code_to_f32(word, z, magic, POS: tl.constexpr):
    """The 4-bit code at bit ``POS`` (at most 16) of a 32-bit word, decoded in place: ``2^POS (q - z)`` in
    float32, exactly — one logic op (``magic`` is 2^23's bits, passed at run time so that it stays in a
    register rather than being rebuilt before every op)."""
    return ((word & (0xF << POS)) | magic).to(tl.float32, bitcast=True) - (8388608.0 + z * (1 << POS))


@triton.jit
def _split_pairs(w, XKIND: tl.constexpr):
    """A word holding activations ``(x[2j], x[2j+1])`` (int32 for 16-bit x, int64 for float32) -> both as float32."""
    if XKIND == 0:  # bf16: the top 16 bits of a float32
        xe = (w << 16).to(tl.float32, bitcast=True)
        xo = (w & -65536).to(tl.float32, bitcast=True)
    elif XKIND == 1:  # fp16
        xe = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        xo = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:  # float32 pair in an int64
        xe = w.to(tl.int32).to(tl.float32, bitcast=True)
        xo = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return xe, xo


@triton.jit
def _epilogue(acc, rm, rn, M, N, out_ptr, bias_ptr, part_ptr, lock_ptr, tile, HAS_BIAS: tl.constexpr):
    """Write ``acc`` ([len(rm), len(rn)], float32) as output rows ``rm``, columns ``rn``. With split-K
    (``num_programs(axis 1) > 1``) it is a partial sum: the last of the tile's programs reduces them."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm[:, None] * N + rn[None, :]
    splits = tl.num_programs(1)
    last = splits == 1
    if splits > 1:
        tl.store(part_ptr + tl.program_id(1) * M * N + offs, acc, mask=mask)
        # acq_rel: our partials are visible before the count, and the last program sees everyone's.
        last = tl.atomic_add(lock_ptr + tile, 1) == splits - 1
        if last:
            acc = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, splits):
                acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --- decode on CUDA cores ------------------------------------------------------------------------------


@triton.jit
def _gemv_loads(w_rows, x_row, s_ptr, z_ptr, rn, n_mask, chunk, j, n_chunks, c_end, FMT: tl.constexpr,
                HAS_ZEROS: tl.constexpr, GW: tl.constexpr, GW_P2: tl.constexpr):
    """Everything one gemv step reads for ``chunk`` (chunks at or past ``c_end`` are masked off): the
    codes ``[BLOCK_N, CHUNKS, GW]``; int4: the four activation pairs of each word, and the group scales and
    zero points; int8/fp8: the activations (returned four times, to keep one signature)."""
    col = chunk[:, None] * GW + j[None, :]  # [CHUNKS, GW_P2] unit column in the row
    ok = (chunk < c_end)[:, None]
    if GW_P2 != GW:  # an int4 group of an odd number of words
        ok = ok & (j < GW)[None, :]
    b = tl.load(w_rows + col[None, :, :], mask=n_mask[:, None, None] & ok[None, :, :], other=0)
    if FMT == 1:
        x0 = tl.load(x_row + 4 * col, mask=ok, other=0)
        x1 = tl.load(x_row + 4 * col + 1, mask=ok, other=0)
        x2 = tl.load(x_row + 4 * col + 2, mask=ok, other=0)
        x3 = tl.load(x_row + 4 * col + 3, mask=ok, other=0)
        gs = rn[:, None] * n_chunks + chunk[None, :]  # [BLOCK_N, CHUNKS] scale / zero-point index
        gs_mask = n_mask[:, None] & (chunk < c_end)[None, :]
        sc = tl.load(s_ptr + gs, mask=gs_mask, other=0.0)
        zp = tl.load(z_ptr + gs, mask=gs_mask, other=0) if HAS_ZEROS else sc
    else:
        x0 = tl.load(x_row + col, mask=ok, other=0.0)
        x1, x2, x3, sc, zp = x0, x0, x0, x0, x0
    return b, x0, x1, x2, x3, sc, zp


@triton.jit
def quant_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, ROW, M_KEY, magic,
                      SPLIT_PER_SM, FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, FP8_NATIVE: tl.constexpr, XKIND: tl.constexpr, GW: tl.constexpr,
                      GW_P2: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    """Grid ``(M * cdiv(N, BLOCK_N), splits)``; row ``m`` varies fastest so programs reading the same
    weights run together (the second reader hits L2). ``SPLIT_PER_SM`` is not read here: the launcher
    picks the number of splits from it (``choose_split``), and as a config entry the autotuner tries it.

    A row of W is ``ROW`` units — int4: 32-bit words of 8 codes, else bytes — cut into chunks of ``GW``
    units that divide it (int4: one quantization group, so a chunk has one scale and zero point); a tile
    is ``[BLOCK_N, CHUNKS, GW]`` units. No mask runs along a chunk, so its loads are 16-byte vectors; the
    products accumulate element-wise and are summed once after the loop (a sum across threads inside it
    would cost more shuffles than multiply-adds).

    int4 decodes a whole word at a time: nibble ``i`` of a 16-bit half masked in place, ``h & (0xF << 4i)``,
    or-ed into 2^23 is ``2^23 + 16^i q`` exactly, so one logic op per code and one shift per half word;
    the 16^i goes into the activation it multiplies.
    """
    pid = tl.program_id(0)
    m = pid % M
    pid_n = pid // M
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    c = tl.arange(0, CHUNKS)
    j = tl.arange(0, GW_P2)
    n_chunks = ROW // GW
    per_split = tl.cdiv(tl.cdiv(n_chunks, tl.num_programs(1)), CHUNKS) * CHUNKS
    c_start = tl.program_id(1) * per_split
    c_end = tl.minimum(c_start + per_split, n_chunks)
    w_rows = q_ptr + rn.to(tl.int64)[:, None, None] * ROW
    if FMT == 1:
        x_row = x_ptr + m * ROW * 4  # int4: x as pairs (one 32-bit word of bf16/fp16), 4 per word of W
    else:
        x_row = x_ptr + m * ROW
    acc = tl.zeros((BLOCK_N, CHUNKS, GW_P2), tl.float32)
    # Software pipelining by hand: the loads of step i + 1 are issued before step i's arithmetic, so the
    # memory latency hides behind it (the loop carries the loaded tiles).
    b, x0, x1, x2, x3, sc, zp = _gemv_loads(w_rows, x_row, s_ptr, z_ptr, rn, n_mask, c_start + c, j, n_chunks,
                                            c_end, FMT, HAS_ZEROS, GW, GW_P2)
    for c0 in range(c_start, c_end, CHUNKS):
        nb, nx0, nx1, nx2, nx3, nsc, nzp = _gemv_loads(w_rows, x_row, s_ptr, z_ptr, rn, n_mask, c0 + CHUNKS + c, j,
                                                       n_chunks, c_end, FMT, HAS_ZEROS, GW, GW_P2)
        if FMT == 1:
            z = zp.to(tl.float32)[:, :, None] if HAS_ZEROS else 8.0
            part = tl.zeros((BLOCK_N, CHUNKS, GW_P2), tl.float32)
            b12 = (b.to(tl.uint32, bitcast=True) >> 12).to(tl.int32, bitcast=True)  # codes 5..7 at bits 8..19
            for byte in tl.static_range(4):  # activations 2 * byte and 2 * byte + 1 of the word's 8
                xe, xo = _split_pairs(x0 if byte == 0 else x1 if byte == 1 else x2 if byte == 2 else x3, XKIND)
                for odd in tl.static_range(2):
                    code = 2 * byte + odd
                    pos = 4 * code if code <= 4 else 4 * code - 12  # where the code sits in b or b12
                    f = _code_to_f32(b if code <= 4 else b12, z, magic, pos)
                    part += f * ((xo if odd else xe) * (1.0 / (1 << pos)))[None, :, :]
            acc += part * sc[:, :, None]
        else:
            if FMT == 0:
                w = _int8_to_f32(b.to(tl.int32))
            else:
                w = fp8_to_f32(b, FP8_NATIVE)
            acc += w * x0.to(tl.float32)[None, :, :]
        b, x0, x1, x2, x3, sc, zp = nb, nx0, nx1, nx2, nx3, nsc, nzp
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    if FMT != 1:
        s = tl.load(s_ptr + rn, mask=n_mask, other=0.0)
        if FMT == 2 and not FP8_NATIVE:
            s = s * 256.0
        y = y * s
    _epilogue(y[None, :], m + tl.arange(0, 1), rn, M, N, out_ptr, bias_ptr, part_ptr, lock_ptr, pid, HAS_BIAS)


# --- tensor-core tiles ---------------------------------------------------------------------------------


@triton.jit
def quant_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, ROW, M_KEY,
                      SPLIT_PER_SM, FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, FP8_NATIVE: tl.constexpr, XKIND: tl.constexpr, DOT_F32: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Grid ``(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits)``: ``acc[BLOCK_M, BLOCK_N] += x_tile @ W_tile^T``, the W
    tile (``[BLOCK_K, BLOCK_N]``, read transposed from W's rows) dequantized in registers.

    int4: ``BLOCK_K`` divides the group, so a K-step has one scale per column, applied to its product
    (``(x @ (q - z)) * s``: integers times activations are exact in bf16, so the only rounding is the float32
    accumulation); the tile's even and odd columns are two dots of ``BLOCK_K / 2``. int8/fp8: one scale per column,
    applied once after the loop."""
    # Grouped ordering (the Triton matmul tutorial): GROUP_M row tiles share each column tile while it is in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % rows
    pid_n = (pid % (GROUP_M * num_n)) // rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    xdt = out_ptr.dtype.element_ty  # x's dtype (int4 reads x as int pairs)
    if DOT_F32:  # the interpreter's tl.dot multiplies bf16 bit patterns, not their values
        xdt = tl.float32
    n_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(n_steps, tl.num_programs(1))
    t_start = tl.program_id(1) * per_split
    t_end = tl.minimum(t_start + per_split, n_steps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if FMT == 1:
        tl.static_assert(GROUP % BLOCK_K == 0, "an int4 K-step must lie inside one quantization group")
        KB: tl.constexpr = BLOCK_K // 2
        n_groups = K // GROUP
        kb = tl.arange(0, KB)
        for t in range(t_start, t_end):
            col = t * KB + kb  # K % BLOCK_K == 0 for int4: no K mask
            b = tl.load(q_ptr + rn.to(tl.int64)[None, :] * ROW + col[:, None], mask=n_mask[None, :], other=0)
            g = (t * BLOCK_K) // GROUP
            if HAS_ZEROS:
                z = tl.load(z_ptr + rn * n_groups + g, mask=n_mask, other=0).to(tl.float32)
            else:
                z = tl.full((BLOCK_N,), 8.0, tl.float32)
            lo, hi = _int4_to_f32(b.to(tl.int32), z[None, :])
            xe, xo = _split_pairs(tl.load(x_ptr + rm[:, None] * ROW + col[None, :], mask=m_mask[:, None], other=0),
                                  XKIND)
            part = tl.dot(xe.to(xdt), lo.to(xdt), input_precision="ieee")
            part += tl.dot(xo.to(xdt), hi.to(xdt), input_precision="ieee") * 0.0625
            acc += part * tl.load(s_ptr + rn * n_groups + g, mask=n_mask, other=0.0)[None, :]
    else:
        kk = tl.arange(0, BLOCK_K)
        for t in range(t_start, t_end):
            k = t * BLOCK_K + kk
            k_mask = k < K
            b = tl.load(q_ptr + rn.to(tl.int64)[None, :] * ROW + k[:, None], mask=n_mask[None, :] & k_mask[:, None],
                        other=0)
            if FMT == 0:
                w = _int8_to_f32(b.to(tl.int32))
            else:
                w = fp8_to_f32(b, FP8_NATIVE)
            xt = tl.load(x_ptr + rm[:, None] * ROW + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(xt.to(xdt), w.to(xdt), acc, input_precision="ieee")
        s = tl.load(s_ptr + rn, mask=n_mask, other=0.0)
        if FMT == 2 and not FP8_NATIVE:
            s = s * 256.0
        acc = acc * s[None, :]
    _epilogue(acc, rm, rn, M, N, out_ptr, bias_ptr, part_ptr, lock_ptr, pid, HAS_BIAS)


# --- int4 decode on tensor cores -----------------------------------------------------------------------


@triton.jit
def _int4_pairs(b, SHIFT: tl.constexpr, PTX: tl.constexpr):
    """Codes ``c = SHIFT / 4`` and ``c + 4`` of every 32-bit word of ``b`` ``[R, W]`` as bfloat16 ``128 + q``,
    interleaved: ``[R, 2W]``, column ``2j + h`` is code ``c + 4h`` of word ``j``. One AND-OR per two codes:
    code c + 4 sits 16 bits above code c, so ``(b >> SHIFT) & 0x000F000F | 0x43004300`` is two bfloat16
    at once, and 0x4300 is 128.0 (its 7 mantissa bits count in units of 1, so 128 + q is exact).

    ``PTX`` (a GPU, not the interpreter): the AND-OR written as one ``lop3`` (0xEA: ``a & b | c``) that hands
    back the word's halves as the two bfloat16, because not every ptxas release fuses the two ops or keeps the
    halves in place by itself (the counts: ``benchmarks/results/README.md``)."""
    v = b >> SHIFT
    if PTX:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA; mov.b32 {$0, $1}, t; }", "=h,=h,r", [v],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        v = (v & 0x000F000F) | 0x43004300
        lo = v.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (v >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.interleave(lo, hi)


@triton.jit
def _int4_plane(b, C: tl.constexpr, off, DOT_F32: tl.constexpr):
    """Code plane ``C`` of the words ``b`` ``[R, W]``: codes ``C`` and ``C + 4`` of each word (``_int4_pairs``),
    ``[R, 2W]``, minus ``off``: 136 (128 and the symmetric zero point 8), or ``128 + z`` per row ``[R, 1]``
    with zero points. Exact in bfloat16 either way: integers below 256."""
    w = _int4_pairs(b, 4 * C, not DOT_F32)
    if DOT_F32:  # the interpreter's bfloat16 arithmetic is not exact: the same numbers in float32
        w = w.to(tl.float32)
    return w - off


@triton.jit
def _int4_planes(b, off, DOT_F32: tl.constexpr):
    """The four code planes of the words ``b`` ``[R, W]`` (``_int4_plane``) side by side along K, ``[R, 8W]``:
    column ``c' * 2W + 2j + h`` is code ``c + 4h`` of word ``j`` for plane ``c = (0, 2, 1, 3)[c']`` (the order
    ``tl.join`` nests them in)."""
    w = tl.join(tl.join(_int4_plane(b, 0, off, DOT_F32), _int4_plane(b, 2, off, DOT_F32)),
                tl.join(_int4_plane(b, 1, off, DOT_F32), _int4_plane(b, 3, off, DOT_F32)))
    R: tl.constexpr = b.shape[0]
    W: tl.constexpr = b.shape[1]
    return tl.reshape(tl.permute(w, (0, 3, 2, 1)), (R, 8 * W))


@triton.jit
def _x_in_plane_order(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activations ``x`` ``[BLOCK_M, BLOCK_K]`` in K order, rearranged to ``_int4_planes``' order and
    transposed: ``[BLOCK_K, BLOCK_M]``. Position ``8j + 4h + c`` of a K-step is code ``c + 4h`` of word ``j``."""
    x = tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 2, 2, 2))  # [m, j, h, c >> 1, c & 1]
    return tl.reshape(tl.permute(x, (4, 3, 1, 2, 0)), (BLOCK_K, BLOCK_M))


@triton.jit
def quant_int4_mma_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, ROW, M_KEY,
                          SPLIT_PER_SM, FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                          HAS_BIAS: tl.constexpr, FP8_NATIVE: tl.constexpr, XKIND: tl.constexpr,
                          DOT_F32: tl.constexpr, ONE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int4 on tensor cores, decode (8-16 rows of x per tile) and prefill (32-128) alike. Grid
    ``(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits)``.

    The weights are the *first* operand, ``acc[BLOCK_N, BLOCK_M] += dequant(W_tile) @ x_tile^T``, so the many output
    channels fill the MMA's 64-row side and the few rows of ``x`` its narrow one (8 or 16; sm_90's ``wgmma`` then
    takes the weights straight from registers). The words of codes are loaded as stored (``[BLOCK_N, BLOCK_K / 8]``)
    and decoded in the registers that feed the MMA: two codes per logic op (``_int4_pairs``), one subtraction per
    two codes (``- 136``: 128 and the symmetric zero point 8, or the row's ``128 + z``, as cheap from a register;
    exact in bfloat16). Nothing is unpacked into K order: a code plane (codes ``c`` and ``c + 4`` of each word) is
    multiplied by the activations at its positions. ``BLOCK_K`` divides ``GROUP``, so a K-step's scale multiplies
    its product, as in ``quant_gemm_kernel``.

    Two ways to feed the planes, the same sums. ``ONE_DOT`` (sm_90): the four planes side by side are one
    ``[BLOCK_N, BLOCK_K]`` operand (``_int4_planes``); the activations, loaded in K order (16-byte asynchronous
    copies), are rearranged to match in registers (``_x_in_plane_order``): one dot, one barrier and one wait per
    step. Otherwise (sm_80's ``mma.sync``, where Triton splits the joined planes' code pairs across threads): one
    dot per plane, its activations gathered from memory.

    FMT, FP8_NATIVE and XKIND are not read: the launcher passes every kernel the same arguments."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    rm = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of x vary fastest: same weights, close in time
    rn = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    KW: tl.constexpr = BLOCK_K // 8  # words of codes per K-step and row
    kw = tl.arange(0, KW)
    xdt = out_ptr.dtype.element_ty
    if DOT_F32:  # the interpreter's tl.dot multiplies bf16 bit patterns, not their values
        xdt = tl.float32
    n_groups = K // GROUP
    n_steps = K // BLOCK_K
    per_split = tl.cdiv(n_steps, tl.num_programs(1))
    t_start = tl.program_id(1) * per_split
    t_end = tl.minimum(t_start + per_split, n_steps)
    w_rows = q_ptr + rn.to(tl.int64)[:, None] * ROW
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for t in range(t_start, t_end):
        b = tl.load(w_rows + (t * KW + kw)[None, :], mask=n_mask[:, None], other=0)
        g = (t * BLOCK_K) // GROUP
        # Subtract 128 and the zero point from every code: 128 + 8 (symmetric), or 128 + z, one per row and
        # group (a [BLOCK_N, 1] column the subtraction broadcasts along the row).
        if HAS_ZEROS:
            off = 128.0 + tl.load(z_ptr + rn * n_groups + g, mask=n_mask, other=0).to(tl.float32)[:, None]
            off = off.to(tl.float32 if DOT_F32 else tl.bfloat16)
        else:
            off = 136.0
        if ONE_DOT:
            x = tl.load(x_ptr + rm[:, None] * K + (t * BLOCK_K + tl.arange(0, BLOCK_K))[None, :],
                        mask=m_mask[:, None], other=0.0)
            part = tl.dot(_int4_planes(b, off, DOT_F32).to(xdt), _x_in_plane_order(x, BLOCK_M, BLOCK_K).to(xdt),
                          input_precision="ieee")
        else:
            part = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            kk = tl.arange(0, 2 * KW)
            for c in tl.static_range(4):
                k = t * BLOCK_K + 8 * (kk // 2) + c + 4 * (kk % 2)  # the activations of plane c's codes
                xt = tl.load(x_ptr + rm[None, :] * K + k[:, None], mask=m_mask[None, :], other=0.0)
                part = tl.dot(_int4_plane(b, c, off, DOT_F32).to(xdt), xt.to(xdt), part, input_precision="ieee")
        acc += part * tl.load(s_ptr + rn * n_groups + g, mask=n_mask, other=0.0)[:, None]
    _epilogue(tl.trans(acc), rm, rn, M, N, out_ptr, bias_ptr, part_ptr, lock_ptr, pid, HAS_BIAS)
