"""The OpenAI-compatible server (vLLM's ``entrypoints/openai``): its app, protocol, request processing and metrics."""
