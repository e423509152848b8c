"""Sampling (vLLM's ``v1/sample``): the sampler, and the rejection sampler that verifies speculative drafts."""
