"""Model implementations. One architecture family (Llama / Qwen2 / Qwen3) in ``llama.py``."""

from minifer.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
