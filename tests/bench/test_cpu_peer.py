"""The CTranslate2 peer benchmark's bookkeeping (``minifer.bench.cpu_peer``, ``cpu_targets``): interleaved order,
ratios, CT2's stop callback and worker batches, the target verdicts, and a clear skip when CT2 is absent. Its
timings are never judged here: the results below are made up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minifer.bench import cpu_peer
from minifer.bench.cpu_peer import (
    Config,
    _stopper,
    interleaved,
    summarize,
    two_worker_batch,
)
from minifer.bench.cpu_targets import best_pair, targets

WORKLOAD = SimpleNamespace(total_output_tokens=10)


def test_rounds_alternate_their_order_and_ratios_are_medians_of_rounds():
    calls = []
    seconds = {"a": iter([1.0, 2.0, 1.0]), "b": iter([2.0, 2.0, 4.0])}

    def config(name):
        return Config(name, "minifer", lambda w: calls.append((name, w)) or next(seconds[name]))

    configs = [config("a"), config("b")]
    times = interleaved(configs, 3, WORKLOAD, log=lambda _: None)
    assert calls == [(n, WORKLOAD) for n in ["a", "b", "b", "a", "a", "b"]]
    out = summarize(configs, times, [("a over b", "a", "b"), ("absent", "a", "zzz")], WORKLOAD)
    assert out["ratios"]["a over b"]["rounds"] == [2.0, 1.0, 4.0]
    assert out["ratios"]["a over b"]["median_of_round_ratios"] == 2.0 and "absent" not in out["ratios"]
    assert out["configs"]["a"]["tok_per_s"] == 10.0 and out["configs"]["b"]["ms_per_token"] == 200.0


def test_a_configuration_with_its_own_request_keeps_its_token_count():
    c = Config("batch1", "minifer", lambda _: 2.0, tokens=128)
    out = summarize([c], interleaved([c], 1, WORKLOAD, log=lambda _: None), [], WORKLOAD)
    assert out["configs"]["batch1"]["tokens"] == 128 and out["configs"]["batch1"]["tok_per_s"] == 64.0


@pytest.mark.parametrize("n, batch", [(1, 1), (3, 2), (64, 32), (100, 50), (128, 64), (512, 64)])
def test_each_of_ct2s_two_workers_gets_a_batch(n, batch):
    assert two_worker_batch(n) == batch and -(-n // batch) >= min(n, 2)


def test_the_stop_callback_counts_each_requests_own_tokens():
    stop = _stopper([2, 1])
    step = lambda i: SimpleNamespace(batch_id=i, step=99)  # noqa: E731 (CT2's step also counts prompt tokens)
    assert [stop(step(0)), stop(step(1)), stop(step(0))] == [False, True, True]


def _config(seconds, tok_per_s, **kw):
    return {"seconds": seconds, "tok_per_s": tok_per_s, "ms_per_token": 1e3 / tok_per_s, **kw}


def _ratio(r):
    return {"median_of_round_ratios": r, "rounds": [r]}


def made_up_result():
    configs = {"minifer-fast-16slots-1t": _config([4.0, 4.0, 4.0], 100), "minifer-fast-64slots-1t": _config(
        [2.0, 3.0, 2.0], 200), "ct2-static16-1t": _config([2.0, 2.0, 2.0], 200), "ct2-sorted64-1t": _config(
        [1.0, 1.5, 1.0], 400), "minifer-fast-64slots-dp2": _config([1.0, 1.0, 1.0], 500),
        "ct2-sorted64-2workers": _config([1.2, 0.9, 1.1], 450), "minifer-batch1-eager": _config([1.0], 200),
        "minifer-batch1-fast": _config([1.0], 300), "ct2-batch1": _config([1.0], 400)}
    ratios = {"batch 1, ms per token: minifer / CT2 speed": _ratio(0.75),
              "int8 (integer matmul) vs float32, 16 slots": _ratio(1.6),
              "int8 (integer matmul) vs float32, 64 slots": _ratio(1.45),
              "lever alone: compile, 64 slots vs eager": _ratio(0.9)}
    return {"configs": configs, "ratios": ratios, "identity": {"prompts": 16, "identical_prompts": 15},
            "real_shape_decode": {"bytes_per_step": 2e9, "layouts": {
                "a": {"of_bound": 0.5, "step_ms": 100.0, "copy_bandwidth_gb_s": 40.0},
                "b": {"of_bound": 0.72, "step_ms": 70.0, "copy_bandwidth_gb_s": 40.0}}},
            "step_overhead": {"continuous": {"overhead_ms": 0.15, "fraction_of_bound": 0.9},
                              "levers_ms_saved": {"x": 0.1}}}


def test_best_pair_takes_each_engines_fastest_configuration_and_the_median_of_its_rounds():
    pair = best_pair(made_up_result(), cpu_peer_budget := {"minifer": ["minifer-fast-16slots-1t",
                                                                      "minifer-fast-64slots-1t"],
                                                          "ctranslate2": ["ct2-static16-1t", "ct2-sorted64-1t"]})
    assert pair["minifer"] == "minifer-fast-64slots-1t" and pair["ctranslate2"] == "ct2-sorted64-1t"
    assert pair["rounds"] == [0.5, 0.5, 0.5] and pair["median_of_round_ratios"] == 0.5
    assert best_pair(made_up_result(), {**cpu_peer_budget, "ctranslate2": ["absent"]}) is None


def test_targets_say_met_or_missed_by_how_much_and_why_only_when_missed():
    rows = {t["measure"].split(",")[0]: t for t in targets(made_up_result())}
    one = targets(made_up_result(), ["compile"])[0]
    assert one["met"] is False and one["missed_by"] == pytest.approx(0.5) and "compile 0.90x" in one["why"]
    assert [t["met"] for t in targets(made_up_result())] == [False, True, False, True, False, True, False]
    assert rows["batch-1 ms per token"]["missed_by"] == pytest.approx(0.05)
    assert rows["int8 weights vs float32"]["measured"] == 1.45 and "16 and 64 slots" in rows[
        "int8 weights vs float32"]["why"]
    met = [t for t in targets(made_up_result()) if t["met"]]
    assert all(t["why"] is None and t["missed_by"] is None for t in met)
    assert "20.0 GB/s against a copy's 40.0" in targets({**made_up_result(), "real_shape_decode": {
        "bytes_per_step": 2e9, "layouts": {"a": {"of_bound": 0.5, "step_ms": 100.0, "copy_bandwidth_gb_s": 40.0}}}})[3][
        "why"]


def test_a_section_not_run_is_not_measured_rather_than_missed():
    rows = targets({"configs": {}, "ratios": {}})
    assert all(t["measured"] is None and t["met"] is None and t["why"] is None for t in rows)


def test_without_ctranslate2_the_peer_is_skipped_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(cpu_peer, "ct2_import", lambda: None)
    said = []
    res = cpu_peer.run("tinystories-draft", num_requests=2, rounds=1, sections=(), log=said.append)
    assert res["ctranslate2"] == {"skipped": cpu_peer.CT2_MISSING} and said == [cpu_peer.CT2_MISSING]
    assert "pip install" in cpu_peer.CT2_MISSING and res["ratios"] == {}
    assert all(t["measured"] is None for t in res["targets"])
