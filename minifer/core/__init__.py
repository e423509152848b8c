"""The engine core's bookkeeping (vLLM's ``v1/core``): the KV cache manager and, in ``sched/``, the scheduler."""
