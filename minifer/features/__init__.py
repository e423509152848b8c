"""Optional features: each plugs into a seam of the engine core, and a run that does not ask for one never calls it.

The core (``config``, ``loader``, ``models``, ``layers``, ``sampling``, ``engine``, ``spec``, ``quant``, ``kernels``)
is what every request goes through and what the chapters teach. Each module here builds on the core's interfaces;
the offline entry point (``entrypoints/llm.py``) imports those it wires in, and the core reaches them only at the
wiring points the import contract lists (``pyproject.toml``, "the engine core reaches optional features only at its
wiring points"):

- ``adaptive_k``, ``adaptive_ngram``: adaptive k, opt-in: how many tokens to speculate each step (an
  ``AdaptiveSpeculator`` in place of the fixed-k ``Speculator``);
- ``eagle``, ``eagle_head``: EAGLE drafting from the target's hidden states (a ``DraftProposer``);
- ``beam_search``: ``LLM.beam_search``, on the engine's own steps;
- ``data_parallel``: ``LLM(data_parallel_size=...)``, replicas in worker processes;
- ``compiled_decoder``, ``packed_linear``, ``weight_layout``: the CPU's speed switches of ``compilation_config``
  (``ModelRunner``'s ``compile_model``: the decoder under ``torch.compile``, oneDNN-packed weights, column-major
  weights), each checked token-identical to the eager model a learner reads;
- ``gptq_checkpoint``, ``gptq_layout``: loading (and, with ``minifer.compress``, writing) int4 checkpoints in
  the GPTQ layout vLLM and transformers read.
"""
