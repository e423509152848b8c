"""Chapter 04's notebook helpers (minifer_course): the rejection-sampling toy and its chi-squared verdicts,
one speculative step spelled out, the adaptive-k table read from a speculator's rule, the speedup grid and
widget, and the bookkeeping of the live engine timing (never its speed)."""

from __future__ import annotations

import matplotlib
import pytest

import minifer
from minifer.engine.adaptive_k import CostTable
from minifer_course.ch04_speculative import (adaptive_k_table, plot_adaptive_k, plot_rejection_toy, plot_verify_cost,
    rejection_toy, speculative_step, speedup_explorer, speedup_grid, time_engines, verify_cost_rounds)
from minifer.spec_decode.theory import expected_speedup, optimal_k

matplotlib.use("Agg")

P = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]
Q = [0.10, 0.05, 0.30, 0.05, 0.10, 0.40]


def _spec_llm(method: str = "draft_model", adaptive: bool = False, k: int = 3):
    """The 0.66M draft as the target too (cheap): it agrees with itself, so every greedy draft is accepted."""
    cfg = {"method": method, "num_speculative_tokens": k, "adaptive": adaptive}
    if method == "draft_model":
        cfg["model"] = "tinystories-draft"
    return minifer.LLM("tinystories-draft", max_num_seqs=4, num_kv_blocks=64, enable_prefix_caching=False,
                       speculative_config=cfg)


def test_rejection_toy_verdicts():
    toy = rejection_toy(P, Q, n=20_000, seed=0)
    assert toy["lossless"] and not toy["naive_lossless"]  # the test tells the right sampler from the wrong one
    assert toy["alpha"] == pytest.approx(sum(min(a, b) for a, b in zip(P, Q)))
    assert toy["acceptance"] == pytest.approx(toy["alpha"], abs=0.02)
    assert sum(toy["emitted"]) == pytest.approx(1.0) and sum(toy["naive_emitted"]) == pytest.approx(1.0)
    for a, r, p in zip(toy["accepted_mass"], toy["residual_mass"], toy["p"]):
        assert a + r == pytest.approx(p)  # min(p, q) + max(p - q, 0) = p
    assert toy == rejection_toy(P, Q, n=20_000, seed=0)  # deterministic for a seed


def test_rejection_toy_edge_cases():
    same = rejection_toy(P, P, n=5_000, seed=1)  # a perfect draft: everything accepted, both samplers exact
    assert same["acceptance"] == 1.0 and same["lossless"] and same["naive_lossless"]
    unnormalised = rejection_toy([4, 2.5, 1.5, 1, 0.6, 0.4], Q, n=2_000, seed=2)
    assert unnormalised["p"] == pytest.approx(P)
    with pytest.raises(ValueError, match="same length"):
        rejection_toy([0.5, 0.5], [1.0], n=10)


def test_speedup_grid_is_the_theory():
    rows = speedup_grid([0.5, 0.9], [1, 2, 4], draft_cost=0.2)
    assert [r["alpha"] for r in rows] == [0.5, 0.9]
    for r in rows:
        for k in (1, 2, 4):
            assert r[f"k{k}"] == expected_speedup(r["alpha"], k, 0.2)
        assert r["best_k"] == optimal_k(r["alpha"], 0.2, 4)


def test_speedup_explorer_redraws(capsys):
    box = speedup_explorer(alpha=0.7, k=2, draft_cost=0.1, k_max=6)
    alpha, k, c, _ = box.children
    assert (alpha.value, k.value, c.value) == (0.7, 2, 0.1)
    assert f"expected speedup {expected_speedup(0.7, 2, 0.1):.2f}x" in capsys.readouterr().out  # drawn at once
    k.value, c.value = 5, 0.9  # each change redraws (outside a kernel the Output widget passes prints through)
    assert f"expected speedup {expected_speedup(0.7, 5, 0.9):.2f}x (best k = 0" in capsys.readouterr().out


def test_speculative_step_with_itself_accepts_everything():
    llm = _spec_llm()
    step = speculative_step(llm, "Once upon a time", k=3)
    assert step["accepted"] == 3 and step["emitted"] == step["target"] and step["draft"] == step["target"][:3]
    with pytest.raises(ValueError, match="draft_model"):
        speculative_step(_spec_llm("ngram"), "Once upon a time")


def test_speculative_step_is_greedy_verification():
    llm = minifer.LLM("tinystories-target", max_num_seqs=2, num_kv_blocks=32,
                      speculative_config={"method": "draft_model", "model": "tinystories-draft",
                                          "num_speculative_tokens": 4, "adaptive": False})
    for prompt in ("Lily and her mom went to the", "The cat looked at the", "Once upon a time"):
        s = speculative_step(llm, prompt, k=4)
        n = s["accepted"]
        assert s["draft"][:n] == s["target"][:n] and s["emitted"] == s["target"][:n + 1]
        assert n == 4 or s["draft"][n] != s["target"][n]


def test_adaptive_k_table_reads_the_rule():
    llm = _spec_llm(adaptive=True, k=4)
    spec = llm.engine.speculator.adaptive
    target, draft = CostTable(), CostTable()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        target.observe(n, 0.01 * max(1.0, n / 8))  # flat up to 8 tokens, then proportional (compute-bound)
        draft.observe(n, 0.001 * max(1.0, n / 8))
    spec.target_cost, spec.draft_cost = target, draft
    spec.plain_choices, spec.probe_every = 31, 32  # the next plain choice would be a k = 1 probe
    rows = adaptive_k_table(spec, [1, 2, 4, 8, 16, 32, 64])
    assert (spec.plain_choices, spec.probe_every) == (31, 32)  # left as it was
    alpha = spec.alpha_estimate()
    for r in rows:
        rates = {k: spec.predicted_rate(r["batch"], k, alpha) for k in range(5)}
        best = max(range(1, 5), key=rates.get)
        assert r["k"] == (best if rates[best] > rates[0] * spec.cfg.margin else 0)  # no probe in the table
        assert r["predicted_speedup"] == pytest.approx(rates[r["k"]] / rates[0])
        assert r["predicted_speedup_kmax"] == pytest.approx(rates[4] / rates[0])
    assert rows[0]["k"] > 0 and rows[-1]["k"] == 0  # speculate alone, not in a compute-bound batch of 64
    import matplotlib.pyplot as plt

    plt.close(plot_adaptive_k(spec, rows))


def test_time_engines_bookkeeping(draft_llm):
    ngram = _spec_llm("ngram")
    rows = time_engines({"plain": draft_llm, "ngram": ngram}, ["Once upon a time", "The dog"], [1, 3],
                        max_tokens=5, repeats=2)
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["speedup_plain"] == 1.0 and r["identical_tokens"] is True
        assert r["s_plain"] > 0 and r["s_ngram"] > 0 and r["speedup_ngram"] > 0


def test_plots_draw():
    import matplotlib.pyplot as plt

    plt.close(plot_rejection_toy(rejection_toy(P, Q, n=500)))
    rows = [{"batch": b, "k0": 0.01, "ratio_k1": 1.1, "ratio_k4": 1.5 * b} for b in (1, 4)]
    fig = plot_verify_cost(rows)
    assert len(fig.axes[0].get_lines()) == 4  # two batches, the proportional line, the free line
    plt.close(fig)


def test_verify_cost_rounds_shape(draft_llm):
    rows = verify_cost_rounds(draft_llm, [1, 2], [1, 3], context=16, repeats=1, rounds=3)
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r) == {"batch", "k0", "k1", "k3", "ratio_k1", "ratio_k3"}
        assert all(r[k] > 0 for k in ("k0", "k1", "k3"))
