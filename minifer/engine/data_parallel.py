"""Engine replicas behind one front: vLLM's ``data_parallel_size`` on the CPU's cores.

Splitting every op over two OpenMP threads scales a small model's decode poorly: each op is a few microseconds
of work, the threads meet at its end, and the Python between ops runs on one core anyway. Two independent
engines, one thread each in its own process, share nothing but the request list: how CTranslate2 uses two cores
(``inter_threads``) and what vLLM's data parallelism does across GPUs.

``EngineReplicas`` starts ``size`` such processes and splits a ``generate`` call between them: longest request
first (prompt plus ``max_tokens``), each to the replica with the fewest tokens so far; outputs come back in the
order of the prompts. A sampled request without its own ``seed`` draws from its replica's generator, so its text
depends on which replica served it.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any


def _serve(conn, make_llm, llm_kwargs: dict[str, Any], threads: int) -> None:
    """A replica: build ``make_llm(**llm_kwargs)``, then answer ``(prompts, params)`` with its ``generate``'s
    outputs until ``None``."""
    import torch

    torch.set_num_threads(threads)
    try:
        llm = make_llm(**llm_kwargs)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while (job := conn.recv()) is not None:
        try:
            conn.send(("ok", llm.generate(job[0], job[1], use_tqdm=False)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def balance(costs: list[int], size: int) -> list[list[int]]:
    """Indices of ``costs`` split into ``size`` lists: largest first, each to the least-loaded list."""
    loads, parts = [0] * size, [[] for _ in range(size)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        k = min(range(size), key=loads.__getitem__)
        parts[k].append(i)
        loads[k] += costs[i]
    return parts


class EngineReplicas:
    """``size`` single-thread processes, each running ``make_llm(**llm_kwargs)`` (the ``LLM`` class, passed in so
    this module does not import the front that imports it; the arguments must pickle: a model name, options)."""

    def __init__(self, make_llm, llm_kwargs: dict[str, Any], size: int, threads: int = 1) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked OpenMP or torch state
        self.conns, self.procs = [], []
        for _ in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, make_llm, llm_kwargs, threads), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            self._answer(conn)

    @staticmethod
    def _answer(conn):
        status, value = conn.recv()
        if status == "error":
            raise RuntimeError(f"an engine replica failed:\n{value}")
        return value

    def generate(self, prompts: list, params: list, costs: list[int]) -> list:
        """``LLM.generate`` over the replicas; ``costs[i]``: request i's tokens (prompt + max_tokens)."""
        busy = [(conn, part) for conn, part in zip(self.conns, balance(costs, len(self.conns))) if part]
        for conn, part in busy:
            conn.send(([prompts[i] for i in part], [params[i] for i in part]))
        outputs: list = [None] * len(prompts)
        for conn, part in busy:
            for i, out in zip(part, self._answer(conn)):
                outputs[i] = out
        return outputs

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(timeout=10)
        self.conns, self.procs = [], []

    def __del__(self) -> None:
        if getattr(self, "procs", None):
            self.close()


def start_replicas(make_llm, llm_kwargs: dict[str, Any], size: Any, shared: Any) -> EngineReplicas | None:
    """``LLM(data_parallel_size=size)``'s replicas: None for one engine (the ``LLM`` serves in its own process)."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {size!r}")
    if size == 1:
        return None
    if shared is not None or llm_kwargs["batching"] != "continuous":
        raise ValueError("data_parallel_size > 1 builds its own replicas of a continuous engine: no "
                         "share_weights_with, batching='continuous'")
    return EngineReplicas(make_llm, llm_kwargs, size)
