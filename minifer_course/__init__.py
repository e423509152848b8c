"""The course's machinery: what the notebooks call to compare, measure and draw, and the exercises' graders.

One module per chapter (``ch00_generation`` ... ``ch05_quantization``) plus ``common`` (which models to run, the
notebook's setup, tables), ``grading`` (one module per exercise notebook, on the machinery of
``grading.base``), and the chapters' experiments: ``roofline`` (01), ``kv_memory`` (02), ``block_order`` (04),
``kv_quant`` (05) and ``stacking`` (06), each runnable as ``python -m minifer_course.NAME``; ``experiments``: the
project's own measurements behind the appendices (adaptive k, the CPU path's targets, the HTTP layer's cost, the
kernels compiled ahead of time), each ``python -m minifer_course.experiments.NAME``; ``doctor`` checks
that an installation is ready for the course (``python -m minifer_course.doctor``). The course builds on the engine
and never the other way: nothing in ``minifer`` imports this package (an import contract in ``pyproject.toml``,
``lint-imports``, checks it), so the engine a learner reads stays the engine.
"""
