"""Chapter 01's table of issue 28's targets is read off the committed ``cpu_peer.json``, not typed by hand."""

from __future__ import annotations

import json
from pathlib import Path

from minifer.bench.cpu_peer import left_out
from minifer_course.experiments.cpu_targets import targets
from minifer_course.ch01_diagnose import peer_target_rows

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cpu_peer.json"


def test_verdicts_follow_the_targets_section():
    rows = peer_target_rows({"targets": [
        {"measure": "a", "measured": 0.8, "target": ">= 1", "met": False, "missed_by": 0.2},
        {"measure": "b", "measured": 1.2, "target": ">= 1", "met": True, "missed_by": None},
        {"measure": "c", "measured": None, "target": ">= 1", "met": None, "missed_by": None}]})
    assert [r["verdict"] for r in rows] == ["missed by 0.20", "met", "not measured"]


def test_the_committed_result_carries_the_targets_its_own_figures_give():
    result = json.loads(RESULT.read_text())
    assert result["targets"] == json.loads(json.dumps(targets(result, left_out(result))))
