"""The adaptive-k rule's bookkeeping, on a speculator whose cost tables the test fills in by hand: probes stay
within their time budget, measured steps land where they belong, a losing trial switches speculation off
and a retry switches it back on, and prompt lookups are skipped where they cannot pay."""

from __future__ import annotations

import random
import statistics
from collections import Counter

import pytest

from minifer import LLM, SamplingParams
from minifer.engine.adaptive_k import PROBE_BUDGET, TRIAL_STEPS, CostTable, StepRecord

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": True}


@pytest.fixture()
def spec():
    s = LLM("tinystories-target", speculative_config=NGRAM).engine.speculator.adaptive
    s.target_cost = CostTable()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        s.target_cost.observe(n, 0.010 * max(1.0, n / 64))  # flat up to 64 tokens, then proportional
    s.calibrated = True
    return s


def _step(s, b: int, seconds: float, emitted: int, speculated: bool = False, probe: bool = False,
          expected: float | None = None, forward_tokens: int | None = None) -> None:
    """What the engine reports after a pure-decode step of ``b`` sequences (``expected`` None: count the tokens
    given here, not the acceptance model's expectation)."""
    tokens = forward_tokens if forward_tokens is not None else (emitted if not speculated else 2 * b)
    s.observe(StepRecord(decodes=b, k=2 if speculated else 0, probe=probe, expected=expected,
                         forward_tokens=tokens, forward_s=s.target_cost(tokens), pure_decode=True,
                         emitted=emitted, seconds=seconds))


def test_probes_stay_within_their_time_budget(spec):
    spec.plain_choices = spec.probe_every  # a probe is due by the spacing rule
    assert spec.probe_due()  # nothing spent yet
    _step(spec, 8, 0.010, 8)  # a plain step: 10 ms of decoding, plain time at b = 8 known
    _step(spec, 8, 0.030, 8, probe=True)  # a probe that took 20 ms more than a plain step
    assert spec.probe_extra_s == pytest.approx(0.020, rel=0.01)
    assert spec.plain_step_s[8] == pytest.approx(0.010)  # the probe is not a plain step's time
    assert not spec.probe_due()  # 20 ms of probing in 40 ms of decoding: far over budget
    for _ in range(round(0.020 / PROBE_BUDGET / 0.010)):  # enough plain decoding to earn the probe back
        _step(spec, 8, 0.010, 8)
    assert spec.probe_due()
    spec.last_probe = spec.plain_choices  # a probe is taken
    spec.plain_choices += spec.probe_every - 1
    assert not spec.probe_due()  # and never more often than every probe_every plain choices
    spec.plain_choices += 1
    assert spec.probe_due()


def test_a_losing_trial_turns_speculation_off_and_a_retry_turns_it_back_on(spec):
    b = 8
    _step(spec, b, 0.010, b)  # plain reference: 10 ms per step of 8 tokens
    trial = 0
    while spec.measured_allows(b):  # speculative steps emitting 12 tokens in 20 ms: 0.75x of plain
        spec.spec_choices = 1  # keep the periodic plain step out of the way
        _step(spec, b, 0.020, 12, speculated=True)
        trial += 1
        assert trial <= TRIAL_STEPS
    assert trial == 4  # losing outright: the trial stops early
    assert statistics.fmean(spec.realized[b.bit_length()]) == pytest.approx(0.75)
    refused = 1
    while not spec.measured_allows(b):
        spec.spec_choices = 1
        refused += 1
        assert refused < 1000
    assert refused == 31  # the 32nd step after the failed trial speculates again, in a fresh trial
    assert len(spec.realized[b.bit_length()]) == 0


def test_winning_steps_keep_speculation_on(spec):
    b = 4
    _step(spec, b, 0.010, b)
    for _ in range(3 * TRIAL_STEPS):
        spec.spec_choices = 1
        assert spec.measured_allows(b)
        _step(spec, b, 0.012, 3 * b, speculated=True)  # 3 tokens per sequence for 1.2x the time: 2.5x


def test_lookups_are_skipped_when_every_sequence_would_need_a_match(spec):
    spec.match_seen = Counter({0: 300, 3: 700})  # 70% of recent lookups found a 3-token match
    spec.match_accepted[3], spec.match_rejections[3] = 900, 100  # and those drafts were good
    assert spec.ngram_may_pay(16)  # with requests waiting, verifying only the matched ones may pay
    assert not spec.ngram_may_pay(16, require_all=True)  # all 16 matching at once: 0.7^16 = 0.3%
    assert spec.ngram_may_pay(4, require_all=True)  # below 8 sequences lookups always run


def test_a_trial_waits_for_a_plain_step_of_its_own_bucket(spec):
    """Measured against a plain time scaled from another batch size, a trial would read the scaling's error as
    speedup: the first speculative choice in a bucket without a plain time of its own decodes plainly."""
    _step(spec, 8, 0.010, 8)  # bucket 4 only
    spec.spec_choices = 1
    assert not spec.measured_allows(16)  # bucket 5: no plain step measured there yet
    _step(spec, 16, 0.012, 16)
    spec.spec_choices = 1
    assert spec.measured_allows(16)
    spec.spec_choices = 1
    assert spec.measured_allows(24)  # the same bucket: 16's plain time, scaled, is its reference
    spec.spec_choices = 1
    assert spec.measured_allows(8)


def test_cost_table_medians_follow_every_observation():
    rng = random.Random(0)
    table, seen = CostTable(window=5), {}
    for _ in range(400):
        n, t = rng.choice([1, 2, 4, 8, 16, 24, 32]), rng.uniform(0.5, 2.0)
        table.observe(n, t)
        seen.setdefault(n, []).append(t)
        xs, ys = table.curve()
        expect = [statistics.median(seen[x][-5:]) for x in xs]
        for i in range(len(expect) - 2, -1, -1):
            expect[i] = min(expect[i], expect[i + 1])
        assert xs == sorted(seen) and ys == pytest.approx(expect)
    table.samples.clear()  # emptied directly (as a test or notebook may), then measured again
    table.observe(4, 3.0)
    assert table.curve() == ([4], [3.0])


def test_a_loss_at_a_smaller_batch_holds_off_larger_ones_until_their_retry(spec):
    for b in (2, 4, 16):  # each bucket has a plain reference of its own
        _step(spec, b, 0.010, b)
    for _ in range(4):  # batch 4 (bucket 3) loses outright
        spec.spec_choices = 1
        spec.measured_allows(4)
        _step(spec, 4, 0.020, 6, speculated=True)
    spec.spec_choices = 1
    assert not spec.measured_allows(4)
    spec.spec_choices = 1
    assert not spec.measured_allows(16)  # never tried at 16: the loss at 4 speaks for it
    for _ in range(30):
        spec.spec_choices = 1
        spec.measured_allows(16)
    spec.spec_choices = 1
    assert spec.measured_allows(16)  # its own retry: a fresh trial of its own
    spec.spec_choices = 1
    assert spec.measured_allows(16)  # and from now on its own measurements decide
    spec.spec_choices = 1
    assert spec.measured_allows(2)  # smaller batch sizes are not affected


def test_a_clear_plain_decision_is_reused_for_a_few_steps(spec, monkeypatch):
    from minifer.engine.adaptive_k import PLAIN_HOLD

    calls = []
    real = spec.predicted_rate
    monkeypatch.setattr(spec, "predicted_rate", lambda b, k, *a: calls.append((b, k)) or (1.0 if k == 0 else 0.5))
    spec.plain_choices = 1
    assert [spec.choose_k(32) for _ in range(PLAIN_HOLD + 1)] == [(0, False)] * (PLAIN_HOLD + 1)
    assert len(calls) == spec.cfg.num_speculative_tokens + 1  # predicted once (k = 0..k_max), then held
    spec.choose_k(16)  # another batch size is predicted afresh
    assert calls[-1][0] == 16
    monkeypatch.setattr(spec, "predicted_rate", real)


def test_ngram_lookups_that_cannot_pay_are_skipped_for_a_few_steps(monkeypatch):
    """When the match statistics say lookups cannot pay at a batch size, that decision is held like a clear plain
    one (``PLAIN_HOLD``): the check runs once per ``PLAIN_HOLD + 1`` pure-decode steps, and decoding is plain."""
    from minifer import SamplingParams
    from minifer.engine.adaptive_k import PLAIN_HOLD
    from minifer.engine.adaptive_k import NgramAdaptiveK

    llm = LLM("tinystories-target", speculative_config=NGRAM, max_num_seqs=8)
    spec = llm.engine.speculator
    checks = []
    monkeypatch.setattr(NgramAdaptiveK, "ngram_may_pay", lambda self, b, *a, **k: checks.append(b) or b < 8)
    monkeypatch.setattr(spec.adaptive, "probe_due", lambda: False)
    params = SamplingParams(temperature=0, max_tokens=2 * (PLAIN_HOLD + 1) + 1, ignore_eos=True)
    prompts = [f"Once upon a time there was a {w}" for w in ("cat", "dog", "bird", "fox", "frog", "owl", "bee", "elk")]
    outs = llm.generate(prompts, params, use_tqdm=False)
    # the prefill step samples the first token; then 2 * (PLAIN_HOLD + 1) decode steps at 8 sequences
    assert checks == [8, 8]
    assert spec.stats.k_counts[0] == 2 * (PLAIN_HOLD + 1) and spec.stats.num_verifies == 0
    plain = LLM("tinystories-target", max_num_seqs=8).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_held_plain_steps_are_timed_one_in_light_every(spec):
    """A held plain step skips the prediction and, except every ``LIGHT_EVERY``-th, the measurement: every one of
    them adds its time to the probe budget, and one in ``LIGHT_EVERY`` reaches the cost table and the plain step
    time."""
    from minifer.engine.adaptive_k import LIGHT_EVERY

    _step(spec, 8, 0.010, 8)
    before = len(spec.target_cost.samples[8])
    n = 2 * LIGHT_EVERY
    spec.plain_hold[8] = n
    for _ in range(n):
        decision = spec.held_step(8)
        assert decision.k == 0 and not decision.probe and decision.held
        spec.observe(StepRecord(decodes=8, held=True, forward_tokens=8, forward_s=0.020, pure_decode=True,
                                emitted=8, seconds=0.020))
    assert spec.held_step(8) is None  # used up
    assert spec.decode_s == pytest.approx(0.010 + n * 0.020, rel=0.05)
    assert len(spec.target_cost.samples[8]) == before + 2
    assert spec.plain_step_s[8] == pytest.approx(0.020)  # the median of 0.010 and the two timed held steps


def test_held_plain_steps_run_as_the_plain_step_but_one_in_light_every(spec):
    """``plain_step`` lets a held step bypass ``propose`` altogether, except every ``LIGHT_EVERY``-th, which goes
    through it to be measured; each one it lets through uses up a held step and is counted for the probe rule."""
    from minifer.engine.adaptive_k import LIGHT_EVERY

    assert not spec.plain_step(8)  # nothing held
    spec.plain_hold[8] = 3 * LIGHT_EVERY
    verdicts = [spec.plain_step(8) for _ in range(LIGHT_EVERY - 1)]
    assert all(verdicts) and spec.plain_hold[8] == 2 * LIGHT_EVERY + 1
    assert not spec.plain_step(8) and spec.plain_hold[8] == 2 * LIGHT_EVERY + 1  # due for measurement: not used up
    assert spec.held_step(8).held  # so it runs through propose, held, and observe measures it in full
    spec.observe(StepRecord(decodes=8, held=True, forward_tokens=8, forward_s=0.020, pure_decode=True, emitted=8,
                            seconds=0.020))
    assert spec.plain_step_s[8] == pytest.approx(0.020)
    assert spec.plain_step(8) and not spec.plain_step(16)  # the next cycle; another batch size holds nothing
    choices, decode_s = spec.plain_choices, spec.decode_s
    spec.observe_plain(0.010)
    assert spec.decode_s == pytest.approx(decode_s + 0.010, rel=0.01) and spec.plain_choices == choices


@pytest.mark.parametrize("config", [NGRAM, {"method": "draft_model", "model": "tinystories-draft",
                                            "num_speculative_tokens": 4, "adaptive": True}], ids=["ngram", "draft_model"])
def test_a_held_batch_decodes_through_the_plain_step(config):
    """With plain decoding held at the batch's size, the engine's steps skip the speculator (no proposal, nothing
    recorded) but every LIGHT_EVERY-th: the same tokens as a plain engine, every step counted, nothing left behind
    in the draft's cache."""
    from minifer.engine.adaptive_k import LIGHT_EVERY

    llm = LLM("tinystories-target", max_num_seqs=8, speculative_config=config)
    speculator = llm.engine.speculator
    proposals = []
    propose = speculator.propose
    speculator.propose = lambda *a, **kw: proposals.append(1) or propose(*a, **kw)
    speculator.adaptive.plain_hold[8] = 10**6
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompts = [f"Once upon a time there was a {w}" for w in ("cat", "dog", "bird", "fox", "tree", "boat", "king", "cup")]
    outs = llm.generate(prompts, params, use_tqdm=False)
    plain = LLM("tinystories-target", max_num_seqs=8).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    steps = speculator.stats.k_counts.total()
    assert steps >= 47 and speculator.stats.k_counts[0] == steps  # every decode step counted, none speculated
    assert len(proposals) <= 1 + steps // LIGHT_EVERY + 1  # the prompts' step, then one held step in LIGHT_EVERY
    proposer = speculator.proposer
    assert not getattr(proposer, "computed", {})  # finished sequences released their draft state
    if hasattr(proposer, "blocks"):
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_the_probe_budget_is_a_sliding_window(spec):
    for _ in range(5000):  # a long history of decoding without probes
        _step(spec, 8, 0.010, 8)
    spec.plain_choices = spec.probe_every
    _step(spec, 8, 0.010 + 0.05, 8, probe=True)  # one expensive probe (50 ms extra)
    assert not spec.probe_due()  # old decode time is not a bank: 0.2% of ~10 s of recent steps is 20 ms


def test_a_speculative_step_counts_its_expected_tokens(spec):
    """A trial measures a step's cost; its luck with acceptance (1 to k + 1 tokens per sequence) is averaged over
    every verification by the acceptance estimate instead of deciding an 8-step trial."""
    from minifer.spec_decode.metadata import Draft
    from minifer.spec_decode.theory import expected_tokens_per_forward

    b = 4
    _step(spec, b, 0.010, b)  # plain: 4 tokens in 10 ms
    for _ in range(400):
        spec.observe_acceptance(3, True)  # acceptance 3/4
    alpha = spec.alpha_estimate()
    drafts = [Draft([1, 2, 3, 4]), Draft([1, 2]), Draft([]), Draft([])]
    expected = b + expected_tokens_per_forward(alpha, 4) - 1 + expected_tokens_per_forward(alpha, 2) - 1
    assert spec.expected_emitted(b, drafts) == pytest.approx(expected)
    _step(spec, b, 0.020, b, speculated=True, expected=expected, forward_tokens=b + 6)  # every draft rejected
    assert spec.realized[b.bit_length()][-1] == pytest.approx(expected * 0.010 / (b * 0.020), rel=0.05)


def test_the_acceptance_estimate_follows_the_recent_workload(spec):
    for _ in range(2000):
        spec.observe_acceptance(4, False)  # a long spell of drafts accepted in full
    assert spec.alpha_estimate() > 0.95
    for _ in range(1000):
        spec.observe_acceptance(0, True)  # then a workload where the draft is always wrong
    assert spec.alpha_estimate() < 0.1


def test_calibration_times_decode_shaped_forwards_and_frees_its_blocks():
    llm = LLM("tinystories-target", speculative_config=NGRAM)
    spec, blocks = llm.engine.speculator.adaptive, llm.engine.kv_cache_manager
    assert sorted(spec.target_cost.samples) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert all(len(w) == 3 for w in spec.target_cost.samples.values())
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.prefix_cache_stats.queries == 0
    small = LLM("tinystories-target", speculative_config=NGRAM, num_kv_blocks=40)  # 5 blocks per scratch sequence
    assert sorted(small.engine.speculator.adaptive.target_cost.samples) == [1, 2, 4, 8]


def test_the_drafts_catch_up_is_spread_over_a_trial():
    """After a spell of plain steps the draft must first read every token it skipped; that is paid once for the
    steps that follow, so it must not grow into a reason never to switch speculation back on."""
    s = LLM("tinystories-target", speculative_config={"method": "draft_model", "model": "tinystories-draft",
                                                      "num_speculative_tokens": 4, "adaptive": True}
            ).engine.speculator.adaptive
    s.target_cost, s.draft_cost = CostTable(), CostTable()
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        s.target_cost.observe(n, 0.010 * max(1.0, n / 64))
        s.draft_cost.observe(n, 0.001 * max(1.0, n / 16))
    b, k, alpha = 8, 3, 0.8
    time_at = {lag: b * (1 + 2.952 - 1) / s.predicted_rate(b, k, alpha, lag) for lag in (1.0, 100.0)}
    catch_up = (s.draft_cost(b * 100) - s.draft_cost(b * 1)) / TRIAL_STEPS
    assert time_at[100.0] - time_at[1.0] == pytest.approx(catch_up, rel=0.02)


def test_probes_are_counted_apart_from_speculative_steps():
    """A probe is a plain step with one sequence speculating: k = 0 in the histogram, and counted on its own."""
    from minifer.engine.adaptive_k import Decision

    spec = LLM("tinystories-target", speculative_config=NGRAM).engine.speculator
    assert spec.record_choice(8, Decision(3, probe=True)).k == 0
    assert spec.record_choice(8, Decision(3)).k == 3
    assert spec.stats.num_probes == 1
    assert spec.stats.k_counts[0] == 1 and spec.stats.k_counts[3] == 1
    summary = spec.summary()
    assert summary["spec_probes"] == 1 and summary["spec_steps_speculating"] == 1


def test_small_cache_speculator_starts():
    """The adaptive speculator times forwards at start-up; a 16-block cache of 4 tokens must not refuse to start."""
    llm = LLM("tinystories-target", dtype="float32", device="cpu", block_size=4, num_kv_blocks=16,
              speculative_config={"method": "draft_model", "model": "tinystories-draft", "num_speculative_tokens": 4,
                                  "adaptive": True})
    plain = LLM("tinystories-target", dtype="float32", device="cpu", share_weights_with=llm)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    assert (llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].token_ids
            == plain.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].token_ids)
