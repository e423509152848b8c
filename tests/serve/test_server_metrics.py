"""``/metrics``: parsed by ``prometheus_client``'s own parser, under vLLM's names, and moving by exactly what the
requests in between did (tokens, finished requests, latency observations); a speculative server adds vLLM's
speculative-decoding counters."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from minifer import LLM
from minifer.entrypoints.openai.serve import start_server

MODEL = "tiny"


def scrape(srv) -> dict[tuple[str, tuple], float]:
    """Every sample as ``(name, sorted labels) -> value``, through prometheus_client's parser."""
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples[name, tuple(sorted({"model_name": MODEL, **labels}.items()))]


def complete(srv, prompt: str, max_tokens: int, stream: bool = False) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": stream}
    req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def server():
    llm = LLM("tinystories-draft", max_num_seqs=4)
    with start_server(llm, port=0, model_name=MODEL) as srv:
        yield srv


NAMES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
         "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
         "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
         "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"]


def test_metrics_parse_and_move_by_what_the_requests_did(server):
    before = scrape(server)
    for name in NAMES:
        assert value(before, name) >= 0, name
    prompts = ["Once upon a time", "Tom"]
    tok = server.loop.engine.tokenizer
    for p in prompts:
        complete(server, p, 5)
    complete(server, "Lily", 4, stream=True)
    after = scrape(server)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    prompt_tokens = sum(len(tok(p)["input_ids"]) for p in [*prompts, "Lily"])
    assert moved("vllm:prompt_tokens_total") == prompt_tokens
    assert moved("vllm:generation_tokens_total") == 5 + 5 + 4
    assert moved("vllm:request_success_total", finished_reason="length") == 3
    assert moved("vllm:time_to_first_token_seconds_count") == 3
    assert moved("vllm:inter_token_latency_seconds_count") == 4 + 4 + 3  # one per later token: no speculation
    assert moved("vllm:e2e_request_latency_seconds_count") == 3
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    assert value(after, "vllm:prefix_cache_hits_total") <= value(after, "vllm:prefix_cache_queries_total")


def test_a_running_stream_is_counted_as_running(server):
    host, port = server.url.removeprefix("http://").split(":")
    import http.client

    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Tom", "max_tokens": 300,
                                                        "ignore_eos": True, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")  # it runs: its first token came
    during = scrape(server)
    conn.close()  # leaves: aborted
    deadline = time.monotonic() + 30
    while server.loop.engine.requests and time.monotonic() < deadline:  # gone before the next test counts
        time.sleep(0.05)
    assert not server.loop.engine.requests
    assert value(during, "vllm:num_requests_running") == 1
    assert value(during, "vllm:kv_cache_usage_perc") > 0


def test_speculative_decoding_counters():
    llm = LLM("tinystories-draft", max_num_seqs=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1, "adaptive": False})
    with start_server(llm, port=0, model_name=MODEL) as srv:
        results = []
        threads = [threading.Thread(target=lambda: results.append(complete(srv, "Tom and Tom and Tom and", 24)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        s = scrape(srv)
    drafted, accepted = value(s, "vllm:spec_decode_num_draft_tokens_total"), value(
        s, "vllm:spec_decode_num_accepted_tokens_total")
    assert len(results) == 2 and drafted > 0 and 0 <= accepted <= drafted
    assert value(s, "vllm:spec_decode_num_drafts_total") > 0
    assert value(s, "vllm:generation_tokens_total") == 48
