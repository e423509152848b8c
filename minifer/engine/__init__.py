"""The generation engine: request state (``sequence``), the static batching loop, and the ``LLM`` facade."""
