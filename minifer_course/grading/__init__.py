"""Graders for the course exercises, one module per exercise notebook, shared with the test suite.

``base`` holds the machinery (``run_checks``, ``assert_close``, seeded inputs, what counts as the learner's error);
``building_blocks`` grades exercise 00, ``diagnose`` 01, ``paging`` 02, ``batching`` 03 (on ``toy_engine``, a
model-free engine, for the engine step and preemption), ``spec`` and ``spec_step`` 04, ``quant``, ``quant_load`` and
``quant_engine`` 05, ``stacking`` and ``measure`` 06.
"""
