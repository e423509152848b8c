"""Chapter 03's notebook helpers (minifer_course): the slot timeline against the step counts of
minifer.bench.serving, and the bookkeeping of the chunked-prefill and max_num_seqs measurements (never
their speed)."""

from __future__ import annotations

import random

import matplotlib
import pytest

from minifer.bench.serving import continuous_steps, static_steps
from minifer_course.ch03_batching import (chunked_prefill_stall, max_num_seqs_sweep, plot_max_num_seqs,
    plot_slot_timeline, slot_timeline)

matplotlib.use("Agg")


@pytest.mark.parametrize("seed", range(30))
def test_slot_timeline_matches_step_counts(seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
    slots = rng.randint(1, 6)
    for mode, count in (("static", static_steps), ("continuous", continuous_steps)):
        spans = slot_timeline(lens, slots, mode)
        assert sorted(i for i, *_ in spans) == list(range(len(lens)))  # every request exactly once
        assert all(e - a == lens[i] and 0 <= s < slots for i, s, a, e in spans)  # n steps on one slot
        assert max(e for *_, e in spans) == count(lens, slots)
        for slot in range(slots):  # a slot holds one request at a time
            held = sorted((a, e) for _, s, a, e in spans if s == slot)
            assert all(e1 <= a2 for (_, e1), (a2, _) in zip(held, held[1:]))


def test_slot_timeline_by_hand():
    assert slot_timeline([3, 1, 2], 2, "static") == [(0, 0, 0, 3), (1, 1, 0, 1), (2, 0, 3, 5)]
    assert slot_timeline([3, 1, 2], 2, "continuous") == [(0, 0, 0, 3), (1, 1, 0, 1), (2, 1, 1, 3)]
    with pytest.raises(ValueError, match="mode"):
        slot_timeline([1], 1, "dynamic")
    with pytest.raises(ValueError, match="slots"):
        slot_timeline([1], 0, "static")


def test_plots_draw():
    import matplotlib.pyplot as plt

    fig = plot_slot_timeline([5, 1, 3, 2, 4], 2)
    assert "static: 12 steps" in fig.axes[0].get_title() and "continuous: 9 steps" in fig.axes[1].get_title()
    plt.close(fig)
    rows = [{"max_num_seqs": n, "output_throughput": 10.0 * n, "ms_per_step": 1.0 + n, "tokens_per_step": n}
            for n in (1, 2, 4)]
    plt.close(plot_max_num_seqs(rows))


def test_chunked_prefill_stall_bookkeeping(draft_llm):
    rows = chunked_prefill_stall(draft_llm, {"whole": (False, 2048), "chunks": (True, 16)}, long_prompt_len=64,
                                 num_decoders=2, decode_tokens=6, arrive_after=2, rounds=1)
    by = {r["setting"]: r for r in rows}
    assert by["whole"]["prefill_steps"] == 1
    assert by["chunks"]["prefill_steps"] == -(-64 // (16 - 2))  # the decoders take their token first
    assert by["whole"]["decoder_tokens"] == by["chunks"]["decoder_tokens"]
    assert all(len(t) == 6 for t in by["whole"]["decoder_tokens"])
    assert all(r["max_itl_ms"] >= r["p50_itl_ms"] > 0 and r["long_ttft_ms"] > 0 for r in rows)


def test_max_num_seqs_sweep_bookkeeping(draft_llm):
    rows = max_num_seqs_sweep(draft_llm, (1, 3), waves=2, output_len=3, rounds=2)
    assert [r["max_num_seqs"] for r in rows] == [1, 3]
    assert [r["steps"] for r in rows] == [6, 6]  # two waves of full batches, 3 steps each
    assert [r["tokens_per_step"] for r in rows] == [1, 3]
    assert all(r["output_throughput"] > 0 for r in rows)
