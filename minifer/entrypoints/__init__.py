"""The entry points, in vLLM's layout: ``llm`` (``LLM``, the offline one) and the OpenAI-compatible server,
``engine_loop`` (the one thread that owns ``LLMEngine``), ``preprocess`` (request bodies to validated sequences,
on the request side), ``api_server`` (the ASGI app's routes) and ``http_protocol`` (uvicorn's HTTP/1.1 protocol
with read timeouts and a connection bound). ``minifer.entrypoints.openai.serve`` starts the server; ``minifer.entrypoints.openai.protocol`` is
the format between requests and the engine."""
