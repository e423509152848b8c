"""Offline compression: what runs once, before serving, to make a quantized checkpoint: GPTQ's calibration
(``gptq.py``) and writing the GPTQ layout other engines read (``gptq_export.py``).

vLLM draws the same line: it serves GPTQ checkpoints and leaves making them to llm-compressor and GPTQModel. Here
the engine core loads and serves what this package makes (``minifer.quantization``, ``minifer.model_loader``) and
never imports it (an import-linter contract in ``pyproject.toml``), so a reader of the engine meets no calibration
code and a server carries none.
"""

from minifer.compress.gptq import gptq_quantize_model, gptq_quantize_weight, output_error
from minifer.compress.gptq_export import save_gptq

__all__ = ["gptq_quantize_model", "gptq_quantize_weight", "output_error", "save_gptq"]
