"""The CTranslate2 peer benchmark's bookkeeping (``minifer.bench.cpu_peer``): interleaved order, ratios, CT2's stop
callback, and a clear skip when CT2 is absent. Its timings are never judged here."""

from __future__ import annotations

from types import SimpleNamespace

from minifer.bench import cpu_peer
from minifer.bench.cpu_peer import Config, _stopper, interleaved, summarize


def test_rounds_alternate_their_order_and_ratios_are_medians_of_rounds():
    calls = []
    seconds = {"a": iter([1.0, 2.0, 1.0]), "b": iter([2.0, 2.0, 4.0])}

    def config(name):
        return Config(name, "minifer", lambda: calls.append(name) or next(seconds[name]), tokens=10)

    configs = [config("a"), config("b")]
    times = interleaved(configs, 3, log=lambda _: None)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    out = summarize(configs, times, [("a over b", "a", "b"), ("absent", "a", "zzz")])
    assert out["ratios"]["a over b"]["rounds"] == [2.0, 1.0, 4.0]
    assert out["ratios"]["a over b"]["median_of_round_ratios"] == 2.0 and "absent" not in out["ratios"]
    assert out["configs"]["a"]["tok_per_s"] == 10.0 and out["configs"]["b"]["ms_per_token"] == 200.0


def test_the_stop_callback_counts_each_requests_own_tokens():
    stop = _stopper([2, 1])
    step = lambda i: SimpleNamespace(batch_id=i, step=99)  # noqa: E731 (CT2's step also counts prompt tokens)
    assert [stop(step(0)), stop(step(1)), stop(step(0))] == [False, True, True]


def test_without_ctranslate2_the_peer_is_skipped_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(cpu_peer, "ct2_import", lambda: None)
    said = []
    res = cpu_peer.run("tinystories-draft", num_requests=2, rounds=1, sections=(), log=said.append)
    assert res["ctranslate2"] == {"skipped": cpu_peer.CT2_MISSING} and said == [cpu_peer.CT2_MISSING]
    assert "pip install" in cpu_peer.CT2_MISSING and res["ratios"] == {}
