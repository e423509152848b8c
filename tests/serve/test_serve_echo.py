"""OpenAI's ``echo`` on /v1/completions, the form scoring harnesses use (``echo=true, logprobs=k``, often with
``max_tokens`` 0 or 1): each choice's text and logprobs begin with its prompt's. Oracle: ``LLM.generate`` with
``prompt_logprobs`` (itself checked against transformers in test_prompt_logprobs.py) and plain completions."""

from __future__ import annotations

import math

import pytest

from minifer import SamplingParams

from test_serve import MODEL, events, llm, server  # noqa: F401 - the served model and its oracle (fixtures)
from test_serve import post as _post

PROMPT = "Once upon a time, Tom"


def post(server, body, raw=False):
    return _post(server, "/v1/completions", {"model": MODEL, **body}, raw)


def oracle(llm, prompt, max_tokens, k):
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k, prompt_logprobs=k),
                       use_tqdm=False)[0]
    return out, out.outputs[0]


def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion(server, llm):
    status, got = post(server, {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2})
    assert status == 200
    out, c = oracle(llm, PROMPT, 4, 2)
    choice = got["choices"][0]
    assert choice["text"] == PROMPT + c.text and choice["finish_reason"] == c.finish_reason
    lp = choice["logprobs"]
    ids = out.prompt_token_ids + c.token_ids
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    tok = llm.get_tokenizer()
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    want = [None] + [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])] + [
        e[t].logprob for e, t in zip(c.logprobs, c.token_ids)]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(lp["token_logprobs"][1:], want[1:]))
    assert all(2 <= len(top) <= 3 for top in lp["top_logprobs"][1:])  # k candidates and the token itself
    # offsets run over every token's text from 0, prompt then completion (vLLM's rule)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    assert "prompt_logprobs" not in choice  # asked for through echo, not as vLLM's own field
    assert got["usage"] == {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(c.token_ids),
                            "total_tokens": len(ids)}


def test_max_tokens_0_scores_the_prompt_alone(server, llm):
    """A harness's loglikelihood: the sum of the continuation's token logprobs, read off the echoed prompt."""
    context, continuation = "Once upon a time, there was a little", " girl named Lily"
    status, got = post(server, {"prompt": context + continuation, "max_tokens": 0, "echo": True, "logprobs": 1,
                                "n": 2})
    assert status == 200 and len(got["choices"]) == 2
    out, _ = oracle(llm, context + continuation, 1, 1)
    for choice in got["choices"]:
        assert choice["text"] == context + continuation and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(out.prompt_token_ids)
    assert got["usage"]["completion_tokens"] == 0
    n_ctx = len(llm.get_tokenizer()(context)["input_ids"])
    served = sum(got["choices"][0]["logprobs"]["token_logprobs"][n_ctx:])
    want = sum(e[t].logprob for e, t in zip(out.prompt_logprobs[n_ctx:], out.prompt_token_ids[n_ctx:]))
    assert math.isclose(served, want, abs_tol=1e-4)


@pytest.mark.parametrize("prompt, max_tokens, stop, echo", [
    ([0, 419, 436, 259], 0, None, True), ([0, 419, 436, 259], 5, None, True), ([0, 419, 436, 259], 5, None, False),
    ("Once upon a", 24, ["girl", " named"], True), ("Once upon a", 24, ["girl", " named"], False)])
def test_a_streamed_answer_adds_up_to_the_plain_one(server, prompt, max_tokens, stop, echo):
    """The stream's text, tokens, logprobs and offsets add up to the plain answer's: the offsets run over the
    tokens' texts in both, whatever text a chunk held back for a stop string, and a text prompt echoed as sent
    (without the BOS token that its logprobs list) changes nothing."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "echo": echo, "logprobs": 1, "stop": stop}
    _, plain = post(server, body)
    status, text = post(server, {**body, "stream": True}, raw=True)
    chunks = [e["choices"][0] for e in events(text)]
    assert status == 200
    if echo and isinstance(prompt, list):
        assert chunks[0]["text"].startswith("<|endoftext|>Once upon a")  # token ids decode, BOS too
    want = plain["choices"][0]
    assert "".join(ch["text"] for ch in chunks) == want["text"]
    assert chunks[-1]["finish_reason"] == want["finish_reason"] == ("stop" if stop else "length")
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert sum((ch["logprobs"][key] for ch in chunks if ch["logprobs"]), []) == want["logprobs"][key]


def test_chat_top_logprobs_lists_k_candidates_even_with_ties():
    """The engine keeps the sampled token beside the k best; a tie with the k-th gives it rank <= k too."""
    from minifer.outputs import CompletionOutput
    from minifer.sampling_params import Logprob
    from minifer.entrypoints.openai.protocol import chat_logprobs_json

    entry = {5: Logprob(-1.0, 1, "a"), 7: Logprob(-1.0, 1, "b"), 9: Logprob(-1.0, 1, "c")}  # 9 was sampled
    c = CompletionOutput(0, "c", [9], None, [entry])
    content = chat_logprobs_json(c, [9], 0, 2)["content"]
    assert content[0]["token"] == "c" and len(content[0]["top_logprobs"]) == 2


def test_echo_without_logprobs_and_with_prompt_logprobs(server):
    _, got = post(server, {"prompt": "Tom", "max_tokens": 3, "temperature": 0, "echo": True})
    _, plain = post(server, {"prompt": "Tom", "max_tokens": 3, "temperature": 0})
    assert got["choices"][0]["text"] == "Tom" + plain["choices"][0]["text"]
    assert got["choices"][0]["logprobs"] is None
    _, got = post(server, {"prompt": "Tom", "max_tokens": 3, "echo": True, "prompt_logprobs": 1})
    assert len(got["choices"][0]["prompt_logprobs"]) == 2  # asked for as vLLM's field: it comes too


@pytest.mark.parametrize("path, body, field, words", [
    ("/v1/completions", {"prompt": "Tom", "echo": "yes"}, "echo", "echo must be true or false"),
    ("/v1/completions", {"prompt": "Tom", "max_tokens": 0}, "max_tokens", "is for echo=true"),
    ("/v1/completions", {"prompt": "Tom", "max_completion_tokens": 0, "echo": False}, "max_completion_tokens",
     "is for echo=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo",
     "not supported on /v1/chat/completions"),
    ("/v1/completions", {"prompt": "Tom", "logprobs": 2, "top_logprobs": 2}, "top_logprobs",
     "top_logprobs is for /v1/chat/completions"),
])
def test_echo_and_logprobs_errors_name_the_field(server, path, body, field, words):
    status, got = _post(server, path, {"model": MODEL, **body})
    assert status == 400 and got["error"]["param"] == field and words in got["error"]["message"]


@pytest.mark.parametrize("ids", [[-1], [10**12], [2**64]])
def test_echoed_token_ids_out_of_the_vocabulary_are_the_engines_400(server, ids):
    for stream in (False, True):
        status, got = post(server, {"prompt": ids, "echo": True, "max_tokens": 2, "stream": stream})
        assert status == 400 and "out of the vocabulary" in got["error"]["message"], got
