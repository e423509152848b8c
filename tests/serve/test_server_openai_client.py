"""The server through the official ``openai`` Python client, as its users call it: completions, chat (through the
shipped template), streams with usage, logprobs, vLLM's extra fields, errors as the client's exceptions with
``param``, and the API key. Oracle: ``LLM.generate`` / ``LLM.chat`` on the same weights."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from minifer import LLM, SamplingParams
from minifer.entrypoints.openai.serve import resolve_chat_template, start_server

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def oracle():
    llm = LLM("tinystories-draft", max_num_seqs=4)
    llm.tokenizer.chat_template = resolve_chat_template("tinystories")
    return llm


@pytest.fixture(scope="module")
def server(oracle):
    served = LLM("tinystories-draft", max_num_seqs=4, share_weights_with=oracle)
    with start_server(served, port=0, model_name=["draft", "tiny"], api_key=KEY, chat_template="tinystories") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_lists_every_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["draft", "tiny"]
    assert models.data[0].max_model_len == 1024  # vLLM's extra field
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_with_logprobs_equals_generate(client, oracle):
    got = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    want = oracle.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                logprobs=2), use_tqdm=False)[0].outputs[0]
    choice = got.choices[0]
    assert choice.text == want.text and choice.finish_reason == "length" and choice.stop_reason is None
    assert got.usage.completion_tokens == 12 and got.model == "tiny"
    assert choice.logprobs.token_logprobs == pytest.approx([e[t].logprob for e, t in zip(want.logprobs,
                                                                                         want.token_ids)], abs=1e-5)
    assert "".join(choice.logprobs.tokens) == want.text


def test_a_stop_string_is_the_stop_reason(client, oracle):
    full = oracle.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=40),
                           use_tqdm=False)[0].outputs[0].text
    stop = full.split()[3]
    got = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0,
                                    stop=[stop])
    assert got.choices[0].finish_reason == "stop" and got.choices[0].stop_reason == stop


def test_streamed_completion_adds_up_and_reports_usage(client):
    whole = client.completions.create(model="tiny", prompt="Tom and Lily", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt="Tom and Lily", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_through_the_shipped_template(client, oracle):
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    want = oracle.chat(messages, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2))[0]
    got = client.chat.completions.create(model="draft", messages=messages, max_tokens=16, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    c = want.outputs[0]
    assert got.choices[0].message.content == c.text and got.choices[0].message.role == "assistant"
    content = got.choices[0].logprobs.content
    assert [x.token for x in content] == [e[t].decoded_token for e, t in zip(c.logprobs, c.token_ids)]
    assert all(len(x.top_logprobs) == 2 for x in content)
    stream = client.chat.completions.create(model="draft", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == c.text


def test_errors_are_the_clients_exceptions_with_param(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="Tom", max_tokens=4, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5, 99999], max_tokens=4)
    assert e.value.param == "prompt" and "out of the vocabulary" in e.value.message  # the engine's own check
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="Tom", max_tokens=4)
    assert e.value.param == "model"


def test_the_api_key_is_required_on_v1(server):
    anonymous = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        anonymous.completions.create(model="tiny", prompt="Tom", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()
    import urllib.request

    with urllib.request.urlopen(server.url + "/health", timeout=30) as r:  # probes stay open, as in vLLM
        assert r.status == 200
