"""Schemathesis against the server's own schema (issue 48's fuzz step, in CI through ``make test``): every
operation ``/openapi.json`` declares gets a fixed number of generated requests, seeded (``derandomize``), valid and
invalid bodies, paths and methods, sent over HTTP to a live server on the bundled draft model; any 5xx fails.

The bodies' schemas are typed (``protocol.body_schema``) and name the served models, so valid cases reach the
engine: at 40 cases per operation a run sends about 1,450 requests (about 200 of them generate), 20 to 60 s on
2 shared cores. Run it alone: ``python -m pytest -p no:randomly tests/serve/test_schemathesis.py``."""

from __future__ import annotations

import json
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from minifer import LLM
from minifer.entrypoints.openai.serve import start_server

CASES_PER_OPERATION = 40


@pytest.fixture(scope="module")
def server():
    llm = LLM("tinystories-draft", max_num_seqs=4, max_model_len=64)
    with start_server(llm, port=0, model_name="tiny", chat_template="tinystories") as srv:
        yield srv


@pytest.fixture(scope="module")
def served_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("served_schema")


@schema.parametrize()
@settings(max_examples=CASES_PER_OPERATION, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_5xx(case):
    case.call_and_validate(checks=[not_a_server_error], timeout=60)


def test_the_schema_declares_typed_bodies_naming_the_served_model(server):
    """Without types and the served names, a fuzzer's every body is refused at ``model`` and none reaches the
    engine."""
    paths = json.loads(urllib.request.urlopen(server.url + "/openapi.json", timeout=60).read())["paths"]
    for path, required in [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]:
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["required"] == ["model", required] and body["properties"]["model"] == {"enum": ["tiny"]}
        assert body["properties"]["max_tokens"]["type"] == "integer"
        assert body["properties"]["best_of"] == {"enum": [1, None]}  # a no-op field: the values it accepts
    assert "prompt_logprobs" not in paths["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]  # refused on chat, so not declared there
