"""Benchmarks a user would run against any engine: offline throughput and online serving (``serving``, with the
seeded request ``workloads``; ``python -m minifer.bench --help``), speculative decoding (``speculative``, ``eagle``),
the quality and kernels of quantization (``quality``, ``quant_kernels``), latency through the HTTP server
(``server_sweep``) and the CPU path against a production CPU engine, CTranslate2, with each CPU lever alone
(``cpu_peer``), each with its own ``--help``; ``machine`` describes the machine a result ran on and ``provenance``
the code and checkpoints. The course's experiments (the chapters', and the project's own: adaptive k, the CPU
path's bounds and targets, the HTTP layer's cost, the Triton kernels compiled ahead of time) live in
``minifer_course``.

Only ``provenance`` is imported here, so that its record of the checkpoints a run reads starts before any benchmark
loads one; the other submodules are not, so ``python -m minifer.bench.speculative`` runs without the warning that
``runpy`` gives when a package has already imported the module it is asked to run.
"""

from minifer.bench import provenance  # noqa: F401 (starts the record of the checkpoints a run reads)

