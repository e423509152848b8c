"""Graders for the course exercises, one module per exercise notebook, shared with the test suite.

``base`` holds the machinery (``run_checks``, ``assert_close``, seeded inputs, what counts as the learner's error);
``building_blocks`` grades exercise 00, ``diagnose`` 01, ``paging`` 02_03, ``spec`` 04, ``quant`` 05, ``stacking`` and
``measure`` 06.
"""
