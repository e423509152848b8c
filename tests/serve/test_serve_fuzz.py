"""Any JSON value in any field of a request body is answered, never a 500: arbitrary values (hypothesis,
derandomized, a fixed number of cases per field) at every field of completion and chat bodies, at every level of
a chat message, and at the fields of /tokenize and /detokenize, go through the request side's parser
(``Preprocessor``: what the server runs before anything reaches the engine), which must either accept the body or
refuse it with a ``RequestError`` below 500. Two bodies are also sent over HTTP, as a client sends them."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minifer import LLM
from minifer.entrypoints.openai.protocol import KNOWN_FIELDS, RequestError
from minifer.entrypoints.openai.serve import start_server
from minifer.entrypoints.openai.serving import Preprocessor

MODEL = "tiny"
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
BASES = {"completion": {"model": MODEL, "prompt": "Tom", "max_tokens": 2},
         "chat": {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
         "tokenize": {"model": MODEL, "messages": MESSAGES}, "tokenize-prompt": {"model": MODEL, "prompt": "Tom"},
         "detokenize": {"model": MODEL, "tokens": [1, 2]}}
MESSAGE_PATHS = [("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
                 ("messages", 0, "content", 0), ("messages", 0, "content", 0, "text"), ("messages", 0, "name")]
WHERE = list(dict.fromkeys(  # (route, where in its body): each place once
    [(route, (f,)) for route in ("completion", "chat") for f in sorted(KNOWN_FIELDS)]
    + [(route, p) for route in ("chat", "tokenize") for p in MESSAGE_PATHS]
    + [("tokenize-prompt", (f,)) for f in ("model", "prompt", "add_special_tokens", "return_token_strs")]
    + [("detokenize", (f,)) for f in ("model", "tokens")]))

_scalars = (st.none() | st.booleans() | st.integers() | st.sampled_from([2**64, -(10**400), 10**400])
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8))
JSON = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


@pytest.fixture(scope="module")
def pre():
    llm = LLM("tinystories-draft", max_num_seqs=4, max_model_len=64)
    pre = Preprocessor(llm, [MODEL], chat_template=TEMPLATE)
    yield pre
    pre.close()


def with_value(base: dict, path: tuple, value) -> bytes:
    body = copy.deepcopy(base)
    where = body
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    return json.dumps(body).encode()


def run(pre: Preprocessor, route: str, raw: bytes):
    if route in ("completion", "chat"):
        return pre.completion(raw, route == "chat", "r", 0.0)
    return pre.detokenize(raw) if route == "detokenize" else pre.tokenize(raw)


@pytest.mark.parametrize("route, path", WHERE, ids=[f"{r}:{'.'.join(map(str, p))}" for r, p in WHERE])
def test_any_json_value_in_any_field_is_accepted_or_refused_below_500(pre, route, path):
    @settings(max_examples=25, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(value=JSON)
    def check(value):
        raw = with_value(BASES[route], path, value)
        try:
            run(pre, route, raw)
        except RequestError as e:
            assert int(e.status) < 500, raw[:300]

    check()


@pytest.mark.parametrize("route, field, value", [("completion", "model", 5), ("chat", "model", ["tiny"]),
                                                  ("tokenize-prompt", "return_token_strs", "no"),
                                                  ("tokenize-prompt", "add_special_tokens", 0)])
def test_a_value_of_the_wrong_type_is_refused_not_read_as_truthy_or_as_a_name(pre, route, field, value):
    with pytest.raises(RequestError) as e:
        run(pre, route, with_value(BASES[route], (field,), value))
    assert e.value.status == 400 and e.value.param == field


@pytest.fixture(scope="module")
def server():
    llm = LLM("tinystories-draft", max_num_seqs=2, max_model_len=64)
    with start_server(llm, port=0, model_name=MODEL, chat_template=TEMPLATE) as srv:
        yield srv


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": ["hi"]}),
    ("/tokenize", {"messages": [[None, None]]}),
])
def test_a_message_that_is_not_an_object_is_a_400_naming_it(server, path, body):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and err["param"] == "messages" and "messages[0] must be an object" in err["message"]
