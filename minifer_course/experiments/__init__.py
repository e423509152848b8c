"""The project's own measurements, each runnable as ``python -m minifer_course.experiments.NAME``: not benchmarks a
user runs against any engine (those are ``minifer.bench``), but the experiments behind the chapters' and the
appendices' claims about this engine.

- ``adaptive_control``, ``adaptive_split``, ``adaptive_pooled``: is adaptive k slower than plain decoding where it
  does not speculate, where does that cost lie, and what the committed rounds say pooled (appendix 04);
- ``cpu_targets`` with ``cpu_bounds``: the CPU peer benchmark (``minifer.bench.cpu_peer``) with the two bounds the
  CPU engine is held to and the project's targets read off the same run (chapter 01);
- ``server_overhead``: what the HTTP layer costs against the engine driven directly (appendix 00);
- ``aot``: every Triton kernel compiled ahead of time for GPU targets without a GPU (registers, spills,
  instructions per weight; appendix 05).

Submodules are not imported here, so ``python -m`` runs each without ``runpy``'s warning.
"""
