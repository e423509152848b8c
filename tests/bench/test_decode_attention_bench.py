"""The decode-attention micro-benchmark runs and checks both paths agree (its timings are never asserted)."""

from minifer.bench.decode_attention import continuous_contexts, run


def test_contexts_follow_a_continuous_batch():
    steps = continuous_contexts(4, num_requests=10)
    assert all(1 <= len(s) <= 4 for s in steps) and max(map(len, steps)) == 4
    assert all(9 <= c <= 32 + 256 for s in steps for c in s)  # a prompt of 8-32 plus at least its first token


def test_micro_benchmark_reports_each_path_against_the_reference():
    out = run([3], [0, 10**6], rounds=1, batches=2, log=lambda _: None)
    assert set(out[3]) == {"padded", "bucketed-0", "bucketed-1000000"}
    assert out[3]["padded"]["speedup"] == 1.0 and all(r["us_per_step"] > 0 for r in out[3].values())
