"""The CPU's speed switches of ``compilation_config`` (vLLM's ``compilation/``),
each checked token-identical to the eager model."""
