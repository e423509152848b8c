"""Does the order in which free KV blocks are handed out matter? (chapter 02; the allocator's docstring cites it)

    python -m minifer_course.block_order --out benchmarks/results/block_order.json
    python -m minifer_course.block_order --smoke          # seconds, for CI

A paged cache may put a sequence's blocks anywhere in the pool, and the block table finds them: correctness never
depends on where they are. Speed can. On the CPU, attention gathers the cached keys and values token by token
(``index_select`` over slots), so the blocks a batch reads are as scattered in memory as the free list was when
they were handed out. A FIFO free list (the longest-free block first) hands history on: the order sequences
finished in, speculative rollbacks, a start-up calibration that frees its scratch blocks last-first. minifer's
``KVCacheManager`` hands out the lowest-numbered free block instead, which keeps the blocks in use packed at the
start of the pool whatever happened before.

The measurement: plain engines on the same weights decode the same greedy batch, their steps interleaved
(``run_interleaved``): ``lowest_first`` (minifer's allocator, its free blocks in whatever order the warm-up
left them), ``fifo_ordered`` (a FIFO allocator on a fresh, ordered pool) and ``fifo_scattered`` (a FIFO
allocator whose free list was shuffled, as a long-running server's can end up). Each round's ratio is
``lowest_first`` time over the other engine's; the median over rounds with its ``median_ci``.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import deque
from pathlib import Path
from typing import Any

import torch

from minifer.bench.provenance import save_result
from minifer.bench.speculative import _engine, median_ci, run_interleaved, story_openings
from minifer.core.block_pool import BlockPool
from minifer.core.kv_cache_manager import KVCacheManager
from minifer.sampling_params import SamplingParams


class FifoBlockPool(BlockPool):
    """The textbook free list: freed blocks join the back of a queue, new ones come from its front."""

    def __init__(self, num_blocks: int, shuffle_seed: int | None = None) -> None:
        super().__init__(num_blocks)
        order = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(order)
        self._free = deque(order)  # type: ignore[assignment]

    def _push_free(self, bid: int) -> None:
        self._free.append(bid)  # type: ignore[attr-defined]

    def _pop_free(self) -> int:
        return self._free.popleft()  # type: ignore[attr-defined]


def fifo_manager(num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False,
                 shuffle_seed: int | None = None) -> KVCacheManager:
    """A KV cache manager whose pool hands blocks out first-in, first-out."""
    manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    manager.block_pool = FifoBlockPool(num_blocks, shuffle_seed)
    return manager


def _use_allocator(llm, manager: KVCacheManager) -> None:
    """Swap an idle engine's allocator (the scheduler and the runner share it)."""
    engine = llm.engine
    engine.kv_cache_manager = engine.scheduler.blocks = engine.runner.blocks = manager


def run(model: str = "tinystories-target", batch: int = 64, max_tokens: int = 64, rounds: int = 10,
        device: str | None = None, seed: int = 0) -> dict[str, Any]:
    from minifer.bench.serving import metadata

    first = _engine(model, None, batch, device)
    engines = {"lowest_first": first, "fifo_ordered": _engine(model, None, batch, device, first),
               "fifo_scattered": _engine(model, None, batch, device, first)}
    bm = first.engine.kv_cache_manager
    _use_allocator(engines["fifo_ordered"], fifo_manager(bm.num_blocks, bm.block_size))
    _use_allocator(engines["fifo_scattered"], fifo_manager(bm.num_blocks, bm.block_size, shuffle_seed=seed))
    prompts = story_openings(batch)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    times: dict[str, list[float]] = {m: [] for m in engines}
    identical = True
    for r in range(rounds):
        spent, tokens = run_interleaved(engines, prompts, params, seed=r)
        identical &= tokens["lowest_first"] == tokens["fifo_ordered"] == tokens["fifo_scattered"]
        for m in engines:
            times[m].append(spent[m])
    rows = {}
    for m in ("fifo_ordered", "fifo_scattered"):
        ratios = [a / b for a, b in zip(times["lowest_first"], times[m])]
        rows[m] = {"speed_vs_lowest_first": statistics.median(ratios), "ci": median_ci(ratios),
                   "round_ratios": ratios, "seconds": statistics.median(times[m])}
    return {"kind": "block_order", "metadata": metadata(module="minifer_course.block_order"),
            "config": {"model": model, "batch": batch, "max_tokens": max_tokens, "rounds": rounds,
                       "device": str(first.device), "torch_threads": torch.get_num_threads(),
                       "num_blocks": bm.num_blocks, "block_size": bm.block_size},
            "seconds_lowest_first": statistics.median(times["lowest_first"]), "identical_tokens": identical,
            "rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tinystories-target")
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the pipeline in seconds")
    ap.add_argument("--out", type=Path, default=Path("runs/block_order.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        result = run(args.model, batch=4, max_tokens=8, rounds=2, device=args.device)
    else:
        result = run(args.model, batch=args.batch, rounds=args.rounds, device=args.device)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_result(result, args.out)
    for m, r in result["rows"].items():
        lo, hi, cov = r["ci"]
        print(f"{m:15s} speed vs lowest-first {r['speed_vs_lowest_first']:.3f}x [{lo:.3f}, {hi:.3f}] "
              f"({cov:.1%} interval, {result['config']['rounds']} rounds)")
    print("identical tokens:", result["identical_tokens"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
