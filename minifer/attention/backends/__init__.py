"""Attention backends: each reads and writes the paged KV cache through one step's metadata."""
