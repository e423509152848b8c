"""The decode attention alone, padded reference against length buckets (issue 28): a micro-benchmark.

``cpu_peer`` measures ``compilation_config={"decode_attention": "bucketed"}`` through the whole engine, where
attention is a fifth of a 64-slot step and its gain sits near the machine's noise. This isolates it: decode batches
whose contexts come from a simulated continuous batch of the headline workload (prompts 8-32 tokens, outputs
exp(64) clipped to [4, 256]), over a paged cache of the bundled target's shapes, blocks in shuffled order; one step is
the 12 layers' attention plus, for the buckets, the step's index build. Both run on one thread, interleaved (the
order alternates from round to round), timed in the thread's CPU time (another process on the core does not count),
and compared by the medians' sums over the batches. Glibc's allocator maps large fresh tensors anew (and trims freed
ones), so the reference's per-layer gathers page-fault here far more than in a warm engine; to compare the
attention alone, keep the allocator from it: ``MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=1073741824``.

    python -m minifer.bench.decode_attention [--slots 1 16 64] [--costs 512 1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from minifer.engine.decode_metadata import DecodeMetadataBuilder
from minifer.layers.decode_attention import BucketedDecodeIndexer, bucketed_decode_attention
from minifer.layers.paged_attention import paged_attention_reference

SHAPE = dict(heads=8, kv_heads=2, head_dim=32, block_size=16, layers=12)  # the bundled target's


def continuous_contexts(slots: int, num_requests: int = 512, seed: int = 0) -> list[list[int]]:
    """Every step's contexts when ``slots`` sequences run the headline workload's lengths, refilled as they end."""
    rng = random.Random(seed)
    queue = [(rng.randint(8, 32), min(256, max(4, int(rng.expovariate(1 / 64))))) for _ in range(num_requests)]
    running: list[list[int]] = []
    steps = []
    while queue or running:
        while queue and len(running) < slots:
            running.append(list(queue.pop(0)) + [0])
        for r in running:
            r[2] += 1
        steps.append([p + done for p, _, done in running])
        running = [r for r in running if r[2] < r[1]]
    return steps


def shuffled_block_tables(context_lens: list[int], block_size: int, rng: random.Random,
                          spare: int = 2) -> tuple[list[list[int]], int]:
    """Block tables covering ``context_lens`` from a pool of just enough blocks plus ``spare``, handed out in a
    shuffled order (as a long-running allocator's free list does); returns them and the pool's size."""
    ids = list(range(sum(-(-c // block_size) for c in context_lens) + spare))
    rng.shuffle(ids)
    tables, at = [], 0
    for c in context_lens:
        tables.append(ids[at : at + -(-c // block_size)])
        at += len(tables[-1])
    return tables, len(ids)


def _batch(ctx: list[int], seed: int):
    h, hkv, d, bs = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"], SHAPE["block_size"]
    tables, num_blocks = shuffled_block_tables(ctx, bs, random.Random(seed))
    k, v = torch.randn(2, num_blocks + 1, bs, hkv, d).unbind(0)  # the last block: the all-zero null block
    k[-1].zero_()
    v[-1].zero_()
    meta = DecodeMetadataBuilder(bs, torch.device("cpu")).build(tables, ctx, num_blocks * bs)
    return torch.randn(len(ctx), h, d), k, v, meta


def _cpu_us(fn, n: int) -> float:
    t = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t) / n * 1e6


def run(slots: list[int], costs: list[int], rounds: int = 5, batches: int = 5, log=print) -> dict:
    """Per slot count: microseconds per step of each path (summed over ``batches`` decode batches) and its speed
    over the reference's."""
    torch.set_num_threads(1)
    layers, out = SHAPE["layers"], {}
    for n_slots in slots:
        steps = continuous_contexts(n_slots)
        totals: dict[str, float] = {}
        for j in range(batches):
            ctx = steps[int(len(steps) * (j + 0.5) / batches)]
            q, k, v, meta = _batch(ctx, j)
            want = paged_attention_reference(q, k, v, meta)
            paths = {"padded": lambda: [paged_attention_reference(q, k, v, meta) for _ in range(layers)]}
            for cost in costs:
                indexer = BucketedDecodeIndexer(SHAPE["kv_heads"], SHAPE["head_dim"], torch.float32,
                                                torch.device("cpu"), cost)
                got = bucketed_decode_attention(q, k, v, indexer.build(meta.groups[0].key_slots, ctx))
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

                def step(indexer=indexer):
                    index = indexer.build(meta.groups[0].key_slots, ctx)
                    for _ in range(layers):
                        bucketed_decode_attention(q, k, v, index)

                paths[f"bucketed-{cost}"] = step
            times: dict[str, list[float]] = {name: [] for name in paths}
            reps = max(2, 300 // n_slots)
            for r in range(rounds):
                for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                    times[name].append(_cpu_us(paths[name], reps))
            for name, ts in times.items():
                totals[name] = totals.get(name, 0.0) + statistics.median(ts)
        out[n_slots] = {name: {"us_per_step": t / batches, "speedup": totals["padded"] / t} for name, t in totals.items()}
        log(f"{n_slots} slots: " + ", ".join(f"{name} {r['us_per_step']:.0f} us/step ({r['speedup']:.2f}x)"
                                             for name, r in out[n_slots].items()))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--costs", type=int, nargs="+", default=[512, 1024], help="BUCKET_COST_KEYS values to compare")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    run(args.slots, args.costs, args.rounds)


if __name__ == "__main__":
    main()
