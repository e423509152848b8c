"""Speculative decoding's proposers (vLLM's ``v1/spec_decode``):
n-gram, draft model, EAGLE, and what they hand the speculator."""
