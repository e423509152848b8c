"""The CTranslate2 peer benchmark's bookkeeping (``minifer.bench.cpu_peer``): interleaved order, ratios, CT2's stop
callback and worker batches, and a clear skip when CT2 is absent. Its timings are never judged here: the results
below are made up."""

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


def test_without_ctranslate2_the_peer_is_skipped_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(cpu_peer, "ct2_import", lambda: None)
    said = []
    res = cpu_peer.run("tinystories-draft", num_requests=2, rounds=1, sections=(), log=said.append)
    assert res["ctranslate2"] == {"skipped": cpu_peer.CT2_MISSING} and said == [cpu_peer.CT2_MISSING]
    assert "pip install" in cpu_peer.CT2_MISSING and res["ratios"] == {}
