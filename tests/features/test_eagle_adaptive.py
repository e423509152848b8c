"""Adaptive k prices the EAGLE head's drafting as it prices a draft model's (issue 29): the head's forwards are timed
at start-up in decode-shaped calls, and a proposal of ``k`` tokens costs one catch-up forward and ``k - 1``
self-fed ones. Deterministic: the costs are injected into the tables and the acceptance is fixed, so the verdict is
the decision rule's, never the clock's."""

from __future__ import annotations

import pytest
from test_eagle import EAGLE

from minifer import LLM
from minifer.spec_decode.eagle import EagleProposer

TARGET_S = 0.010  # an injected target forward: flat up to 8 tokens, then linear (a memory-bound decode)


@pytest.fixture(scope="module")
def llm():
    return LLM("tinystories-target", speculative_config={**EAGLE, "adaptive": True})  # adaptive k: opt-in


def _inject(ctl, head_cost: float, alpha: float = 0.7) -> None:
    """The target's table as above, the head's at ``head_cost`` of a target forward, acceptance ``alpha``."""
    ctl.target_cost.samples.clear()
    ctl.draft_cost.samples.clear()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        scale = 1.0 if n <= 8 else n / 8
        ctl.target_cost.observe(n, TARGET_S * scale)
        ctl.draft_cost.observe(n, head_cost * TARGET_S * scale)
    ctl._recent_alpha = (alpha * 1e6, 1e6)
    ctl.plain_hold.clear()


def test_the_heads_forwards_are_calibrated_at_start_up(llm):
    proposer = llm.engine.speculator.proposer
    ctl = llm.engine.speculator.adaptive
    assert isinstance(proposer, EagleProposer)
    assert ctl.draft_runner is proposer.runner and ctl.draft_cost is proposer.cost
    assert {1, 2, 4}.issubset(proposer.cost.samples) and proposer.cost(1) > 0
    assert proposer.num_forwards == 0  # timing forwards are not drafting: the benchmark's cost per forward stays true
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks  # the scratch sequences were freed


@pytest.mark.parametrize("head_cost,speculates", [(0.0, True), (0.1, True), (1.0, False)])
def test_the_heads_cost_decides_at_batch_1(llm, head_cost, speculates):
    """A cheap head speculates at batch 1 where the verify forward is free; one that costs a target forward per
    draft cannot pay at alpha 0.7 (1.7 tokens for two forwards' time at k = 1), so the same table says plain."""
    ctl = llm.engine.speculator.adaptive
    _inject(ctl, head_cost)
    ctl.plain_step_s[1] = ctl.target_cost(1)  # batch 1's plain reference, which a trial waits for (measured_allows)
    k, probe = ctl.choose_k(1)
    assert (k > 0 and not probe) == speculates


def test_a_loaded_batch_decodes_plainly_however_cheap_the_head(llm):
    ctl = llm.engine.speculator.adaptive
    _inject(ctl, 0.05)
    ctl.plain_choices = ctl.last_probe = 0
    choices = [ctl.choose_k(64) for _ in range(32)]
    assert choices.count((0, False)) == 32  # clearly short of the margin: held plain, no probe


def test_the_price_counts_the_catch_up_and_every_self_fed_forward(llm):
    """Predicted time of a k-draft step = target(b (1 + k)) + head(b) + (k - 1) head(b) at lag 1."""
    ctl = llm.engine.speculator.adaptive
    _inject(ctl, 0.3, alpha=0.5)
    for k in (1, 2, 4):
        b = 2
        want_s = TARGET_S * (1.0 if b * (1 + k) <= 8 else b * (1 + k) / 8) + k * 0.3 * TARGET_S
        tokens = b * (1 + (1 - 0.5 ** (k + 1)) / 0.5 - 1)
        assert ctl.predicted_rate(b, k, 0.5) == pytest.approx(tokens / want_s)
