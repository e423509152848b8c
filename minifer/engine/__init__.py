"""The generation engine: request state (``sequence``), paging, scheduling, the step, speculation, the
static-batching baseline, and ``LLMEngine`` (``llm_engine``), which ``LLM`` (``minifer.entrypoints.llm``) and the
server drive."""
