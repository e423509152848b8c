"""Stop strings: found where the old per-string search found them, at a cost that does not grow with their number."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from minifer.sampling_params import SamplingParams, StopStrings


def _search_each(text: str, after: int, stop: list[str]) -> tuple[int, str] | None:
    """The reference: every stop string searched on its own; the earliest start wins (then the shortest)."""
    hits = [(text.find(s, max(0, after - len(s) + 1)), s) for s in stop]
    hits = [(pos, s) for pos, s in hits if pos >= 0]
    return min(hits) if hits else None


@settings(max_examples=400, derandomize=True, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=4), min_size=1, max_size=6, unique=True),
       st.text("abc", max_size=14), st.data())
def test_find_is_the_per_string_search(stop, text, data):
    after = data.draw(st.integers(0, len(text)))
    assert StopStrings.of(stop).find(text, after) == _search_each(text, after, stop)


class _CountingSet(frozenset):
    lookups = 0

    def __contains__(self, item) -> bool:
        type(self).lookups += 1
        return super().__contains__(item)


def _lookups(count: int) -> int:
    strings = [f"s{i:04d}" for i in range(count)]  # all five characters long: one length to try per ending
    stop = StopStrings(_CountingSet(strings), (5,))
    _CountingSet.lookups = 0
    assert stop.find("x" * 50 + "yz", 50) is None  # two new characters, no stop string among them
    return _CountingSet.lookups


def test_a_token_costs_as_many_lookups_with_ten_thousand_stop_strings_as_with_ten():
    few, many = _lookups(10), _lookups(10_000)
    assert few == many <= 2  # one length, two new characters: two places a stop string could end


def test_sampling_params_build_the_set_once():
    params = SamplingParams(stop=["the end", "."], stop_token_ids=[3, 5])
    assert params.stop_strings is params.stop_strings and params.stop_strings.lengths == (1, 7)
    assert params.stop_token_set == {3, 5}
