"""``/metrics``: parsed by ``prometheus_client``'s own parser, under vLLM's names and labels, and moving by exactly
what the requests in between did (tokens, finished requests, latency observations: each completion of an n > 1
request counts as a request, as in vLLM v1); a speculative server adds vLLM's speculative-decoding counters."""

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
    return samples[name, tuple(sorted({"model_name": MODEL, "engine": "0", **labels}.items()))]


def complete(srv, prompt: str, max_tokens: int, stream: bool = False, **fields) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": stream, **fields}
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


PER_COMPLETION = ["e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                  "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
                  "request_generation_tokens", "request_params_max_tokens", "time_to_first_token_seconds"]


def test_each_completion_counts_as_a_request_under_its_own_finish_reason(server):
    before, steps = scrape(server), server.loop.steps
    # n=3 whose choices end apart (seed 3: one on the stop string ".", two at max_tokens), and an n=1 at max_tokens
    answer = json.loads(complete(server, "Once upon a time", 8, n=3, temperature=1.0, seed=3, stop=["."],
                                 ignore_eos=False))
    json.loads(complete(server, "Tom", 5))
    after = scrape(server)

    def moved(name: str, **labels) -> float:
        return value(after, f"vllm:{name}", **labels) - value(before, f"vllm:{name}", **labels)

    reasons = [c["finish_reason"] for c in answer["choices"]]
    assert sorted(set(reasons)) == ["length", "stop"]  # the case this test is about
    assert moved("request_success_total", finished_reason="stop") == reasons.count("stop")
    assert moved("request_success_total", finished_reason="length") == reasons.count("length") + 1
    for name in PER_COMPLETION:
        assert moved(f"{name}_count") == 4, name
    assert moved("request_params_n_count") == 2 and moved("request_params_n_sum") == 3 + 1
    assert moved("request_params_max_tokens_sum") == 3 * 8 + 5
    assert moved("request_generation_tokens_sum") == answer["usage"]["completion_tokens"] + 5
    tok = server.loop.engine.tokenizer
    assert moved("request_prompt_tokens_sum") == 3 * len(tok("Once upon a time")["input_ids"]) + len(
        tok("Tom")["input_ids"])
    assert moved("iteration_tokens_total_count") == server.loop.steps - steps > 0
    info = next(k for k in after if k[0] == "vllm:cache_config_info")
    assert dict(info[1])["block_size"] == str(server.loop.engine.kv_cache_manager.block_size)
    assert dict(info[1])["engine"] == "0" and after[info] == 1
    assert after["process_resident_memory_bytes", ()] > 0  # prometheus_client's default collectors


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
