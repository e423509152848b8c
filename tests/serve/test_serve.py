"""The OpenAI-compatible server (``minifer/entrypoints/openai/serve.py``) against ``LLM.generate`` as the oracle: the same tokens
over HTTP, alone and concurrently; streaming deltas that add up; clear 4xx errors that leave other requests
alone; a client that disconnects has its request aborted and its blocks freed; a failing step fails only the
requests in flight."""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from minifer import LLM, SamplingParams
from minifer.entrypoints.openai.serve import sse_events, start_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def llm():
    """The oracle: ``LLM.generate`` on its own engine (a served engine belongs to the server's thread)."""
    return LLM("tinystories-target", max_num_seqs=8, num_kv_blocks=512)


@pytest.fixture(scope="module")
def server(llm):
    served = LLM("tinystories-target", max_num_seqs=8, num_kv_blocks=512, share_weights_with=llm)
    with start_server(served, port=0, model_name=MODEL) as srv:
        yield srv


def post(server, path: str, body, raw: bool = False):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            return r.status, text if raw else json.loads(text)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(text: str) -> list:
    assert text.rstrip().endswith("data: [DONE]")
    return sse_events(text)


def greedy(n_tokens: int, **kw) -> dict:
    return {"model": MODEL, "max_tokens": n_tokens, "temperature": 0, **kw}


def test_health_models_and_unknown_routes(server):
    with urllib.request.urlopen(server.url + "/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}
    with urllib.request.urlopen(server.url + "/v1/models") as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [MODEL]
    status, body = post(server, "/v1/nope", {})
    assert status == 404 and "no route" in body["error"]["message"]


def test_completion_equals_generate(server, llm):
    status, body = post(server, "/v1/completions", greedy(24, prompt="Once upon a time"))
    want = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert status == 200 and body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == want.outputs[0].text
    assert body["choices"][0]["finish_reason"] == want.outputs[0].finish_reason
    assert body["usage"] == {"prompt_tokens": len(want.prompt_token_ids),
                             "completion_tokens": len(want.outputs[0].token_ids),
                             "total_tokens": len(want.prompt_token_ids) + len(want.outputs[0].token_ids)}
    ids = want.prompt_token_ids
    status, by_ids = post(server, "/v1/completions", greedy(24, prompt=ids))
    assert status == 200 and by_ids["choices"][0]["text"] == want.outputs[0].text


def test_concurrent_requests_share_steps_and_match(server, llm, monkeypatch):
    prompts = [f"Tom saw {w}" for w in ("a dog", "the sea", "a big red ball", "his mom", "a bird", "Lily",
                                         "a cake", "the moon")]
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40,
                                                                             ignore_eos=True), use_tqdm=False)]
    loop = server.loop
    loop.peak_in_flight = 0
    got: dict[int, str] = {}
    # The engine's first step waits until every request has been handed to the loop, so that all of them are
    # in flight together whatever the threads' timing (without the gate, how many overlap is up to the OS).
    gate, submitted = threading.Event(), []
    real_submit, real_step = loop.submit, loop.engine.step

    def counting_submit(*args, **kwargs):
        out = real_submit(*args, **kwargs)
        submitted.append(1)
        if len(submitted) == len(prompts):
            gate.set()
        return out

    def gated_step(*args, **kwargs):
        assert gate.wait(timeout=120), "the requests never all reached the engine loop"
        return real_step(*args, **kwargs)

    def one(i: int) -> None:
        status, body = post(server, "/v1/completions", greedy(40, prompt=prompts[i], ignore_eos=True))
        got[i] = body["choices"][0]["text"] if status == 200 else f"HTTP {status}"

    monkeypatch.setattr(loop, "submit", counting_submit)
    monkeypatch.setattr(loop.engine, "step", gated_step)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(prompts))] == want
    assert loop.peak_in_flight == len(prompts)  # all in the engine together, batched by its scheduler


def test_stream_deltas_add_up(server):
    body = greedy(30, prompt="Lily and Ben", stream=True, stream_options={"include_usage": True})
    status, text = post(server, "/v1/completions", body, raw=True)
    chunks = events(text)
    _, whole = post(server, "/v1/completions", greedy(30, prompt="Lily and Ben"))
    assert status == 200
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_n_and_several_prompts_number_their_choices(server, llm):
    prompts = ["Once upon a time", "The cat"]
    status, body = post(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "n": 2, "seed": 5,
                                                    "temperature": 1.0, "max_tokens": 12})
    want = llm.generate(prompts, SamplingParams(n=2, seed=5, temperature=1.0, max_tokens=12), use_tqdm=False)
    assert status == 200
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [c.text for o in want for c in o.outputs]


def test_penalties_and_min_tokens_reach_the_engine(server, llm):
    # Penalties strong enough to change the bundled target's first 20 greedy tokens (0.8/0.4 no longer do).
    body = greedy(20, prompt="Once upon a time", frequency_penalty=1.2, presence_penalty=0.6, ignore_eos=True)
    status, got = post(server, "/v1/completions", body)
    want = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=20, frequency_penalty=1.2,
                                                             presence_penalty=0.6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    plain = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].text
    assert status == 200 and got["choices"][0]["text"] == want != plain
    ending = "Lily and Tom played all day. They were very happy. The end."  # greedy ends it with EOS at once
    status, got = post(server, "/v1/completions", greedy(40, prompt=ending, min_tokens=12))
    want = llm.generate([ending], SamplingParams(temperature=0, max_tokens=40, min_tokens=12), use_tqdm=False)[0]
    assert status == 200 and got["choices"][0]["text"] == want.outputs[0].text
    assert got["usage"]["completion_tokens"] == len(want.outputs[0].token_ids) >= 12
    status, _ = post(server, "/v1/completions", greedy(4, prompt="Hi", presence_penalty=None, frequency_penalty=None))
    assert status == 200  # OpenAI clients send null for "no penalty"
    first = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    status, got = post(server, "/v1/completions", greedy(1, prompt="Once upon a time", logit_bias={str(first): -100},
                                                          logprobs=0))
    assert status == 200 and got["choices"][0]["text"] != llm.get_tokenizer().decode([first])


def test_prompt_logprobs(server, llm):
    body = greedy(4, prompt="Once upon a time there was", prompt_logprobs=2)
    status, got = post(server, "/v1/completions", body)
    want = llm.generate(["Once upon a time there was"], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2),
                        use_tqdm=False)[0].prompt_logprobs
    plp = got["choices"][0]["prompt_logprobs"]
    assert status == 200 and plp[0] is None and len(plp) == len(want)
    for entry, ref in zip(plp[1:], want[1:]):
        assert {int(t): (v["logprob"], v["rank"]) for t, v in entry.items()} == \
            {t: (lp.logprob, lp.rank) for t, lp in ref.items()}
        assert all(v["decoded_token"] for v in entry.values())
    status, text = post(server, "/v1/completions", {**body, "stream": True}, raw=True)
    chunks = [e for e in events(text) if e["choices"]]
    assert status == 200 and chunks[0]["choices"][0]["prompt_logprobs"] == plp
    assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[1:])  # sent once
    status, err = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                         "prompt_logprobs": 1})
    assert status == 400 and err["error"]["param"] == "prompt_logprobs"


def test_logprobs(server):
    status, body = post(server, "/v1/completions", greedy(6, prompt="Once upon a time", logprobs=2))
    lp = body["choices"][0]["logprobs"]
    assert status == 200 and len(lp["tokens"]) == len(lp["token_logprobs"]) == body["usage"]["completion_tokens"]
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    assert all(x <= 0 for x in lp["token_logprobs"]) and all(1 <= len(t) <= 3 for t in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("body,status,param,words", [
    (greedy(8, prompt="Hi", temperature=-1), 400, "temperature", "temperature must be >= 0"),
    (greedy(8, prompt="Hi", tools=[{"type": "function"}]), 400, "tools", "not supported"),
    (greedy(8, prompt="Hi", presence_penalty=3.0), 400, "presence_penalty", "must be a number in [-2, 2]"),
    (greedy(8, prompt="Hi", best_of=2), 400, "best_of", "not supported"),
    (greedy(8, prompt="Hi", logit_bias={"the": 1}), 400, "logit_bias", "keys must be token ids"),
    (greedy(8, prompt="Hi", logit_bias={"5": 300}), 400, "logit_bias", "[-100, 100]"),
    (greedy(8, prompt="Hi", n=0), 400, "n", "SamplingParams.n"),
    (greedy(8, prompt="Hi", stream="yes"), 400, "stream", "true or false"),
    (greedy(8), 400, "prompt", "missing field 'prompt'"),
    (greedy(8, prompt=[]), 400, "prompt", "non-empty"),
    (greedy(8, prompt=[1, 999999]), 400, "prompt", "out of the vocabulary"),
    (greedy(8, prompt="word " * 3000), 400, "prompt", "max_model_len"),
    (greedy(8, prompt="word " * 1100), 400, "prompt", "max_model_len"),  # tokenized, then too long
    (greedy(8, prompt="Hi", logprobs=21), 400, "logprobs", "max_logprobs"),
    ({"prompt": "Hi"}, 400, "model", "missing field 'model'"),
    ({"model": "gpt-4", "prompt": "Hi"}, 404, "model", "not served here"),
])
def test_bad_requests_are_refused_clearly_while_others_run(server, body, status, param, words):
    result: dict = {}
    good = threading.Thread(target=lambda: result.update(ok=post(server, "/v1/completions",
                                                                 greedy(30, prompt="Tom", ignore_eos=True))))
    good.start()
    got, err = post(server, "/v1/completions", body)
    good.join()
    assert got == status and words in err["error"]["message"] and err["error"]["param"] == param
    assert result["ok"][0] == 200 and result["ok"][1]["usage"]["completion_tokens"] == 30


def test_bad_json_and_chat_without_template(server):
    status, err = post(server, "/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in err["error"]["message"]
    status, err = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                     "content": "hi"}]})
    assert status == 400 and "no chat template" in err["error"]["message"]
    status, err = post(server, "/v1/chat/completions", {"model": MODEL, "messages": "hi"})
    assert status == 400 and err["error"]["param"] == "messages"


def test_client_that_leaves_mid_stream_is_aborted(server):
    engine = server.loop.engine
    host, port = server.url.removeprefix("http://").split(":")
    aborted = server.loop.aborted
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(greedy(400, prompt="Once", stream=True, ignore_eos=True)),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    resp.close()  # the client goes away after the first token (the response owns the socket: Connection: close)
    conn.close()
    deadline = time.time() + 30
    while engine.requests and time.time() < deadline:  # the next write fails and the request is aborted
        time.sleep(0.05)
    assert not engine.requests and server.loop.aborted == aborted + 1  # aborted, not run to its 400 tokens
    stats = server.loop.stats()  # read on the engine thread, after the commands queued before it
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_failing_step_fails_the_requests_in_flight_and_the_server_goes_on():
    llm = LLM("tinystories-draft", max_num_seqs=4)
    with start_server(llm, port=0, model_name=MODEL) as srv:
        real_step, calls = llm.engine.step, []

        def broken_once():
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected fault")
            return real_step()

        llm.engine.step = broken_once
        status, err = post(srv, "/v1/completions", greedy(20, prompt="Tom", ignore_eos=True))
        assert status == 500 and "injected fault" in err["error"]["message"]
        status, body = post(srv, "/v1/completions", greedy(5, prompt="Tom"))
        assert status == 200 and body["choices"][0]["text"]
        assert not llm.engine.requests and llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_cli_help(capsys):
    from minifer.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0 and "--port" in capsys.readouterr().out


def cli_server(*args: str):
    """``python -m minifer serve tinystories-draft --port 0 ARGS`` in a subprocess, and its URL once it listens."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "minifer", "serve", "tinystories-draft", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = proc.stdout.readline()
    if not line.startswith("serving http://"):
        proc.kill()
        raise AssertionError((line, proc.stderr.read()))
    return proc, line.split()[1].removesuffix("/v1")


def test_command_line_server_starts_answers_and_stops_on_ctrl_c():
    import signal

    proc, url = cli_server("--served-model-name", "d", "--max-num-seqs", "2")
    try:
        req = urllib.request.Request(url + "/v1/completions", json.dumps(
            {"model": "d", "prompt": "Tom", "max_tokens": 4}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_ends_a_stream_in_progress_with_an_error_event_and_exits_cleanly():
    """A process manager's SIGTERM during a stream: the stream's last event is an error (503, the server is
    shutting down), then ``[DONE]``, and the connection closes; the server exits 0 with no traceback in its log.
    The stream asks for 8 x 1,000 tokens (about 25 s here) and SIGTERM follows its first event."""
    import signal

    proc, url = cli_server("--max-num-seqs", "8", "--max-model-len", "1024")
    try:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tinystories-draft", "prompt": "Tom", "n": 8,
                     "max_tokens": 1000, "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: {")
        proc.send_signal(signal.SIGTERM)
        rest = r.read().decode()  # returns only once the server closed the stream
        chunks = rest.split("\n\n")
        assert chunks[-3:] == [chunks[-3], "data: [DONE]", ""], rest[-500:]
        err = json.loads(chunks[-3].removeprefix("data: "))["error"]
        assert err["code"] == 503 and "shutting down" in err["message"]
        assert proc.wait(timeout=30) == 0
        log = proc.stderr.read()
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


LONG_PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"


@pytest.mark.parametrize("stream", [False, True])
def test_completions_that_end_at_different_steps_all_come_back(server, llm, stream):
    """n=3 on a prompt longer than a block: the siblings start a step after the first completion (they wait for
    its prompt blocks), so the completions finish in different steps; every one must be in the answer."""
    body = {"model": MODEL, "prompt": LONG_PROMPT, "n": 3, "seed": 3, "temperature": 1.0, "max_tokens": 10,
            "ignore_eos": True, "stream": stream}
    want = llm.generate([LONG_PROMPT], SamplingParams(n=3, seed=3, temperature=1.0, max_tokens=10, ignore_eos=True),
                        use_tqdm=False)[0]
    status, got = post(server, "/v1/completions", body, raw=stream)
    assert status == 200
    if stream:
        texts = {}
        for chunk in events(got):
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        assert [texts[i] for i in range(3)] == [c.text for c in want.outputs]
    else:
        assert [c["text"] for c in got["choices"]] == [c.text for c in want.outputs]
        assert got["usage"]["completion_tokens"] == 30


def test_streamed_text_never_includes_a_stop_string_it_later_cuts(server, llm):
    direct = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    stop = "named Lily"  # several tokens: " named", " Lily"; the stream must not send " named" and take it back
    assert stop in direct.outputs[0].text
    status, text = post(server, "/v1/completions", greedy(40, prompt="Once upon a time", stop=[stop], stream=True),
                        raw=True)
    streamed = "".join(c["choices"][0]["text"] for c in events(text))
    _, whole = post(server, "/v1/completions", greedy(40, prompt="Once upon a time", stop=[stop]))
    assert status == 200 and streamed == whole["choices"][0]["text"] == direct.outputs[0].text.split(stop)[0]
    assert whole["choices"][0]["finish_reason"] == "stop"


def test_chat_through_a_template():
    llm = LLM("tinystories-draft", max_num_seqs=4)
    llm.tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                   "{% if add_generation_prompt %}assistant:{% endif %}")
    messages = [{"role": "user", "content": "Tell me about a cat."}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.chat(messages, params)[0].outputs[0].text
    ranked = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    entries, ids = ranked[0].outputs[0].logprobs, ranked[0].outputs[0].token_ids
    with start_server(llm, port=0, model_name=MODEL) as srv:
        body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
        status, got = post(srv, "/v1/chat/completions", body)
        assert status == 200 and got["object"] == "chat.completion"
        assert got["choices"][0]["message"] == {"role": "assistant", "content": want}
        status, text = post(srv, "/v1/chat/completions", {**body, "stream": True}, raw=True)
        chunks = events(text)
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == want
        # OpenAI's chat logprobs: per token its text, logprob and bytes, and the top_logprobs best candidates
        status, got = post(srv, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2})
        content = got["choices"][0]["logprobs"]["content"]
        assert status == 200 and [c["token"] for c in content] == [e[t].decoded_token for e, t in zip(entries, ids)]
        assert all(abs(c["logprob"] - e[t].logprob) < 1e-5 for c, e, t in zip(content, entries, ids))
        assert all(c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 2 for c in content)
        for c in content:  # greedy: each token is its own best candidate, and the list runs best first
            first, second = c["top_logprobs"]
            assert first == {k: c[k] for k in ("token", "logprob", "bytes")} and first["logprob"] >= second["logprob"]
        status, text = post(srv, "/v1/chat/completions", {**body, "logprobs": True, "stream": True}, raw=True)
        streamed = sum((c["choices"][0]["logprobs"]["content"] for c in events(text)), [])
        assert [c["token"] for c in streamed] == [c["token"] for c in content]
        assert all(c["top_logprobs"] == [] for c in streamed)  # top_logprobs omitted: none
        for bad, field in (({"logprobs": 2}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
                           ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
            status, err = post(srv, "/v1/chat/completions", {**body, **bad})
            assert status == 400 and err["error"]["param"] == field


def test_a_step_failing_after_tokens_were_appended_leaves_nothing_behind():
    """The fault hits after every sequence got its token (some finished) but before the step retired them."""
    llm = LLM("tinystories-draft", max_num_seqs=4)
    bm = llm.engine.kv_cache_manager
    real, calls = bm.register_computed, []

    def broken(*args):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected late fault")
        return real(*args)

    bm.register_computed = broken
    with start_server(llm, port=0, model_name=MODEL) as srv:
        results = []
        threads = [threading.Thread(target=lambda m=m: results.append(post(srv, "/v1/completions", greedy(
            m, prompt="Tom", ignore_eos=True)))) for m in (1, 2, 30, 30)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert any(status == 500 and "injected late fault" in body["error"]["message"] for status, body in results)
        status, body = post(srv, "/v1/completions", greedy(5, prompt="Lily"))
        assert status == 200 and body["usage"]["completion_tokens"] == 5
        deadline = time.time() + 10
        while llm.engine.requests and time.time() < deadline:
            time.sleep(0.05)
        assert not llm.engine.requests and not llm.engine.scheduler.running
        assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]
        bm.check_invariants()


def test_shutdown_with_requests_in_flight_answers_them_and_the_engine_is_free_again():
    llm = LLM("tinystories-draft", max_num_seqs=2)
    srv = start_server(llm, port=0, model_name=MODEL)
    result = {}
    t = threading.Thread(target=lambda: result.update(r=post(srv, "/v1/completions", greedy(
        500, prompt="Tom", ignore_eos=True))))
    t.start()
    deadline = time.time() + 10
    while not llm.engine.requests and time.time() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="driven by the thread"):  # the server's thread owns the engine
        llm.generate(["Tom"], SamplingParams(max_tokens=2), use_tqdm=False)
    srv.loop.stop()  # the engine stops first; the HTTP side still answers
    t.join(timeout=30)
    assert result["r"][0] == 503 and "stopped" in result["r"][1]["error"]["message"]
    status, err = post(srv, "/v1/completions", greedy(4, prompt="Tom"))
    assert status == 503 and "stopped" in err["error"]["message"]
    with pytest.raises(urllib.error.HTTPError) as health:  # 503: a load balancer stops sending it traffic
        urllib.request.urlopen(srv.url + "/health")
    assert health.value.code == 503 and json.loads(health.value.read()) == {"status": "down"}
    srv.shutdown()
    assert llm.generate(["Tom"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_client_that_leaves_a_plain_request_is_aborted_too(server):
    engine = server.loop.engine
    host, port = server.url.removeprefix("http://").split(":")
    aborted = server.loop.aborted
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(greedy(400, prompt="Once", ignore_eos=True)),
                 {"Content-Type": "application/json"})
    deadline = time.time() + 10
    while not engine.requests and time.time() < deadline:
        time.sleep(0.01)
    conn.close()  # leaves before the answer
    deadline = time.time() + 30
    while engine.requests and time.time() < deadline:
        time.sleep(0.05)
    assert not engine.requests and server.loop.aborted == aborted + 1


def test_a_burst_of_connections_is_accepted():
    """128 clients connect at the same instant. With socketserver's default backlog of 5, 110 of them were reset
    (Linux resets connections the listen queue had no room for, after the client already sent its request)."""
    llm = LLM("tinystories-draft", max_num_seqs=64)
    statuses: list = []
    with start_server(llm, port=0, model_name=MODEL) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        barrier = threading.Barrier(128)

        def one() -> None:
            try:
                barrier.wait()
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                conn.request("POST", "/v1/completions", json.dumps(greedy(2, prompt="Tom")),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                conn.close()
                statuses.append(resp.status)
            except OSError as e:
                statuses.append(type(e).__name__)

        threads = [threading.Thread(target=one) for _ in range(128)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert statuses == [200] * 128


def test_server_overhead_benchmark_runs_every_mode_to_the_same_text():
    from minifer_course.experiments.server_overhead import MODES, measure
    from minifer.bench.workloads import make_workload

    llm = LLM("tinystories-draft", max_num_seqs=2)
    w = make_workload(4, "fixed:6", "fixed:5", seed=1, vocab_size=llm.model_config.vocab_size)
    r = measure(llm, w, concurrency=2, rounds=1)
    assert r["same_text"] == {m: True for m in MODES}
    assert set(r["throughput_vs_direct"]) == {"http", "http-stream"} and all(
        v > 0 for v in r["throughput_vs_direct"].values())
    assert r["rounds"][0]["http"]["peak_in_flight"] <= 2 and sorted(r["rounds"][0]["order"]) == sorted(MODES)
    assert all(r["rounds"][0][m]["cpu_seconds"] > 0 for m in MODES) and set(r["cpu_vs_direct"]) == set(MODES[1:])


# --- random traffic -------------------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_good = st.fixed_dictionaries({"kind": st.just("good"), "max_tokens": st.integers(1, 12), "n": st.integers(1, 3),
                               "stream": st.booleans(), "words": st.integers(1, 30)})
_bad = st.fixed_dictionaries({"kind": st.just("bad"), "field": st.sampled_from(
    [("temperature", -1), ("top_p", 0), ("n", 0), ("max_tokens", 0), ("logprobs", 50), ("stop", [""])])})
_leave = st.fixed_dictionaries({"kind": st.just("leave"), "n": st.integers(1, 2)})


@pytest.fixture(scope="module")
def small_server():
    llm = LLM("tinystories-draft", max_num_seqs=6, num_kv_blocks=48, block_size=8)
    with start_server(llm, port=0, model_name=MODEL) as srv:
        yield srv


def _act(srv, action: dict) -> tuple[str, object]:
    prompt = " ".join(["Tom"] * action.get("words", 3))
    if action["kind"] == "good":
        body = greedy(action["max_tokens"], prompt=prompt, n=action["n"], ignore_eos=True, stream=action["stream"])
        status, got = post(srv, "/v1/completions", body, raw=action["stream"])
        if status != 200:
            return "good", status
        if action["stream"]:
            tokens = sum(1 for c in events(got) for _ in c["choices"])  # one event per completion per token
            return "good", tokens == action["n"] * action["max_tokens"]
        return "good", got["usage"]["completion_tokens"] == action["n"] * action["max_tokens"]
    if action["kind"] == "bad":
        name, value = action["field"]
        status, err = post(srv, "/v1/completions", greedy(4, prompt=prompt, **{name: value}))
        return "bad", status == 400 and err["error"]["param"] == name
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(greedy(200, prompt=prompt, n=action["n"], stream=True,
                                                              ignore_eos=True)), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.readline()
    resp.close()
    conn.close()
    return "leave", resp.status == 200 and first.startswith(b"data: ")


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(st.one_of(_good, _good, _bad, _leave), min_size=2, max_size=10))
def test_random_concurrent_traffic_loses_nothing(small_server, actions):
    """Good, bad and vanishing clients at once, in a cache too small for all of them (preemption): every good
    request gets all its tokens, every bad one a 400 naming its field, every client that left is aborted, and
    afterwards the engine holds no request and every block is free."""
    results: list = [None] * len(actions)
    aborted = small_server.loop.aborted

    def run(i: int) -> None:
        results[i] = _act(small_server, actions[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(actions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None and r[1] is True for r in results), list(zip(actions, results))
    engine = small_server.loop.engine
    deadline = time.time() + 20
    while engine.requests and time.time() < deadline:
        time.sleep(0.05)
    stats = small_server.loop.stats()  # on the engine thread: after its last request's bookkeeping
    assert not engine.requests and small_server.loop.alive()
    assert small_server.loop.aborted - aborted == sum(1 for a in actions if a["kind"] == "leave")  # one each
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    engine.kv_cache_manager.check_invariants()


def test_server_sweep_streams_every_token_at_each_concurrency():
    from minifer.bench.server_sweep import sweep
    from minifer.bench.workloads import make_workload

    llm = LLM("tinystories-draft", max_num_seqs=2)
    w = make_workload(4, "fixed:6", "fixed:5", seed=1, vocab_size=llm.model_config.vocab_size)
    rows = sweep(llm, w, [1, 2])["concurrency"]
    assert [r["concurrency"] for r in rows] == [1, 2] and all(1 <= r["peak_in_flight"] <= r["concurrency"]
                                                              for r in rows)
    assert all(r["ttft_s"]["count"] == 4 and r["itl_s"]["count"] == 4 * 4 for r in rows)  # 5 tokens: 4 gaps each
    assert all(0 < r["ttft_s"]["p50"] and 0 < r["itl_s"]["p50"] for r in rows)


def test_accepted_connections_are_tcp_sockets_that_asyncio_sets_nodelay_on():
    """asyncio sets TCP_NODELAY only on sockets whose ``proto`` is IPPROTO_TCP; without it each plain answer (head,
    then body) waited 40 ms for the client's delayed ACK."""
    import socket

    from minifer.entrypoints.openai.serve import listening_socket

    with listening_socket("127.0.0.1", 0) as s, socket.create_connection(s.getsockname()) as client:
        conn, _ = s.accept()
        with conn:
            assert conn.proto == socket.IPPROTO_TCP and client.fileno() >= 0


def test_unknown_fields_are_ignored_with_a_warning_as_in_vllm(server, caplog):
    with caplog.at_level("WARNING", logger="minifer.entrypoints.openai.serve"):
        status, body = post(server, "/v1/completions", greedy(3, prompt="Tom", foo=1, client_tag="x"))
    assert status == 200 and body["usage"]["completion_tokens"] <= 3
    assert any("fields ignored" in r.message and "'client_tag', 'foo'" in r.message for r in caplog.records)


def test_ignored_field_names_are_logged_escaped_and_bounded(server, caplog):
    """A field's name is the client's: written as it is, a newline in it would forge a log line of its own, and
    15,000 of them would write a line of a megabyte per request."""
    forged = 'x\nINFO:     127.0.0.1:1 - "GET /admin HTTP/1.1" 200 OK'
    many = {f"field_{i:05d}_{'z' * 50}": 0 for i in range(15_000)}
    with caplog.at_level("WARNING", logger="minifer.entrypoints.openai.serve"):
        for extra in ({forged: 1}, many):
            status, _ = post(server, "/v1/completions", {**greedy(1, prompt="Tom"), **extra})
            assert status == 200
    lines = [r.getMessage() for r in caplog.records if "fields ignored" in r.getMessage()]
    assert len(lines) == 2 and all("\n" not in line and len(line) < 2_000 for line in lines)
    assert "'x\\nINFO:" in lines[0] and lines[1].endswith("and 14990 more")
