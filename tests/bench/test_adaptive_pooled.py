"""minifer_course.experiments.adaptive_pooled on made-up results: which cells it pools, what the pooled and
family-wise readings flag, and that the result it writes goes stale with its inputs. Nothing here measures speed."""

from __future__ import annotations

import json

import pytest

from minifer_course.experiments import adaptive_pooled as ap


def _row(batch: int, mean_k: float, adaptive: list[float], again: list[float], after: list[float] | None = None):
    row = {"batch": batch, "adaptive_mean_k": mean_k, "round_speedups_adaptive": adaptive,
           "round_speedups_plain_again": again}
    if after is not None:
        row["round_speedups_plain_after"] = after
    return row


def _around(centre: float, n: int = 16) -> list[float]:
    """n ratios spread evenly around ``centre`` (+-0.2%): a made-up round-to-round noise."""
    return [centre + 0.004 * (i / (n - 1) - 0.5) for i in range(n)]


def _result(rows_by_method: dict[str, list[dict]], key: str = "speedup") -> dict:
    return {key: {m: {"rows": rows} for m, rows in rows_by_method.items()}}


def test_pools_only_plain_throughout_cells_and_finds_a_half_percent_cost():
    # three plain-throughout cells where adaptive runs 0.5% slow, and one speculating cell at 1.5x that must not
    # be pooled (it would pull the pooled median up)
    result = _result({"draft_model": [_row(4, 2.5, _around(1.5), _around(1.0)),
                                      _row(16, 0.0, _around(0.995), _around(1.0)),
                                      _row(32, 0.0, _around(0.995), _around(1.0))],
                      "ngram_grounded": [_row(16, 0.0, _around(0.995), _around(1.0))]})
    p = ap.pooled(result)
    assert p["cells"] == 3 and p["batches"] == [16, 32]
    assert p["over_plain"]["adaptive"]["n"] == 48
    assert p["over_plain"]["adaptive"]["median"] == pytest.approx(0.995)
    assert p["over_plain"]["adaptive"]["slower"]
    assert not p["over_plain"]["plain_again"]["slower"]
    assert p["adaptive_over"]["plain_again"]["slower"]
    assert p["adaptive_over"]["plain_again"]["median"] == pytest.approx(0.995, abs=1e-4)


def test_no_cost_is_not_flagged_and_the_after_control_is_read_when_present():
    same = _around(1.0)
    result = _result({"ngram_grounded": [_row(8, 0.0, same, same, same), _row(16, 0.0, same, same, same)]},
                     key="sweeps")
    p = ap.pooled(result)
    assert set(p["over_plain"]) == {"adaptive", "plain_again", "plain_after"}
    assert not any(r["slower"] for r in p["over_plain"].values())
    assert not any(r["slower"] for r in p["adaptive_over"].values())


def test_no_plain_throughout_cell_gives_an_empty_reading():
    assert ap.pooled(_result({"draft_model": [_row(1, 3.0, _around(1.7), _around(1.0))]})) == {"cells": 0}


def test_familywise_does_not_flag_what_only_a_single_cell_interval_would():
    # 16 rounds, 13 below 1.0: the 95% interval (4th to 13th of 16) ends below 1.0, the family's (2nd to 15th, at
    # 1 - 0.05/14) does not
    lone = [0.990 + 0.0005 * i for i in range(13)] + [1.01, 1.02, 1.03]
    assert ap.interval(lone)["slower"]
    cells = [_row(8 + i, 0.0, _around(1.0), _around(1.0)) for i in range(13)] + [_row(99, 0.0, lone, _around(1.0))]
    fw = ap.familywise(_result({"ngram_grounded": cells}))
    assert fw["cells"] == 14 and fw["level"] == pytest.approx(1 - 0.05 / 14)
    assert fw["adaptive"]["slower"] == [] and fw["adaptive"]["short_of_level"] == []
    # a cell wholly below 1.0 is flagged at the family's level too
    cells[-1] = _row(99, 0.0, _around(0.98), _around(1.0))
    assert ap.familywise(_result({"ngram_grounded": cells}))["adaptive"]["slower"] == [["ngram_grounded", 99]]


def test_familywise_sets_apart_cells_with_too_few_rounds_for_its_level():
    # four rounds all below 1.0 happen by chance one time in 16: not a finding at the family's level
    fw = ap.familywise(_result({"draft_model": [_row(1, 3.0, _around(1.7, 4), _around(1.0, 4)),
                                                _row(4, 0.4, _around(0.98, 4), _around(1.0, 4))]}))
    assert fw["adaptive"]["slower"] == []
    assert fw["adaptive"]["short_of_level"] == [["draft_model", 1, pytest.approx(0.875), False],
                                                ["draft_model", 4, pytest.approx(0.875), True]]


def test_not_a_speculative_result_is_refused():
    with pytest.raises(ValueError, match="no 'speedup' or 'sweeps'"):
        ap.pooled({"rows": []})


def test_the_written_result_fingerprints_its_inputs(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_result({"ngram_grounded": [_row(16, 0.0, _around(0.995), _around(1.0))]})))
    out = tmp_path / "pooled.json"
    ap.main(["--results", str(tmp_path), "--runs", "run.json", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["runs"]["run.json"]["pooled"]["over_plain"]["adaptive"]["slower"]
    code = saved["metadata"]["code"]
    assert code[run.as_posix()] == saved["inputs"][run.as_posix()]
    assert "minifer_course/experiments/adaptive_pooled.py" in code
