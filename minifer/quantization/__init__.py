"""Weight-only quantization: the formats and their PyTorch reference (``formats``); the fused Triton
dequantize-matmul kernels live in ``minifer/kernels/quant_matmul.py``."""

from minifer.quantization.formats import (
    FORMATS,
    QuantizedWeight,
    dequantize,
    pack_int4,
    quant_linear_reference,
    quantize,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

__all__ = ["FORMATS", "QuantizedWeight", "dequantize", "pack_int4", "quant_linear_reference", "quantize",
           "quantize_fp8", "quantize_int4", "quantize_int8", "unpack_int4"]
