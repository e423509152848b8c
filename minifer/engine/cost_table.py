"""``CostTable``: measured seconds of a forward by how many tokens it covers, robust to a noisy neighbour.

Adaptive speculation (``speculative.py``) predicts a step's time from it: the target's forwards, and a draft
model's (``proposers.py``), each refreshed by the steps that run.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from contextlib import ExitStack
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minifer.engine.runner import ModelRunner


class CostTable:
    """Measured seconds of a forward over ``n`` tokens.

    Per ``n`` it keeps the last few measurements and uses their median: on a shared machine single
    timings spike when a neighbour runs, and one spike must not switch speculation off. Across ``n`` the
    table is made non-decreasing (more tokens never cost less: a point above a larger ``n``'s is lowered),
    interpolated linearly in between, and extended linearly past the largest ``n`` measured (a compute-bound
    forward). Each ``n``'s median is updated when it is measured, so a step's refresh costs one median."""

    def __init__(self, window: int = 9) -> None:
        self.samples: dict[int, deque[float]] = {}
        self.window = window
        self._medians: dict[int, float] = {}  # per n, kept current by observe (a step changes only its own n)
        self._curve: tuple[list[int], list[float]] | None = None

    def observe(self, n: int, seconds: float) -> None:
        window = self.samples.setdefault(n, deque(maxlen=self.window))
        window.append(seconds)
        self._medians[n] = statistics.median(window)
        self._curve = None

    def curve(self) -> tuple[list[int], list[float]]:
        if self._curve is None:  # recomputed only after a new measurement (choose_k reads it many times)
            if self._medians.keys() != self.samples.keys():  # samples edited directly (tests, notebooks)
                self._medians = {n: statistics.median(w) for n, w in self.samples.items() if w}
            xs = sorted(self._medians)
            ys = [self._medians[x] for x in xs]
            for i in range(len(ys) - 2, -1, -1):  # non-decreasing from below: interference only ever adds time
                ys[i] = min(ys[i], ys[i + 1])
            self._curve = xs, ys
        return self._curve

    def __call__(self, n: int) -> float:
        xs, ys = self.curve()
        if not xs:
            return float(n)
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            return ys[-1] * n / xs[-1]
        j = bisect.bisect_left(xs, n)
        return ys[j - 1] + (ys[j] - ys[j - 1]) * (n - xs[j - 1]) / (xs[j] - xs[j - 1])


def calibrate_decode(runner: ModelRunner, table: CostTable, max_tokens: int = 128, context: int = 64) -> None:
    """Fill ``table`` with ``runner``'s forwards shaped like decode steps, once, at start-up while every block is free:
    1, 2, 4, ... scratch sequences with ``context`` cached tokens bring one new token each. Decode-shaped because
    a forward's time depends on how many sequences' caches it reads, not only on its token count (a table timed
    on one long prompt chunk underrates decode steps). Verify steps, with fewer sequences and more tokens each,
    differ too: for them the table is a first guess that their own steps refresh. The cached values stay zeros:
    the time depends on the sizes read, not the numbers."""
    blocks, n = runner.blocks, 1
    # a small cache holds a shorter context (down to one token): the timing still has one sequence
    ctx = min(context, blocks.block_size * blocks.num_free_blocks - 1)
    if ctx < 1:
        return  # not even two tokens fit: the table keeps its prior, refreshed by real steps
    while 2 * n <= max_tokens and 2 * n * blocks.blocks_needed(ctx + 1) <= blocks.num_free_blocks:
        n *= 2
    ids = [f"__calibrate{i}__" for i in range(n)]
    with ExitStack() as stack:
        for i, rid in enumerate(ids):  # distinct tokens: no prefix-cache sharing between them
            stack.enter_context(blocks.scratch(rid, [i + 1] * (ctx + 1)))
        m = 1
        while m <= n:
            runner.forward(ids[:m], [ctx] * m, [[0]] * m, [1] * m)  # warm-up
            for _ in range(3):
                runner.forward(ids[:m], [ctx] * m, [[0]] * m, [1] * m)
                table.observe(m, runner.last_forward_s)
            m *= 2
