"""int4 weights in the GPTQ checkpoint layout, the one vLLM, transformers (through GPTQModel) and AutoGPTQ read.

minifer's int4 (``quantization/formats.py``) keeps ``nn.Linear``'s orientation, ``[N, K]``, two codes per byte. The GPTQ
layout, fixed by the original GPTQ code and AutoGPTQ and read by every GPTQ kernel since, is transposed
(``[K, N]``, inputs first) and packs into int32 words. Per linear layer, ``g`` the group size::

    qweight  int32   [K / 8, N]    word (r, n) holds the codes of inputs 8r .. 8r+7 of output n,
                                   input 8r + j in bits 4j .. 4j+3 (the first input in the low nibble)
    qzeros   int32   [K / g, N / 8] word (i, c) holds the zero points of outputs 8c .. 8c+7 of group i,
                                   output 8c + j in bits 4j .. 4j+3
    scales   float16 [K / g, N]
    g_idx    int32   [K]           the group of each input: k // g here (no act-order permutation)
    w[k, n] = scales[g_idx[k], n] * (code[k, n] - zero[g_idx[k], n])

and the one trap of the format: in ``checkpoint_format="gptq"`` (v1, what AutoGPTQ wrote and most published
checkpoints use) each zero point is stored *minus one* and readers add the one back; ``"gptq_v2"`` (GPTQModel)
stores it as is. Symmetric int4 has zero point 8 everywhere, so a v1 ``qzeros`` word is ``0x77777777``. v1
cannot store a zero point of 0 (it would be -1, which a 4-bit field cannot hold): an asymmetric group whose
values are all >= 0 has one (``quantization/formats.py`` widens a group's range to include 0), so such a weight needs v2.

Groups are always contiguous (``desc_act=False``, ``g_idx == k // g``): ``minifer.compress.gptq``'s act-order keeps
each group's columns together ("static groups"), the plain layout every kernel reads fastest. A checkpoint with a
permuted ``g_idx`` is refused by ``from_gptq`` rather than silently misread.
"""

from __future__ import annotations

import torch

from minifer.quantization.formats import QuantizedWeight, pack_int4

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
PACK = 8  # 4-bit codes per int32 word
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # bit offset of nibble j


def _unpack_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of ``minifer.compress.gptq_export``'s packing: int32 words -> int64 codes 0..15, eight per word along ``dim``."""
    w = words.to(torch.int64).movedim(dim, -1)
    codes = (w[..., None] >> SHIFTS.to(torch.int64)) & 0xF
    return codes.reshape(*w.shape[:-1], w.shape[-1] * PACK).movedim(-1, dim)


def check_gptq_shape(name: str, n: int, k: int, group_size: int) -> None:
    """The layout packs K and N by eights and groups K by ``group_size``: say which does not fit."""
    if k % PACK or n % PACK:
        raise ValueError(f"{name}: the GPTQ layout packs 8 codes per int32 along K (qweight) and along N (qzeros), "
                         f"so both must be multiples of 8; this layer is [N={n}, K={k}]")
    if k % group_size:
        raise ValueError(f"{name}: group_size {group_size} does not divide K={k}")


def from_gptq(tensors: dict[str, torch.Tensor], group_size: int, symmetric: bool,
              checkpoint_format: str = "gptq", name: str = "weight") -> QuantizedWeight:
    """The ``QuantizedWeight`` a GPTQ layer's ``qweight``/``qzeros``/``scales``/``g_idx`` stand for (inverse of
    ``minifer.compress.gptq_export.to_gptq`` up to the scales' float16 rounding). ``symmetric``: the checkpoint's
    ``sym`` (zero points all 8). Raises ``ValueError`` naming what does not fit minifer's int4."""
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"{name}: checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    missing = [t for t in ("qweight", "qzeros", "scales") if t not in tensors]
    if missing:
        raise ValueError(f"{name}: missing {missing}")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2 or qzeros.dim() != 2:
        raise ValueError(f"{name}: qweight and qzeros must be 2-D int32, got {qweight.dtype} {tuple(qweight.shape)} "
                         f"and {qzeros.dtype} {tuple(qzeros.shape)}")
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    check_gptq_shape(name, n, k, group_size)
    want = {"qzeros": (k // group_size, n // PACK), "scales": (k // group_size, n)}
    for t, shape in want.items():
        if tuple(tensors[t].shape) != shape:
            raise ValueError(f"{name}: {t} has shape {tuple(tensors[t].shape)}, expected {shape} for qweight "
                             f"{tuple(qweight.shape)} and group_size {group_size}")
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // group_size):
        raise ValueError(f"{name}: g_idx is not k // group_size (an act-order checkpoint with permuted groups); "
                         f"minifer's int4 stores contiguous groups only")
    zeros = _unpack_words(qzeros, dim=1) + (1 if checkpoint_format == "gptq" else 0)
    if int(zeros.max()) > 15:
        raise ValueError(f"{name}: a zero point is 16 (stored 15 in checkpoint_format='gptq'): not a 4-bit value; "
                         f"was this checkpoint written in 'gptq_v2'?")
    if symmetric and not bool((zeros == 8).all()):
        raise ValueError(f"{name}: sym=true but the zero points are not all 8")
    codes = _unpack_words(qweight, dim=0).T.to(torch.uint8).contiguous()  # [N, K]
    qw = QuantizedWeight("int4", pack_int4(codes), scales.float().T.contiguous(),
                         None if symmetric else zeros.T.to(torch.uint8).contiguous(), group_size, (n, k))
    return qw.validate()
