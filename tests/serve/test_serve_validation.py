"""The server's edges (``minifer/entrypoints/openai/serve.py``): values that would break a step are refused before they reach it, an
explicit ``max_tokens`` the context cannot hold is vLLM's 400, stop tokens stay out of the text, OpenAI's other
prompt and content forms, ``null`` fields, and HTTP details (chunked bodies, 405, query strings), each error
OpenAI's JSON body."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from minifer import LLM, SamplingParams
from minifer.entrypoints.openai.serve import sse_events, start_server

pytestmark = pytest.mark.core  # the fast tier (tests/README.md)

MODEL = "tiny"
MAX_MODEL_LEN = 64
DOT = 14  # the token "." of the bundled tokenizer


@pytest.fixture(scope="module")
def oracle():
    return LLM("tinystories-draft", max_num_seqs=4, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(oracle):
    served = LLM("tinystories-draft", max_num_seqs=4, max_model_len=MAX_MODEL_LEN, share_weights_with=oracle)
    served.tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                      "{% if add_generation_prompt %}assistant:{% endif %}")
    with start_server(served, port=0, model_name=MODEL) as srv:
        yield srv


def request(server, method: str, path: str, body=None, headers: dict | None = None):
    """``(status, headers, text)``; ``body``: JSON-able, bytes, or an iterator of bytes (sent chunked)."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    chunked = body is not None and not isinstance(body, (bytes, str, dict, list))
    data = body if chunked or isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})},
                 encode_chunked=chunked)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, resp.headers, text


def post(server, body, path: str = "/v1/completions"):
    status, _, text = request(server, "POST", path, body)
    return status, json.loads(text)


def greedy(max_tokens: int | None = None, **kw) -> dict:
    body = {"model": MODEL, "temperature": 0, **kw}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def texts(oracle, prompt, **kw) -> list[str]:
    return [c.text for c in oracle.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0].outputs]


# --- 1. values that would fail a step (and with it every request in flight) ----------------------------------

ALL_TOKENS = list(range(2048))


@pytest.mark.parametrize("field, value", [
    ("logprobs", True), ("max_tokens", True), ("seed", True), ("seed", 2**70), ("top_k", 10**20), ("top_k", True),
    ("n", True), ("stop_token_ids", [True]), ("prompt_logprobs", True), ("ignore_eos", "false"),
    ("skip_special_tokens", "false"), ("skip_special_tokens", 0), ("include_stop_str_in_output", "yes"),
    ("temperature", 1e39), ("repetition_penalty", 1e-50), ("repetition_penalty", 1e50), ("top_p", "0.5"),
    ("min_p", "0.1"), ("logit_bias", {"5_0": 1}), ("logit_bias", {" 5": 1}), ("stop", 5), ("stop_token_ids", 5),
])
def test_values_that_would_break_a_step_are_refused_while_others_run(server, field, value):
    result: dict = {}
    good = threading.Thread(target=lambda: result.update(ok=post(server, greedy(40, prompt="Tom", ignore_eos=True))))
    good.start()
    status, err = post(server, {**greedy(5, prompt="Tom"), field: value})
    good.join()
    assert status == 400 and err["error"]["param"] == field, err
    assert field in err["error"]["message"]
    assert result["ok"][0] == 200 and result["ok"][1]["usage"]["completion_tokens"] == 40


def test_masking_every_token_until_min_tokens_is_refused(server):
    status, err = post(server, greedy(5, prompt="Tom", temperature=1.0, min_tokens=2, stop_token_ids=ALL_TOKENS))
    assert status == 400 and "nothing is left to sample" in err["error"]["message"]
    status, _ = post(server, greedy(5, prompt="Tom", min_tokens=2, stop_token_ids=ALL_TOKENS[1:], ignore_eos=True))
    assert status == 200  # token 0 (EOS) is left when EOS is ignored


# --- 2. max_tokens beyond the context ------------------------------------------------------------------------


def test_an_explicit_max_tokens_the_context_cannot_hold_is_refused_as_vllm_does(server, oracle):
    prompt = "Tom went to the park"
    n = len(oracle.get_tokenizer()(prompt)["input_ids"])
    room = MAX_MODEL_LEN - n
    for field in ("max_tokens", "max_completion_tokens"):
        status, err = post(server, {"model": MODEL, "prompt": prompt, field: room + 1})
        assert status == 400 and err["error"]["param"] == field
        assert err["error"]["message"] == (
            f"'max_tokens' or 'max_completion_tokens' is too large: {room + 1}. This model's maximum context length "
            f"is {MAX_MODEL_LEN} tokens and your request has {n} input tokens ({room + 1} > {MAX_MODEL_LEN} - {n}).")
    status, got = post(server, greedy(room, prompt=prompt, ignore_eos=True))
    assert status == 200 and got["usage"]["completion_tokens"] == room
    longer = prompt + " with his dog"
    status, err = post(server, greedy(room, prompt=["Tom", longer], ignore_eos=True))
    m = len(oracle.get_tokenizer()(longer)["input_ids"])
    assert status == 400 and f"your request has {m} input tokens ({room} > {MAX_MODEL_LEN} - {m})" in \
        err["error"]["message"]
    assert not server.loop.engine.requests  # the first prompt, admitted, was taken back


def test_the_default_max_tokens_still_fits_a_long_prompt(server):
    ids = [0] + [795] * (MAX_MODEL_LEN - 5)  # room for 4 tokens: fewer than the default 16
    status, got = post(server, greedy(prompt=ids, ignore_eos=True))
    assert status == 200 and got["usage"]["completion_tokens"] == 4
    assert got["choices"][0]["finish_reason"] == "length"


# --- 3. stop tokens and include_stop_str_in_output ---------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_stays_out_of_the_text_unless_asked(server, oracle, include):
    body = greedy(40, prompt="Once upon a time", stop_token_ids=[DOT], include_stop_str_in_output=include)
    status, got = post(server, body)
    want = oracle.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[DOT]),
                           use_tqdm=False)[0].outputs[0]
    text = got["choices"][0]["text"]
    assert status == 200 and got["choices"][0]["finish_reason"] == "stop" and want.token_ids[-1] == DOT
    assert got["usage"]["completion_tokens"] == len(want.token_ids)  # the stop token is still an output token
    assert text == (want.text + "." if include else want.text) and not want.text.endswith(".")
    status, _, stream = request(server, "POST", "/v1/completions", {**body, "stream": True})
    assert status == 200 and "".join(c["choices"][0]["text"] for c in sse_events(stream)) == text


def test_include_stop_str_in_output_keeps_a_stop_string_and_streams_it(server, oracle):
    full = texts(oracle, "Once upon a time", temperature=0, max_tokens=40)[0]
    stop = "named Lily"
    assert stop in full
    body = greedy(40, prompt="Once upon a time", stop=[stop], include_stop_str_in_output=True)
    status, got = post(server, body)
    assert status == 200 and got["choices"][0]["text"] == full[: full.index(stop) + len(stop)]
    _, _, stream = request(server, "POST", "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse_events(stream)) == got["choices"][0]["text"]


# --- 4. prompt and content forms ---------------------------------------------------------------------------------


def test_a_list_of_token_id_lists_is_one_choice_set_each(server, oracle):
    prompts = [[0, 419, 436], [0, 865]]
    status, got = post(server, greedy(6, prompt=prompts))
    want = [o.outputs[0].text for o in oracle.generate([{"prompt_token_ids": p} for p in prompts],
                                                       SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)]
    assert status == 200 and [c["text"] for c in got["choices"]] == want
    assert [c["index"] for c in got["choices"]] == [0, 1]
    for bad in ([[0, 419], []], [[0, 419], "Tom"], [[0, True]]):
        status, err = post(server, greedy(6, prompt=bad))
        assert status == 400 and err["error"]["param"] == "prompt"


def test_an_empty_prompt_is_its_bos_token(server, oracle):
    status, got = post(server, greedy(6, prompt=""))
    assert status == 200 and got["usage"]["prompt_tokens"] == 1
    assert got["choices"][0]["text"] == texts(oracle, "", temperature=0, max_tokens=6)[0]


def test_chat_content_as_text_parts(server):
    plain = [{"role": "user", "content": "Tell me\nabout a cat."}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me"},
                                          {"type": "text", "text": "about a cat."}]}]
    _, want = post(server, greedy(8, messages=plain, ignore_eos=True), "/v1/chat/completions")
    status, got = post(server, greedy(8, messages=parts, ignore_eos=True), "/v1/chat/completions")
    assert status == 200 and got["choices"][0]["message"] == want["choices"][0]["message"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]
    status, err = post(server, greedy(8, messages=image), "/v1/chat/completions")
    assert status == 400 and err["error"]["param"] == "messages" and "only parts {'type': 'text'" in \
        err["error"]["message"]


# --- 5. null means the default ----------------------------------------------------------------------------------


def test_null_fields_mean_their_defaults(server, oracle):
    nulls = dict.fromkeys(["temperature", "top_p", "n", "top_k", "min_p", "repetition_penalty", "stream", "stop",
                           "seed", "logprobs", "stream_options", "stop_token_ids", "ignore_eos", "logit_bias",
                           "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs", "min_tokens",
                           "presence_penalty", "frequency_penalty", "max_completion_tokens", "best_of", "echo",
                           "suffix", "user"])
    status, got = post(server, {"model": MODEL, "prompt": "Tom", "max_tokens": 3, **nulls})
    assert status == 200 and got["usage"]["completion_tokens"] <= 3  # max_completion_tokens=null: max_tokens holds
    status, got = post(server, {"model": MODEL, "prompt": "Tom", "max_tokens": 3, **nulls, "seed": 7})
    assert got["choices"][0]["text"] == texts(oracle, "Tom", seed=7, max_tokens=3)[0]  # temperature=null: 1.0
    status, got = post(server, {"model": MODEL, "prompt": "Tom", "max_tokens": None, "ignore_eos": True})
    assert status == 200 and got["usage"]["completion_tokens"] == 16  # the completions default
    status, got = post(server, {"model": MODEL, "prompt": "Tom", "max_tokens": 9, "max_completion_tokens": 2})
    assert status == 200 and got["usage"]["completion_tokens"] <= 2  # the newer name wins when set


# --- 6. the prompt an error is about ----------------------------------------------------------------------------


def test_errors_name_the_prompt_at_fault(server):
    status, err = post(server, greedy(4, prompt=[[0, 419], [0, 99999]]))
    assert status == 400 and "prompt 1: token id 99999" in err["error"]["message"]
    status, err = post(server, greedy(4, prompt=["Tom", "Tom " * 80]))
    assert status == 400 and err["error"]["message"].startswith("prompt 1 has")


def test_a_request_for_more_completions_than_the_server_makes_is_refused(server):
    from minifer.entrypoints.openai.serve import MAX_COMPLETIONS_PER_REQUEST as most

    status, err = post(server, greedy(2, prompt=["Tom"] * (most // 4 + 1), n=4))
    assert status == 400 and err["error"]["param"] == "n" and f"at most {most} per request" in err["error"]["message"]
    status, got = post(server, greedy(1, prompt=["Tom", "Lily"], n=3))
    assert status == 200 and len(got["choices"]) == 6


def test_n_beyond_the_slots_the_server_runs_is_refused_and_says_how_completions_share_them(server):
    status, err = post(server, greedy(2, prompt="Tom", n=5))  # the server runs 4 sequences at once
    assert status == 400 and err["error"]["param"] == "n"
    assert "max_num_seqs=4" in err["error"]["message"] and "half" in err["error"]["message"]
    status, got = post(server, greedy(1, prompt="Tom", n=4))
    assert status == 200 and len(got["choices"]) == 4


# --- 8. HTTP ----------------------------------------------------------------------------------------------------


def test_a_chunked_body_is_read(server):
    body = json.dumps(greedy(4, prompt="Tom")).encode()
    status, _, text = request(server, "POST", "/v1/completions", iter([body[:10], body[10:]]))
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 4
    status, _, text = request(server, "POST", "/v1/completions", b"zz\r\n{}\r\n0\r\n\r\n",
                              {"Transfer-Encoding": "chunked"})
    assert status == 400 and "illegal chunk header" in json.loads(text)["error"]["message"]
    status, _, text = request(server, "POST", "/v1/completions", body, {"Transfer-Encoding": "gzip"})
    assert status == 400 and "Transfer-Encoding" in json.loads(text)["error"]["message"]


def test_content_length_methods_and_query_strings(server):
    body = json.dumps(greedy(2, prompt="Tom")).encode()
    status, _, text = request(server, "POST", "/v1/completions", body, {"Content-Length": "-3"})
    assert status == 400 and "Content-Length" in json.loads(text)["error"]["message"]
    status, headers, _ = request(server, "GET", "/v1/completions")
    assert status == 405 and headers["Allow"] == "POST"
    status, headers, _ = request(server, "POST", "/health", {})
    assert status == 405 and set(headers["Allow"].split(", ")) == {"GET", "HEAD"}
    assert request(server, "GET", "/health?x=1")[0] == 200
    status, _, text = request(server, "GET", "/v1/models?x")
    assert status == 200 and json.loads(text)["data"][0]["id"] == MODEL
    assert request(server, "POST", "/v1/completions?x=1", body)[0] == 200
    assert request(server, "GET", "/nope?x=1")[0] == 404


def test_stream_options_are_for_streams_only(server):
    status, err = post(server, greedy(2, prompt="Tom", stream_options={"include_usage": True}))
    assert status == 400 and err["error"]["param"] == "stream_options"
    status, err = post(server, greedy(2, prompt="Tom", stream=True, stream_options={"include_usage": "yes"}))
    assert status == 400 and "include_usage must be true or false" in err["error"]["message"]
    status, err = post(server, greedy(2, prompt="Tom", stream=True, stream_options={"include_usages": True}))
    assert status == 400 and "include_usages" in err["error"]["message"]
    status, _, text = request(server, "POST", "/v1/completions",
                              greedy(2, prompt="Tom", stream=True, stream_options={"include_usage": True}))
    assert status == 200 and sse_events(text)[-1]["usage"]["completion_tokens"] == 2
