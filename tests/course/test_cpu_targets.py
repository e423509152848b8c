"""Issue 28's targets read off a CPU peer result (``minifer_course.experiments.cpu_targets``): each engine's fastest
configuration per budget of cores, the verdicts, met or missed by how much and why, and what the command adds to the
benchmark's result. The results here are made up; no timing is judged."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from minifer.bench import cpu_peer
from minifer_course.experiments import cpu_targets
from minifer_course.experiments.cpu_targets import best_pair, targets


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


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    cpu_peer.add_arguments(ap, (*cpu_peer.SECTIONS, "bounds"))
    return ap.parse_args(list(argv))


def test_the_command_adds_the_bounds_it_is_asked_for_and_the_targets(monkeypatch):
    ran = {}

    def run(model, num_requests, rounds, sections, *rest, **kw):
        ran["sections"] = sections
        return {**made_up_result(), "real_shape_decode": {}, "step_overhead": {}}

    monkeypatch.setattr(cpu_peer, "run", run)
    monkeypatch.setattr(cpu_targets, "real_shape_decode", lambda rounds, log: made_up_result()["real_shape_decode"])
    monkeypatch.setattr(cpu_targets, "step_overhead", lambda n, slots, rounds, log: made_up_result()["step_overhead"])
    res = cpu_targets.measure(_args("--sections", "peer", "bounds"), log=lambda _: None)
    assert ran["sections"] == ["peer"]  # the benchmark is not asked for a section it does not have
    assert res["targets"] == targets(made_up_result(), cpu_peer.left_out(made_up_result()))
    assert res["real_shape_decode"]["layouts"]["b"]["of_bound"] == 0.72


def test_without_the_bounds_their_targets_are_not_measured(monkeypatch):
    monkeypatch.setattr(cpu_peer, "run", lambda *a, **kw: {"configs": {}, "ratios": {}})
    res = cpu_targets.measure(_args("--sections", "peer"), log=lambda _: None)
    assert "real_shape_decode" not in res and all(t["measured"] is None for t in res["targets"])


RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cpu_peer.json"


def test_the_committed_result_carries_the_targets_its_own_figures_give():
    """The lab book's table of targets is the committed ``cpu_peer.json``'s own, not typed by hand."""
    result = json.loads(RESULT.read_text())
    assert result["targets"] == json.loads(json.dumps(targets(result, cpu_peer.left_out(result))))
