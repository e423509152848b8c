"""vLLM's extra routes and flags: /version, /ping, /tokenize and /detokenize (equal to the tokenizer), /tokenizer_info,
/v1/models/{id} and max_model_len, several served names, /openapi.json and /docs, CORS (a 500's too), the command
line's flags (the API key from the environment, a bundled model's chat template by default)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from minifer import LLM
from minifer.entrypoints.openai.serve import make_arg_parser, resolve_chat_template, start_server


@pytest.fixture(scope="module")
def server():
    llm = LLM("tinystories-draft", max_num_seqs=2, max_model_len=128)
    with start_server(llm, port=0, model_name=["a", "b"], chat_template="tinystories",
                      allowed_origins=["https://example.org"]) as srv:
        yield srv


def call(url: str, body=None, headers: dict | None = None, method: str | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            data = r.read()
            return r.status, r.headers, json.loads(data) if r.headers["Content-Type"] == "application/json" else data
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def test_version_and_ping(server):
    from minifer import __version__

    assert call(server.url + "/version")[2] == {"version": __version__}
    assert call(server.url + "/ping")[0] == 200 and call(server.url + "/ping", {})[0] == 200


def test_models_by_name_with_max_model_len(server):
    status, _, got = call(server.url + "/v1/models")
    assert status == 200 and [m["id"] for m in got["data"]] == ["a", "b"]
    assert all(m["max_model_len"] == 128 and m["root"] == "a" for m in got["data"])
    assert call(server.url + "/v1/models/b")[2]["id"] == "b"
    status, _, got = call(server.url + "/v1/models/c")
    assert status == 404 and got["error"]["param"] == "model"
    status, _, got = call(server.url + "/v1/completions", {"model": "b", "prompt": "Tom", "max_tokens": 2})
    assert status == 200 and got["model"] == "b"


def test_tokenize_and_detokenize_match_the_tokenizer(server):
    tok = server.loop.engine.tokenizer
    status, _, got = call(server.url + "/tokenize", {"model": "a", "prompt": "Once upon a time"})
    want = list(tok("Once upon a time")["input_ids"])
    assert status == 200 and got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == 128
    _, _, got = call(server.url + "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False,
                                                "return_token_strs": True})
    assert got["tokens"] == want[1:] and len(got["token_strs"]) == len(want) - 1
    _, _, chat = call(server.url + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert tok.decode(chat["tokens"]) == "<|endoftext|>user: hi\nassistant:"  # the shipped template
    status, _, got = call(server.url + "/detokenize", {"model": "a", "tokens": want})
    assert status == 200 and got["prompt"] == tok.decode(want)
    status, _, got = call(server.url + "/detokenize", {"tokens": [1, 10**9]})
    assert status == 400 and got["error"]["param"] == "tokens"
    status, _, got = call(server.url + "/tokenize", {"prompt": "x" * 10**6})
    assert status == 400 and "characters" in got["error"]["message"]


def test_tokenizer_info_is_the_tokenizers_config(server):
    tok = server.loop.engine.tokenizer
    status, _, got = call(server.url + "/tokenizer_info")
    assert status == 200 and got["tokenizer_class"] == type(tok).__name__
    assert got["model_max_length"] == tok.model_max_length and got["eos_token"] == tok.eos_token
    assert got["chat_template"] == server._pre.tokenizer.chat_template  # the template served, not the tokenizer's
    assert "vocab_file" not in got


def test_cors_follows_the_allowed_origins(server):
    headers = {"Origin": "https://example.org", "Access-Control-Request-Method": "POST"}
    status, h, _ = call(server.url + "/v1/completions", headers=headers, method="OPTIONS")
    assert status == 200 and h["Access-Control-Allow-Origin"] == "https://example.org"
    status, h, _ = call(server.url + "/health", headers={"Origin": "https://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in h


def test_openapi_json_lists_every_route_the_server_documents_and_docs_serve_it(server):
    import re

    from minifer.entrypoints.openai import api_server

    documented = {(method.lower(), path) for method, paths in
                  re.findall(r"^    (GET|POST) +(/[^\s,]*(?:, /[^\s,]*)*)", api_server.__doc__, re.M)
                  for path in paths.split(", ")}
    status, _, spec = call(server.url + "/openapi.json")
    assert status == 200 and {("post", "/detokenize"), ("get", "/v1/models/{model_id}")} <= documented
    in_schema = {(method, path) for path, ops in spec["paths"].items() for method in ops}
    assert documented - {("get", "/openapi.json"), ("get", "/docs")} <= in_schema
    assert set(spec["paths"]) <= {path for _, path in documented}  # and the docstring names every route
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))  # OpenAPI's rule, which FastAPI breaks for a route of several methods
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["model", "messages"] and {"messages", "temperature", "stop"} <= set(body["properties"])
    status, _, page = call(server.url + "/docs")
    assert status == 200 and b"/openapi.json" in page


def test_a_500_carries_cors_headers_and_logs_the_message_escaped(server, monkeypatch, caplog):
    """Starlette answers an unhandled exception outside every middleware, CORS's included: a browser would see a
    network error instead of the 500's body. The message may quote a client, so the log escapes it."""
    def fail():
        raise RuntimeError("from a client:\nINFO: a forged line")

    monkeypatch.setattr(server.metrics, "render", fail)
    with caplog.at_level("ERROR", logger="minifer.entrypoints.openai.serve"):
        status, h, got = call(server.url + "/metrics", headers={"Origin": "https://example.org"})
    assert status == 500 and h["Access-Control-Allow-Origin"] == "https://example.org"
    assert got["error"]["type"] == "InternalServerError" and "a forged line" in got["error"]["message"]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request failed")]
    assert len(logged) == 1 and "'from a client:\\nINFO: a forged line'" in logged[0].splitlines()[0]


def test_chat_templates_resolve_from_a_name_a_file_or_the_text(tmp_path):
    shipped = resolve_chat_template("tinystories")
    assert "add_generation_prompt" in shipped
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert resolve_chat_template(str(tmp_path / "t.jinja")) == "{{ messages[0]['content'] }}"
    assert resolve_chat_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(ValueError, match="neither a file"):
        resolve_chat_template("no-such-template")


def test_the_command_line_takes_vllms_flags():
    args = make_arg_parser().parse_args([
        "m", "--served-model-name", "x", "y", "--max-num-seqs", "3", "--max-num-batched-tokens", "64",
        "--max-logprobs", "5", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
        "--quantization", "int8", "--kv-cache-dtype", "int8", "--chat-template", "tinystories", "--api-key", "k",
        "--allowed-origins", '["https://a"]', "--no-enable-prefix-caching"])
    assert args.served_model_name == ["x", "y"] and args.max_num_seqs == 3 and args.max_num_batched_tokens == 64
    assert args.max_logprobs == 5 and args.speculative_config["num_speculative_tokens"] == 2
    assert args.allowed_origins == ["https://a"] and args.enable_prefix_caching is False


def test_command_line_server_with_an_api_key_from_the_environment_and_the_bundled_template():
    proc = subprocess.Popen([sys.executable, "-m", "minifer", "serve", "tinystories-draft", "--port", "0",
                             "--max-num-seqs", "2", "--max-logprobs", "3", "--uvicorn-log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "MINIFER_API_KEY": "secret"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving http://"), (line, proc.stderr.read() if proc.poll() is not None else "")
        url = line.split()[1].removesuffix("/v1")
        body = {"model": "tinystories-draft", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert call(url + "/v1/chat/completions", body)[0] == 401
        assert call(url + "/tokenizer_info")[0] == 200  # open, as /tokenize is
        status, _, got = call(url + "/v1/chat/completions", body, {"Authorization": "Bearer secret"})
        assert status == 200 and got["usage"]["completion_tokens"] <= 3
        status, _, got = call(url + "/v1/completions", {"model": "tinystories-draft", "prompt": "Tom", "logprobs": 4},
                              {"Authorization": "Bearer secret"})
        assert status == 400 and got["error"]["param"] == "logprobs" and "max_logprobs=3" in got["error"]["message"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        log = proc.stderr.read()  # uvicorn's access log: a line per request, whatever the log level
        assert '"POST /v1/chat/completions HTTP/1.1" 401' in log and '"POST /v1/completions HTTP/1.1" 400' in log
    finally:
        if proc.poll() is None:
            proc.kill()
