"""Measurement code the course notebooks call, so that notebooks hold prose, calls and plots only.

- ``minifer.bench.roofline``: FLOP and byte counts of one forward step (prefill or decode), this machine's
  memory bandwidth and matmul rate, timed prefill/decode sweeps of a model, and the bandwidth bound on
  decode tokens/s for published models. ``python -m minifer.bench.roofline --out runs/roofline.json``
  runs the chapter-01 measurements and writes them, with hardware and version metadata, as JSON.
- ``minifer.bench.workloads`` and ``minifer.bench.serving``: seeded request workloads and the serving
  benchmarks of the engine chapters (``python -m minifer.bench --help``).
- ``minifer.bench.speculative`` (chapter 04); ``quality``, ``kv_quant`` and ``quant_kernels`` (chapter 05);
  ``stacking`` (chapter 06: the levers alone and stacked in one memory budget), each with its own ``--help``.

Submodules are not imported here, so ``python -m minifer.bench.roofline`` runs without the warning that
``runpy`` gives when a package has already imported the module it is asked to run.
"""
