"""Speculative decoding in the engine: lossless (greedy: the same tokens; sampled: the same distribution,
by a chi-squared test against the target's exact conditional distribution), with preemption, prefix
caching and rollbacks, with clear errors for configurations that cannot work."""

from __future__ import annotations

import random

import pytest

from minifer import LLM, SamplingParams
from minifer.engine.components import Components
from minifer.engine.speculative import SpeculativeConfig
from minifer.engine.adaptive_k import CostTable
from spec_helpers import GREEDY, PROMPT, _second_token_test, mixed_prompts, story_prompts, tokens

DRAFT = {"method": "draft_model", "model": "tinystories-draft", "num_speculative_tokens": 4}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def plain():
    return LLM("tinystories-target", max_num_seqs=32)


@pytest.mark.parametrize("config", [{**DRAFT, "adaptive": True}, {**NGRAM, "adaptive": True}, DRAFT, NGRAM],
                         ids=["draft-adaptive", "ngram-adaptive", "draft-k4", "ngram-k4"])
def test_greedy_tokens_identical_in_a_mixed_batch(plain, heldout_stories, config):
    prompts = story_prompts(heldout_stories, 20) + mixed_prompts(12, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=8 + (i * 7) % 29, ignore_eos=True) for i in range(len(prompts))]
    want = tokens(plain.generate(prompts, params, use_tqdm=False))
    llm = LLM("tinystories-target", max_num_seqs=32, speculative_config=config)
    got = tokens(llm.generate(prompts, params, use_tqdm=False))
    assert got == want
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.engine.kv_cache_manager.check_invariants()
    if not config.get("adaptive"):  # fixed k, the default: every decode step speculated
        assert stats["spec_num_proposed"] > 0
        assert 1 <= stats["spec_mean_tokens_per_forward"] <= config["num_speculative_tokens"] + 1
    if config["method"] == "draft_model" and not config.get("adaptive"):
        assert stats["spec_acceptance_rate"] > 0.3  # the bundled pair agrees often on stories


@pytest.mark.parametrize("config", [DRAFT, NGRAM], ids=["draft", "ngram"])
def test_greedy_identical_under_preemption_and_prefix_caching(plain, config):
    system = [0] + list(range(100, 140))  # a shared prefix: cached blocks, which a rollback must not touch
    prompts = [{"prompt_token_ids": system + [300 + i] * (1 + i % 3)} for i in range(10)]
    want = tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    tight = LLM("tinystories-target", max_num_seqs=10, block_size=4, num_kv_blocks=40, max_num_batched_tokens=64,
                speculative_config=config)
    got = tokens(tight.generate(prompts, GREEDY, use_tqdm=False))
    assert got == want
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_rate"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    tight.engine.kv_cache_manager.check_invariants()


def test_stats_report_speculation(heldout_stories):
    llm = LLM("tinystories-target", speculative_config=DRAFT)
    llm.generate(story_prompts(heldout_stories, 4), GREEDY, use_tqdm=False)
    s = llm.stats()
    for key in ("spec_acceptance_rate", "spec_alpha", "spec_mean_tokens_per_forward", "spec_num_proposed",
                "spec_num_accepted", "spec_k"):
        assert key in s
    assert s["spec_num_accepted"] <= s["spec_num_proposed"]
    assert s["spec_k"] == 4
    assert LLM("tinystories-target").stats().get("spec_k") is None


# --- sampling: the distribution is the target's ---------------------------------------------------------




@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)],
                         ids=["t1", "t0.8-top_p0.9"])
def test_sampled_distribution_equals_the_targets(target_llm, params):
    assert target_llm.tokenizer.decode(PROMPT[1:]) == "The dog"
    llm = LLM("tinystories-target", max_num_seqs=64, speculative_config={**DRAFT, "num_speculative_tokens": 3})
    p = _second_token_test(llm, target_llm, PROMPT, params, n=1200)
    assert p > 0.01, f"speculative sampling changed the distribution (chi-squared p = {p:.2g})"
    assert llm.stats()["spec_num_accepted"] > 0


def test_the_chi_squared_test_catches_a_lossy_sampler(target_llm):
    """A sampler that accepts every draft token (so emits the *draft's* distribution) must fail the same
    test: otherwise the test above could not fail."""
    from minifer.sample.rejection_sampler import RejectionVerifier

    class AcceptsEverything(RejectionVerifier):  # handed in through the engine's verifier seam
        @staticmethod
        def sample(drafts, q, p, gens):
            return [list(d) + [0] for d in drafts]

    llm = LLM("tinystories-target", max_num_seqs=64, speculative_config={**DRAFT, "num_speculative_tokens": 3},
              components=Components(verifier=AcceptsEverything()))
    p = _second_token_test(llm, target_llm, PROMPT, SamplingParams(temperature=1.0), n=1200)
    assert p < 0.01


@pytest.mark.parametrize("config", [DRAFT, NGRAM], ids=["draft", "ngram"])
def test_seeded_sampling_reproduces_by_default(heldout_stories, config):
    """The default speculative config speculates a fixed k, so a seeded sampled request draws the same tokens in
    every run whatever else shares its batch (adaptive k, opt-in, would let timings choose each step's k)."""
    prompts = story_prompts(heldout_stories, 6)
    params = [SamplingParams(temperature=1.0, max_tokens=20, seed=i, ignore_eos=True) for i in range(6)]
    alone = LLM("tinystories-target", speculative_config=config, max_num_seqs=1)
    assert SpeculativeConfig.from_dict(config).adaptive is False and not hasattr(alone.engine.speculator, "adaptive")
    a = tokens(alone.generate(prompts, params, use_tqdm=False))
    b = tokens(LLM("tinystories-target", speculative_config=config).generate(prompts[::-1], params[::-1],
                                                                             use_tqdm=False))
    assert a == b[::-1]  # whatever else shares the batch, in whatever order
    assert alone.stats()["spec_num_proposed"] > 0  # it did speculate


def test_logprobs_with_speculation_match_plain(plain, heldout_stories):
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
    prompts = story_prompts(heldout_stories, 3)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = LLM("tinystories-target", speculative_config=DRAFT).generate(prompts, params,
                                                                                            use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            for t in lw:
                assert lg[t].rank == lw[t].rank
                assert abs(lg[t].logprob - lw[t].logprob) < 1e-4


# --- adaptive k -----------------------------------------------------------------------------------------


def test_cost_table_is_robust_to_spikes_and_monotone():
    table = CostTable()
    for n, t in [(1, 1.0), (1, 1.1), (1, 50.0), (2, 1.2), (4, 1.5), (8, 0.9), (16, 4.0)]:
        table.observe(n, t)
    xs, ys = table.curve()
    assert ys == sorted(ys)  # never cheaper with more tokens
    assert table(1) <= 1.1  # the 50.0 spike is outvoted
    assert table(32) == pytest.approx(8.0)  # linear past the table


def test_adaptive_turns_speculation_off_when_verification_is_not_cheap():
    llm = LLM("tinystories-target", speculative_config={**DRAFT, "adaptive": True})
    spec = llm.engine.speculator.adaptive
    spec.target_cost.samples.clear()
    spec.draft_cost.samples.clear()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        spec.target_cost.observe(n, 0.010 if n <= 8 else 0.010 * n / 8)  # flat up to 8 tokens, then linear
        spec.draft_cost.observe(n, 0.001 if n <= 8 else 0.001 * n / 8)
    spec.plain_step_s[1] = 0.010  # batch 1's plain reference, which a trial waits for (measured_allows)
    assert spec.choose_k(1) == (spec.choose_k(1)[0], False) and spec.choose_k(1)[0] >= 3  # batch 1: speculate deeply
    spec.plain_choices = 0
    choices = [spec.choose_k(64) for _ in range(64)]  # loaded: plain decoding, with a rare one-sequence probe
    assert choices.count((0, False)) >= 62 and all(probe for k, probe in choices if k)


# --- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config,match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown speculative method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs speculative_config\\['model'\\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_temperature": 1}, "unknown keys"),
])
def test_bad_speculative_config(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(config)


def test_draft_with_another_vocabulary_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="vocabulary"):
        LLM("tinystories-target", speculative_config={**DRAFT, "model": str(tiny_checkpoint("llama")[1])})


def test_speculation_needs_the_continuous_engine():
    with pytest.raises(ValueError, match="continuous"):
        LLM("tinystories-target", batching="static", speculative_config=NGRAM)


def test_engines_can_share_weights(plain, heldout_stories):
    """Engines compared in one process run one copy of the weights (and of the draft) and give the same tokens."""
    prompts = story_prompts(heldout_stories, 6)
    fixed = LLM("tinystories-target", max_num_seqs=8, share_weights_with=plain,
                speculative_config=DRAFT)
    adaptive = LLM("tinystories-target", max_num_seqs=8, share_weights_with=fixed,
                   speculative_config={**DRAFT, "adaptive": True})
    assert fixed.model is plain.model and adaptive.model is plain.model
    assert adaptive.draft_model is fixed.draft_model
    want = tokens(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert tokens(fixed.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert tokens(adaptive.generate(prompts, GREEDY, use_tqdm=False)) == want


def test_sharing_weights_loaded_differently_is_refused(plain):
    with pytest.raises(ValueError, match="dtype"):
        LLM("tinystories-target", dtype="bfloat16", share_weights_with=plain)
    with pytest.raises(ValueError, match="quantization"):
        LLM("tinystories-target", quantization="int8", share_weights_with=plain)
    with pytest.raises(ValueError, match="model"):
        LLM("tinystories-draft", share_weights_with=plain)
    with pytest.raises(TypeError, match="share_weights_with must be an LLM"):
        LLM("tinystories-target", share_weights_with=plain.model)


def test_speculative_benchmark_smoke(tmp_path):
    """The chapter's benchmark end to end at tiny sizes: JSON written, greedy tokens identical in every mode."""
    from minifer.bench import speculative as bench

    out = tmp_path / "spec.json"
    bench.main(["--smoke", "--repeats", "1", "--out", str(out)])
    result = __import__("json").loads(out.read_text())
    assert {"tokens_per_forward", "speedup", "verify_cost", "metadata"} <= set(result)
    for sp in result["speedup"].values():
        assert all(r["identical_tokens"] for r in sp["rows"])
    for rows in result["tokens_per_forward"].values():
        assert all(1 <= r["tokens_per_forward"] <= r["k"] + 1 for r in rows)
    for sp in result["speedup"].values():
        for r in sp["rows"]:
            lo, hi, coverage = r["ci_adaptive"]
            assert lo <= r["speedup_adaptive"] <= hi and 0 <= coverage <= 1  # one round: coverage 0
    assert set(bench.adaptive_verdict(result["speedup"])) >= {"met_within_resolution", "lowest_median"}


def test_bookkeeping_benchmark_times_the_speculators_calls_and_restores_them(tmp_path):
    """``--bookkeeping`` end to end at tiny sizes: per batch size the speculator's calls per step, their share of
    the step (a fraction, below 1), and the steps by k; the timers are taken off the engine afterwards."""
    import json

    from minifer.bench import speculative as bench

    out = tmp_path / "bk.json"
    bench.main(["--bookkeeping", "--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["kind"] == "speculative_bookkeeping" and "metadata" in result
    for rows in result["bookkeeping"].values():
        for r in rows:
            assert set(r["us_per_step"]) == set(bench.SPECULATOR_CALLS)
            assert r["bookkeeping_us"] == pytest.approx(sum(r["us_per_step"].values()))
            assert 0 < r["share"] < 1 and r["steps"] > 0 and r["step_ms"] > 0
    real = bench._engine  # the engine measured must come back without its timers
    built = []
    try:
        bench._engine = lambda *a, **k: built.append(real(*a, **k)) or built[-1]
        bench.bookkeeping("tinystories-target", {"method": "ngram", "num_speculative_tokens": 2}, ["Once upon a time"],
                          [1], 4, rounds=1)
    finally:
        bench._engine = real
    engine = built[0].engine
    assert "step" not in vars(engine)
    assert not any(name in vars(owner) for owner, name in (bench._owner(engine.speculator, n)
                                                           for n in bench.SPECULATOR_CALLS))


def test_median_ci_order_statistics():
    """The interval is the (j, n + 1 - j)-th order statistics with binomial coverage, and covers as it says."""
    import random

    from scipy.stats import binom

    from minifer.bench.speculative import median_ci

    xs = [0.97, 1.03, 0.99, 1.01, 1.00, 0.98, 1.02, 0.96, 1.04, 0.995, 1.005, 0.985, 1.015, 0.975, 1.025, 1.0]
    lo, hi, cov = median_ci(xs)
    s = sorted(xs)
    assert (lo, hi) == (s[3], s[12])  # 16 values: the 4th and 13th
    assert cov == pytest.approx(1 - 2 * binom.cdf(3, 16, 0.5)) and cov >= 0.95
    assert median_ci(xs[:8])[:2] == (min(xs[:8]), max(xs[:8]))  # 8 values: only the range reaches 95%
    assert median_ci([1.0, 2.0, 3.0, 4.0])[2] == pytest.approx(0.875)  # too few: the range, and its coverage
    with pytest.raises(ValueError, match="at least one"):
        median_ci([])
    rng, misses = random.Random(0), 0  # coverage: a skewed distribution whose median is 1.0
    for _ in range(2000):
        lo, hi, _ = median_ci([1.0 + rng.expovariate(1.0) - 0.6931471805599453 for _ in range(16)])
        misses += not lo <= 1.0 <= hi
    assert misses / 2000 < 0.035  # at most 1 - 0.979 = 2.1% expected


def test_adaptive_verdict_reads_the_intervals():
    from minifer.bench.speculative import adaptive_verdict

    def row(batch, med, lo, hi):
        return {"batch": batch, "speedup_adaptive": med, "ci_adaptive": [lo, hi, 0.98],
                "ci_plain_again": [0.99, 1.01, 0.98]}

    ok = {"draft_model": {"rows": [row(1, 1.6, 1.5, 1.7), row(64, 0.995, 0.985, 1.004)]}}
    v = adaptive_verdict(ok)
    assert v["met_within_resolution"] and v["cells_below_1"] == 1 and v["lowest_at"] == ["draft_model", 64]
    assert v["largest_shortfall_allowed"] == pytest.approx(0.015)
    assert v["aa_intervals_missing_1"] == [] and v["aa_misses_expected"] == pytest.approx(2 * 0.02)
    bad = {"draft_model": {"rows": [row(1, 1.6, 1.5, 1.7), row(16, 0.984, 0.975, 0.999)]}}
    assert adaptive_verdict(bad)["measurably_slower"] == [("draft_model", 16)]


def test_adaptive_control_benchmark_smoke(tmp_path):
    """The adaptive-k control end to end at tiny sizes: four engines per cell, the two plain controls read against
    ``plain`` like the adaptive engine, the same greedy tokens everywhere, and the verdict over every cell."""
    import json

    from minifer_course.experiments import adaptive_control as bench

    out = tmp_path / "ac.json"
    bench.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["kind"] == "adaptive_control" and result["config"]["engines"] == list(bench.ENGINES)
    rows = [r for sw in result["sweeps"].values() for r in sw["rows"]]
    assert len(rows) == 4 and all(r["identical_tokens"] for r in rows)
    for r in rows:
        for m in bench.ENGINES[1:]:
            lo, hi, _ = r[f"ci_{m}"]
            assert lo <= r[f"speedup_{m}"] <= hi and len(r[f"round_speedups_{m}"]) == r["rounds"]
    assert result["verdict"]["cells"] == 4 and "after_intervals_missing_1" in result["verdict"]


def test_adaptive_split_benchmark_smoke(tmp_path):
    """The forward/rest split end to end at tiny sizes: every engine's forward is a part of its step, the same
    greedy tokens everywhere."""
    import json

    from minifer_course.experiments import adaptive_split as bench

    out = tmp_path / "split.json"
    bench.main(["--smoke", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["kind"] == "adaptive_split" and result["config"]["engines"] == list(bench.ENGINES)
    rows = [r for sw in result["sweeps"].values() for r in sw]
    assert len(rows) == 4 and all(r["identical_tokens"] for r in rows)
    for r in rows:
        for m in bench.ENGINES:
            assert all(0 < f < t for f, t in zip(r["forward_s"][m], r["step_s"][m])), "a forward inside its step"


def test_adaptive_split_ratios_and_pooling():
    """Made-up rounds: the adaptive engine's forward matches plain's and it spends 1 ms more outside it per 100 ms
    step: read as forward 1.0 and rest +1%; a speculating cell is left out of the pool."""
    from minifer_course.experiments import adaptive_split as bench

    def row(mean_k, extra):
        n = 8
        return {"adaptive_mean_k": mean_k,
                "step_s": {"plain": [0.100] * n, "plain_again": [0.100] * n, "adaptive": [0.100 + extra] * n},
                "forward_s": {"plain": [0.090] * n, "plain_again": [0.090] * n, "adaptive": [0.090] * n}}

    r = bench.ratios(row(0.0, 0.001), "adaptive")
    assert r["forward"] == pytest.approx([1.0] * 8) and r["rest_extra"] == pytest.approx([0.01] * 8)
    assert r["step"] == pytest.approx([0.1 / 0.101] * 8)
    p = bench.pooled({"ngram_grounded": [row(0.0, 0.001), row(0.0, 0.001), row(2.0, -0.03)]})
    assert p["cells"] == 2 and p["adaptive"]["rest_extra"]["median"] == pytest.approx(0.01)
    assert p["adaptive"]["step"]["slower"] and not p["plain_again"]["step"]["slower"]
    assert bench.pooled({"x": [row(1.0, 0.0)]}) == {"cells": 0}
