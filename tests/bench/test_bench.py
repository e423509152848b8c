"""The serving benchmark harness (minifer.bench.serving, minifer.bench.workloads): the pure parts exactly,
and tiny end-to-end runs for their bookkeeping only. Nothing here asserts anything about speed."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from minifer.bench import serving
from minifer.bench.serving import (RequestTiming, continuous_steps, describe, percentile, serving_metrics,
                                   static_steps, step_bound)
from minifer.bench.workloads import LengthSpec, make_workload, poisson_arrivals, sharegpt_specs

# --- workloads ---------------------------------------------------------------------------------------


def test_workload_is_seeded():
    a = make_workload(50, "uniform:8:32", "exp:64:4:256", seed=3)
    b = make_workload(50, "uniform:8:32", "exp:64:4:256", seed=3)
    c = make_workload(50, "uniform:8:32", "exp:64:4:256", seed=4)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert a.output_lens == b.output_lens
    assert a.output_lens != c.output_lens


@pytest.mark.parametrize("spec,lo,hi", [("fixed:17", 17, 17), ("uniform:8:32", 8, 32), ("exp:64:4:256", 4, 256),
                                        ("lognormal:100:1.5:4:300", 4, 300)])
def test_lengths_respect_bounds(spec, lo, hi):
    s = LengthSpec.parse(spec)
    rng = random.Random(0)
    xs = [s.sample(rng) for _ in range(3000)]
    assert min(xs) >= lo and max(xs) <= hi
    if lo < hi:  # the clipping is reached for heavy tails and the range is used
        assert len(set(xs)) > 5
    if spec.startswith("exp"):
        assert xs.count(4) > 100 and xs.count(256) > 0  # exp(64) clipped at both ends: mass piles on both
        assert 55 < sum(xs) / len(xs) < 70


def test_length_spec_errors():
    with pytest.raises(ValueError, match="unknown"):
        LengthSpec.parse("poisson:3")
    with pytest.raises(ValueError, match="takes 2"):
        LengthSpec.parse("uniform:3")
    with pytest.raises(ValueError, match="low <= high"):
        LengthSpec.parse("uniform:30:8")
    assert str(LengthSpec.parse("exponential:64:4:256")) == "exp:64:4:256"


def test_prompts_and_context_clipping():
    w = make_workload(300, "uniform:900:1000", "exp:200:4:1000", seed=1, vocab_size=2048, max_model_len=1024)
    for r in w.requests:
        assert r.prompt_token_ids[0] == 0  # BOS
        assert all(1 <= t < 2048 for t in r.prompt_token_ids[1:])  # never the BOS/EOS id after BOS
        assert 900 <= r.prompt_len <= 1000
        assert 1 <= r.max_tokens and r.prompt_len + r.max_tokens <= 1024
    assert w.summary()["realised"]["total_output_tokens"] == sum(w.output_lens)


def test_sharegpt_like():
    w = make_workload(2000, "sharegpt", "sharegpt", seed=0, max_model_len=1024)
    ins, outs = np.array(w.input_lens), np.array(w.output_lens)
    assert ins.min() >= 4 and ins.max() <= 512 and outs.min() >= 4
    assert (ins + outs).max() <= 1024
    assert 130 < ins.mean() < 170  # mean 161 before clipping at 512
    assert np.median(ins) < 0.75 * ins.mean()  # long right tail: median well below the mean
    assert np.median(outs) < 0.8 * outs.mean()
    assert w.params["input"] == str(sharegpt_specs(1024)[0])


def test_poisson_arrivals():
    t = poisson_arrivals(4000, rate=8.0, seed=5)
    assert t == poisson_arrivals(4000, rate=8.0, seed=5)
    assert all(b > a for a, b in zip(t, t[1:]))
    assert 4000 / t[-1] == pytest.approx(8.0, rel=0.05)
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)
    w = make_workload(10, rate=2.0)
    assert [r.arrival for r in w.requests] == poisson_arrivals(10, 2.0, 0)


# --- the scheduler-step bound ------------------------------------------------------------------------


def test_step_bound_hand_cases():
    # [1,1,1,10], 2 slots. Static: batches [1,1] and [1,10] -> 1 + 10 = 11 passes.
    # Continuous: step 1 runs r0, r1 (both end); step 2 runs r2 (ends) and r3; r3 ends at step 11.
    assert static_steps([1, 1, 1, 10], 2) == 11
    assert continuous_steps([1, 1, 1, 10], 2) == 11
    # [10,1,1,1]: static 10 + 1 = 11; continuous: the second slot serves r1, r2, r3 in steps 1-3 -> 10.
    assert static_steps([10, 1, 1, 1], 2) == 11
    assert continuous_steps([10, 1, 1, 1], 2) == 10
    # [1,10,1,10]: static 20; continuous: r0 step 1, r2 step 2, r3 steps 3-12 beside r1 (1-10) -> 12.
    b = step_bound([1, 10, 1, 10], 2)
    assert (b["static_steps"], b["continuous_steps"]) == (20, 12)
    assert b["ratio"] == pytest.approx(20 / 12)
    # equal lengths: no gain; one slot: no gain; fewer requests than slots: the longest one
    assert step_bound([7] * 9, 4)["ratio"] == 1
    assert step_bound([3, 9, 4], 1)["ratio"] == 1
    assert static_steps([3, 9, 4], 8) == continuous_steps([3, 9, 4], 8) == 9


def _simulate(lens, slots):
    """The definition, step by step: busy slots each make one token; freed slots refill next step."""
    queue, busy, steps = list(lens), [], 0
    while queue or busy:
        while len(busy) < slots and queue:
            busy.append(queue.pop(0))
        steps += 1
        busy = [n - 1 for n in busy if n > 1]
    return steps


def test_continuous_steps_matches_simulation():
    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.randint(1, 30) for _ in range(rng.randint(1, 40))]
        slots = rng.randint(1, 8)
        assert continuous_steps(lens, slots) == _simulate(lens, slots)
        assert static_steps(lens, slots) >= continuous_steps(lens, slots)


def test_bound_grows_with_requests_and_spread():
    rows = serving.bound_curve([32, 512], "exp:64:4:256", 16, seeds=range(3))
    assert rows[1]["ratio_mean"] > rows[0]["ratio_mean"] > 1
    narrow = serving.bound_curve([512], "uniform:60:68", 16, seeds=range(3))[0]["ratio_mean"]
    assert 1 <= narrow < rows[1]["ratio_mean"]


# --- latency statistics ------------------------------------------------------------------------------


def test_percentile_matches_numpy():
    rng = random.Random(1)
    for n in (1, 2, 5, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 10, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))
    d = describe([1.0, 2.0, 3.0, 4.0])
    assert (d["mean"], d["p50"], d["max"], d["count"]) == (2.5, 2.5, 4.0, 4)
    assert d["p90"] == pytest.approx(3.7)


def test_serving_metrics_on_synthetic_timestamps():
    # request a: arrives 0, tokens at 1, 2, 4 -> TTFT 1, E2E 4, TPOT (4-1)/2 = 1.5, ITLs 1 and 2
    # request b: arrives 2, scheduled 3, one token at 5 -> TTFT 3, E2E 3, no TPOT, no ITL
    a = RequestTiming("a", 10, 3, 0.0, 0.5, 1.0, 4.0, [1.0, 2.0, 4.0])
    b = RequestTiming("b", 6, 1, 2.0, 3.0, 5.0, 5.0, [5.0])
    m = serving_metrics([a, b])
    assert m["duration_s"] == 5.0
    assert m["request_throughput"] == pytest.approx(2 / 5)
    assert m["output_throughput"] == pytest.approx(4 / 5)
    assert m["total_token_throughput"] == pytest.approx(20 / 5)
    assert m["ttft_ms"]["mean"] == pytest.approx(2000) and m["ttft_ms"]["p50"] == pytest.approx(2000)
    assert m["ttft_ms"]["max"] == pytest.approx(3000)
    assert m["e2e_ms"]["mean"] == pytest.approx(3500)
    assert m["tpot_ms"]["count"] == 1 and m["tpot_ms"]["mean"] == pytest.approx(1500)
    assert m["itl_ms"]["count"] == 2 and m["itl_ms"]["mean"] == pytest.approx(1500)
    assert m["queue_ms"]["p50"] == pytest.approx(750)


# --- tiny end-to-end runs (bookkeeping only) ---------------------------------------------------------

RUN_KEYS = {"round", "mode", "num_requests", "duration_s", "total_output_tokens", "request_throughput",
            "output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "steps", "ms_per_step"}


def test_tiny_throughput_run(target_llm, tmp_path):
    w = make_workload(8, "uniform:4:12", "uniform:2:9", seed=0, max_model_len=target_llm.max_model_len)
    res = serving.throughput_benchmark(target_llm, w, modes=("static", "continuous", "hf"), repeats=1,
                                       max_num_seqs=3, hf_batch_size=3, warmup=False, progress=False,
                                       log=lambda s: None)
    path = serving.save_result({"metadata": serving.metadata(["throughput", "-n", "8"]), **res}, tmp_path / "t.json")
    data = json.loads(path.read_text())
    assert data["kind"] == "throughput"
    meta = data["metadata"]
    for key in ("cpu", "cpu_count", "torch", "transformers", "git", "command", "timestamp"):
        assert key in meta
    assert meta["command"] == "python -m minifer.bench throughput -n 8"
    assert data["workload"]["realised"]["num_requests"] == 8 and data["workload"]["output"] == "uniform:2:9"
    assert {r["mode"] for r in data["runs"]} == {"static", "continuous", "hf"}
    bound = data["step_bound"]
    for run in data["runs"]:
        assert RUN_KEYS <= set(run)
        assert run["num_requests"] == 8 and run["total_output_tokens"] == sum(w.output_lens)  # all finished
        assert run["output_throughput"] > 0 and run["ttft_ms"]["count"] == 8
    by = {r["mode"]: r for r in data["runs"]}
    # Prompts fit one step's token budget, so both engines take exactly the bound's number of passes.
    assert by["static"]["steps"] == by["hf"]["steps"] == bound["static_steps"]
    assert by["continuous"]["steps"] == bound["continuous_steps"]
    assert by["continuous"]["num_preemptions"] == 0 and by["continuous"]["prefix_cache_hit_rate"] == 0
    ratios = data["summary"]["ratios"]
    assert {"continuous/static", "continuous/hf", "static/hf"} <= set(ratios)
    assert ratios["continuous/static"]["bound"] == pytest.approx(bound["ratio"])
    assert serving.plot_file(path).is_file()


def test_tiny_serve_run_respects_arrivals(target_llm):
    w = make_workload(6, "uniform:4:8", "uniform:2:5", seed=2, rate=40.0, max_model_len=target_llm.max_model_len)
    for run in (serving.run_static, serving.run_continuous):
        res = run(target_llm, w, max_num_seqs=2, progress=False)
        assert len(res.timings) == 6
        arrival = {r.request_id: r.arrival for r in w.requests}
        for t in res.timings:
            assert t.arrival == arrival[t.request_id]
            assert t.arrival <= t.first_scheduled <= t.first_token <= t.finished
            assert len(t.token_times) == t.num_output_tokens
            assert t.token_times == sorted(t.token_times)
        m = res.metrics()
        assert m["num_requests"] == 6 and m["duration_s"] >= w.requests[-1].arrival


def test_cli_bound_and_plot(tmp_path):
    from minifer.bench.__main__ import main

    out = tmp_path / "bound.json"
    assert main(["bound", "-n", "16", "64", "--output", "fixed:8", "exp:16:1:64", "--seeds", "2",
                 "--out", str(out), "--plot"]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "bound" and set(data["curves"]) == {"fixed:8", "exp:16:1:64"}
    assert all(r["ratio_mean"] == 1 for r in data["curves"]["fixed:8"])
    assert "bound -n 16 64" in data["metadata"]["command"]
    assert out.with_suffix(".png").is_file()


def test_block_order_smoke(tmp_path):
    """The allocator-order benchmark runs end to end, its FIFO engines decode the same tokens, and its rows hold a
    median inside its interval (speed itself is never asserted: ratios on a shared machine are measured, not tested)."""
    from minifer_course import block_order

    out = tmp_path / "block_order.json"
    block_order.main(["--smoke", "--out", str(out)])
    d = json.loads(out.read_text())
    assert d["identical_tokens"] and set(d["rows"]) == {"fifo_ordered", "fifo_scattered"}
    for row in d["rows"].values():
        lo, hi, cov = row["ci"]
        assert lo <= row["speed_vs_lowest_first"] <= hi and 0 < cov <= 1 and len(row["round_ratios"]) == 2
