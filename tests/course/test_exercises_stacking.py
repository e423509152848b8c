"""The chapter-06 graders (``minifer_course.grading.stacking``): minifer's own implementations pass, the classic mistakes
fail with a message that names them. (The generated notebooks are covered by ``tests/course/test_exercises.py``.)"""

from __future__ import annotations

import math

import pytest

from minifer_course.grading import stacking as gs
from minifer_course import stacking as st


def _blocks(memory, weights, block):
    return st.split_budget(memory, weights, block, 16).kv_blocks


def test_graders_pass_minifers_own_implementations(capsys):
    gs.check_kv_blocks(_blocks)
    gs.check_lever_analysis(st.lever_analysis)
    out = capsys.readouterr().out
    assert "kv_blocks: 8/8 checks passed" in out and "lever_analysis: 5/5 checks passed" in out
    assert "FAIL" not in out


@pytest.mark.parametrize("wrong, message", [
    (lambda m, w, b: m // b, "the weights come first"),  # forgot the weights
    (lambda m, w, b: max(1, -(-(m - w) // b)), "round down"),  # a partial block counted
    (lambda m, w, b: max(0, (m - w) // b), "raise ValueError"),  # 0 blocks instead of an error
    (lambda m, w, b: (m - w) / b, "is an int"),  # a float
    (lambda m, w, b: (m - w) // b if m - w > b else int("x"),  # off by one: ValueError when exactly one block fits
     r"(?s)check 4/8.*raised ValueError.*expected 1\nhint: .*raise ValueError only when not even one block fits"),
])
def test_kv_blocks_mistakes_fail(wrong, message):
    with pytest.raises(AssertionError, match=message):
        gs.check_kv_blocks(wrong)


def test_an_assert_in_the_learners_code_is_reported_as_theirs():
    def asserts(memory, weight_bytes, block_bytes):  # `assert n >= 1, "not enough memory"` in a notebook
        n = (memory - weight_bytes) // block_bytes
        if n < 1:
            raise AssertionError("not enough memory")
        return n

    with pytest.raises(AssertionError, match=r"^kv_blocks: check 7/8 \(.*\): your function raised AssertionError: "
                                             r"not enough memory$"):
        gs.check_kv_blocks(asserts)


def test_kv_blocks_stub_says_not_implemented():
    def stub(memory, weight_bytes, block_bytes):
        raise NotImplementedError("implement kv_blocks")

    with pytest.raises(AssertionError, match="not implemented yet"):
        gs.check_kv_blocks(stub)


def _variant(gain, *, alone_base="cb", in_stack="last", overlap="product/stacked", check=True, mutate=False,
             static_is_one=False):
    """lever_analysis with switches for the classic mistakes."""
    if check:
        missing = [st.label(c) for c in st.configurations() if c not in gain]
        if missing:
            raise ValueError(f"missing {missing}")
    static, cb, full = frozenset(), frozenset({"continuous"}), frozenset(st.LEVERS)
    base = 1.0 if static_is_one else gain[static]
    alone = {"continuous": gain[cb] / base}
    last = {"continuous": alone["continuous"]}
    for x in st.LEVERS[1:]:
        alone[x] = gain[cb | {x}] / (gain[cb] if alone_base == "cb" else base)
        last[x] = {"last": gain[full] / gain[full - {x}], "first": gain[cb | {x}] / gain[cb],
                   "inverted": gain[full - {x}] / gain[full], "all": gain[full] / gain[full - {x}]}[in_stack]
    if in_stack == "all":  # added last computed for continuous batching like the others: no such configuration
        last["continuous"] = gain[full] / gain[full - {"continuous"}]
    product = math.prod(alone.values())
    stacked = gain[full] / base
    if mutate:
        gain[static] = 1.0 + gain[static]
    return {"alone": alone, "in_stack": last, "product": product, "stacked": stacked,
            "overlap": product / stacked if overlap == "product/stacked" else stacked / product}


def test_the_variant_itself_passes():
    gs.check_lever_analysis(_variant)


@pytest.mark.parametrize("switches, message", [
    ({"alone_base": "static"}, "includes continuous batching's own"),
    ({"in_stack": "first"}, "added last means on top of all the others"),
    ({"in_stack": "inverted"}, "upside down: with it over without it"),
    ({"in_stack": "all"}, "(?s)raised KeyError: gain has no configuration {'int8_kv', 'int8_weights', 'speculative'}"
                          ".*continuous batching's 'added last' is its alone gain"),
    ({"overlap": "stacked/product"}, "upside down: overlap = product / stacked"),
    ({"check": False}, "raised KeyError"),
    ({"mutate": True}, "changed the gain dict"),
    ({"static_is_one": True}, "also passes raw throughputs"),
])
def test_lever_analysis_mistakes_fail_with_their_hint(switches, message):
    with pytest.raises(AssertionError, match=message):
        gs.check_lever_analysis(lambda g: _variant(g, **switches))


def test_lever_analysis_result_shape_is_checked():
    with pytest.raises(AssertionError, match="has no 'in_stack'"):
        gs.check_lever_analysis(lambda g: {k: v for k, v in st.lever_analysis(g).items() if k != "in_stack"})
    with pytest.raises(AssertionError, match="expected a dict"):
        gs.check_lever_analysis(lambda g: list(st.lever_analysis(g).values()))
