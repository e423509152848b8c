"""Attention (vLLM's ``attention/``): the layer the model calls, and the paged-KV backend with its metadata."""
