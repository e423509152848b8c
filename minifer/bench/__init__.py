"""Benchmarks a user would run against any engine: offline throughput and online serving (``serving``, with the
seeded request ``workloads``; ``python -m minifer.bench --help``), speculative decoding (``speculative``), the
quality and kernels of quantization (``quality``, ``quant_kernels``) and the HTTP server (``server_overhead``,
``server_sweep``), each with its own ``--help``; ``machine`` describes the machine a result ran on and
``provenance`` the code. ``aot`` compiles every Triton kernel for GPU targets without a GPU (registers, spills,
instructions per weight); ``cpu_peer`` compares the CPU path with CTranslate2 and measures each CPU lever alone:
tools and experiments the engine never runs while serving.
The chapters' own experiments (roofline, KV memory, block order, the 8-bit KV cache's capacity, stacking the
levers) live in ``minifer_course``.

Submodules are not imported here, so ``python -m minifer.bench.speculative`` runs without the warning that
``runpy`` gives when a package has already imported the module it is asked to run.
"""
