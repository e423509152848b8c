"""Graders for the course exercises, one module per exercise notebook, shared with the test suite.

``base`` holds the machinery (``run_checks``, ``assert_close``, seeded inputs, what counts as the learner's error);
``building_blocks`` grades exercise 00_01, ``paging`` 02, ``batching`` 03 (on ``toy_engine``, a model-free engine, for
the engine step and preemption), ``spec`` 04, ``quant`` 05, ``stacking`` 06.
"""
