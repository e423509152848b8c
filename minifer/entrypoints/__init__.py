"""The OpenAI-compatible server, in vLLM's layout: ``engine_loop`` (the one thread that owns ``LLMEngine``),
``preprocess`` (request bodies to validated sequences, on the request side), ``api_server`` (the ASGI app's
routes) and ``http_protocol`` (uvicorn's HTTP/1.1 protocol with read timeouts and a connection bound).
``minifer.serve`` starts them; ``minifer.openai_protocol`` is the format between requests and the engine."""
