"""OpenAI's API, as data: a request body becomes ``SamplingParams`` and prompts, engine outputs become choices.

``minifer.entrypoints`` is the HTTP server and the engine thread; this module is the format between the two, with
vLLM's extensions, so that a client written for OpenAI or ``vllm serve`` works against minifer unchanged:

- requests: ``sampling_params`` (OpenAI's names and defaults, ``null`` meaning the default, every value checked
  and a bad one refused with a ``RequestError`` naming its field), ``completion_prompts`` (a text, token ids, or
  a list of either), ``chat_messages`` (each message's content as text, for the chat template), ``echo_mode``;
- responses: ``logprobs_json`` (completions: tokens, their logprobs, top candidates, text offsets),
  ``chat_logprobs_json`` (chat: per token its text, logprob, bytes and top candidates), ``echoed_choice``
  (a prompt's text and logprobs before its completion), ``prompt_logprobs_json``, ``usage``, ``error_body``;
- ``sse_events``: a client's side of a stream.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from minifer.outputs import CompletionOutput, RequestOutput
from minifer.request import Request
from minifer.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the server refuses: answered with ``status`` and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def check_room(seq: Request, field: str) -> None:
    """Refuse a ``max_tokens`` the client set itself that the context cannot hold after the prompt, with vLLM's
    400. The offline ``LLM`` clips it instead (``Request.max_tokens``: clipped to exactly the room left, so
    a clipped one tells the room), and a default (16 for completions) is clipped here too, as vLLM does."""
    asked, room, n = seq.params.max_tokens, seq.max_tokens, len(seq.prompt_token_ids)
    if asked is not None and asked > room:
        limit = n + room
        raise RequestError(f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum "
                           f"context length is {limit} tokens and your request has {n} input tokens "
                           f"({asked} > {limit} - {n}).", field)


_SAMPLING_FIELDS = {  # OpenAI's name (and vLLM's extensions) -> SamplingParams field
    "n": "n", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "max_tokens": "max_tokens", "min_tokens": "min_tokens", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "seed": "seed",
    "skip_special_tokens": "skip_special_tokens", "logit_bias": "logit_bias", "prompt_logprobs": "prompt_logprobs",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
# Fields minifer accepts only with the value that means "off" (clients often send these defaults): any other value
# asks for something minifer does not do (tools, structured output, beam search, ...), and ignoring it would
# answer a different question than the client asked. None: any value is accepted and has no effect.
_NO_OP_FIELDS = {"best_of": (1, None), "suffix": (None,), "user": None, "metadata": None, "store": (False, None),
                 "service_tier": None, "parallel_tool_calls": None, "tools": (None, []),
                 "tool_choice": (None, "none", "auto"), "functions": (None, []), "function_call": (None, "none", "auto"),
                 "response_format": (None, {"type": "text"}), "guided_json": (None,), "guided_regex": (None,),
                 "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
                 "use_beam_search": (False, None), "length_penalty": (1, 1.0, None), "logits_processors": (None,),
                 "truncate_prompt_tokens": (None,), "prompt_embeds": (None,), "return_tokens_as_token_ids": (False, None),
                 "add_special_tokens": (True, None), "continue_final_message": (False, None),
                 "add_generation_prompt": (True, None), "chat_template": (None,), "chat_template_kwargs": (None,),
                 "documents": (None,), "priority": (0, None), "request_id": None, "modalities": (None, ["text"]),
                 "audio": (None,), "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,)}
# Every field a request may carry; others are ignored with a warning, as vLLM does (clients add fields of their own).
KNOWN_FIELDS = frozenset({"model", "prompt", "messages", "stream", "stream_options", "logprobs", "top_logprobs",
                          "max_completion_tokens", "echo", *_SAMPLING_FIELDS, *_NO_OP_FIELDS})


_INT, _NUM, _BOOL, _STR = ({"type": t} for t in ("integer", "number", "boolean", "string"))
_FIELD_SCHEMAS = {  # OpenAPI's schema of the fields with a type; the no-op fields: their accepted values
    "prompt": {"anyOf": [_STR, {"type": "array", "items": _STR}, {"type": "array", "items": {**_INT, "minimum": 0}}]},
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "user", "assistant"]}, "content": _STR}}},
    "n": {**_INT, "minimum": 1}, "max_tokens": {**_INT, "minimum": 1}, "max_completion_tokens": {**_INT, "minimum": 1},
    "min_tokens": {**_INT, "minimum": 0}, "temperature": {**_NUM, "minimum": 0}, "top_k": _INT, "seed": _INT,
    "top_p": {**_NUM, "exclusiveMinimum": 0, "maximum": 1}, "min_p": {**_NUM, "minimum": 0, "maximum": 1},
    "stop": {"anyOf": [_STR, {"type": "array", "items": _STR}]}, "stop_token_ids": {"type": "array", "items": _INT},
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}}, "top_logprobs": _INT,
    "logit_bias": {"type": "object", "additionalProperties": _NUM}, "prompt_logprobs": {**_INT, "minimum": 0},
    **dict.fromkeys(["stream", "echo", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output"], _BOOL),
    **dict.fromkeys(["presence_penalty", "frequency_penalty", "repetition_penalty"], _NUM),
    **{name: {"enum": list(allowed)} for name, allowed in _NO_OP_FIELDS.items() if allowed is not None}}


def body_schema(fields, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON schema of a request body with ``fields`` (for ``/openapi.json``: clients, Swagger UI, fuzzers);
    a field without a type here takes any value, as the parser checks each itself."""
    return {"type": "object", "properties": {f: _FIELD_SCHEMAS.get(f, {}) for f in fields}, "required": list(required)}


def ignored_fields(body: dict[str, Any]) -> list[str]:
    """The fields of ``body`` that minifer does not know, which it ignores (the server logs them)."""
    return sorted(set(body) - KNOWN_FIELDS)


def loggable(strings: list[str], most: int = 10, chars: int = 80) -> str:
    """Client-chosen strings for a log line: ``ascii`` literals (no newline to forge a line, no terminal escape
    codes), at most ``most`` of them cut at ``chars`` characters, then how many more: a bounded line."""
    shown = [ascii(s[:chars]) + ("..." if len(s) > chars else "") for s in strings[:most]]
    return ", ".join(shown) + (f" and {len(strings) - most} more" if len(strings) > most else "")


DIGITS = re.compile(r"[0-9]+")  # a token id or a Content-Length (int() also takes " 5", "+5", "5_0" and "-3")


def sampling_params(body: dict[str, Any], *, chat: bool, echo: Echo | None = None) -> SamplingParams:
    """``SamplingParams`` from a request body, with OpenAI's defaults (``max_tokens`` 16 for completions, up to
    the context for chat). ``null`` means the default, as OpenAI's clients send it for fields they leave unset.
    Unsupported values are errors that name the field (unknown fields are ignored: ``ignored_fields``). ``echo`` (``echo_mode``'s answer for the
    same body) adds what echoing needs: one generated token for ``max_tokens=0``, and the prompt's logprobs."""
    for name, allowed in _NO_OP_FIELDS.items():
        if name in body and allowed is not None and body[name] not in allowed and body[name] != {}:
            raise RequestError(f"{name}={body[name]!r} is not supported by minifer", name)
    kwargs = {field: body[name] for name, field in _SAMPLING_FIELDS.items() if body.get(name) is not None}
    if isinstance(kwargs.get("logit_bias"), dict):  # JSON object keys are strings: OpenAI sends {"50256": -100}
        kwargs["logit_bias"] = {_token_id_key(t): b for t, b in kwargs["logit_bias"].items()}
    if body.get("max_completion_tokens") is not None:  # OpenAI's newer name; null leaves max_tokens in charge
        kwargs["max_tokens"] = body["max_completion_tokens"]
    kwargs.setdefault("max_tokens", None if chat else 16)
    logprobs = body.get("logprobs")
    if chat and body.get("prompt_logprobs") is not None:
        raise RequestError("prompt_logprobs is not supported on /v1/chat/completions by minifer: use /v1/completions",
                           "prompt_logprobs")
    if chat:
        top = chat_top_logprobs(body)
        if top is not None:
            kwargs["logprobs"] = top
    else:
        if body.get("top_logprobs") is not None:  # chat's field; ignoring it would drop what the client asked for
            raise RequestError("top_logprobs is for /v1/chat/completions; on /v1/completions, logprobs is the number "
                               "of candidates per token", "top_logprobs")
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
    if echo is not None and echo.prompt_only:
        kwargs["max_tokens"] = 1  # the engine always generates; the one token is dropped from the answer
    if echo is not None and logprobs is not None and kwargs.get("prompt_logprobs") is None:
        kwargs["prompt_logprobs"] = logprobs  # the echoed prompt's logprobs, with as many candidates
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        field = str(e).split()[0].removeprefix("SamplingParams.") if str(e).startswith("SamplingParams.") else None
        raise RequestError(str(e), field) from None


def chat_top_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's logprobs, OpenAI's way: ``logprobs`` is a bool, ``top_logprobs`` (0-20) how many candidates per
    token, which needs ``logprobs: true``. Returns the candidates to ask the engine for, or None for none."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise RequestError("logprobs must be true or false on /v1/chat/completions (top_logprobs says how many)",
                           "logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= 20):
        raise RequestError(f"top_logprobs must be an integer in [0, 20], got {top!r}", "top_logprobs")
    if top and not logprobs:  # 0 asks for nothing, with or without logprobs (as vLLM accepts it)
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if logprobs else None


def chat_logprobs_json(c: CompletionOutput, token_ids: list[int], start: int, top: int) -> dict[str, Any] | None:
    """OpenAI's chat ``logprobs`` for ``token_ids`` (``c``'s tokens from index ``start``): per token its text,
    log-probability and UTF-8 bytes, and the ``top`` most likely candidates (the engine also keeps the sampled
    token when it is not among them; OpenAI's list has only the top ones)."""
    if c.logprobs is None:
        return None

    def item(t: int, lp) -> dict[str, Any]:
        text = lp.decoded_token if lp.decoded_token is not None else str(t)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for entry, t in zip(c.logprobs[start : start + len(token_ids)], token_ids):
        best = sorted((lp.rank, -lp.logprob, tid) for tid, lp in entry.items())[:top]  # a tie may add one: k only
        content.append({**item(t, entry[t]), "top_logprobs": [item(tid, entry[tid]) for *_, tid in best]})
    return {"content": content}


def _token_id_key(key: str) -> int:
    """A ``logit_bias`` key: a token id written in plain decimal digits (at most 18: Python's ``int`` refuses
    strings of more than 4,300 digits with a ``ValueError`` of its own, and no vocabulary comes near 10**18)."""
    if not DIGITS.fullmatch(key) or len(key) > 18:
        raise RequestError(f"logit_bias keys must be token ids (at most 18 decimal digits), got {key[:40]!r}",
                           "logit_bias")
    return int(key)


def max_tokens_field(body: dict[str, Any]) -> str | None:
    """The field in which the client set ``max_tokens`` (vLLM: ``max_completion_tokens or max_tokens``), or None
    when it left it to the default: only a limit the client chose is refused when the context cannot hold it."""
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return name
    return None


def bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    """A true/false field (``null`` or absent: ``default``); any other value is refused, never read as truthy."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false", name)
    return value


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """``(stream, include_usage)``. As in vLLM, ``stream_options`` is for streams only."""
    stream = bool_field(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    if not stream:
        raise RequestError("stream_options can only be given when stream is true", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise RequestError(f"unknown field(s) in stream_options: {', '.join(map(repr, unknown))}", "stream_options")
    if options.get("continuous_usage_stats"):
        raise RequestError("stream_options.continuous_usage_stats is not supported by minifer", "stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage must be true or false", "stream_options")
    return stream, bool(include_usage)


def _is_token_ids(p: object) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def completion_prompts(body: dict[str, Any]) -> list[Any]:
    """A completion request's prompts, one choice set each: a text, a list of texts, a list of token ids, or a
    list of lists of token ids (OpenAI's four forms)."""
    if "prompt" not in body:
        raise RequestError("missing field 'prompt'", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return [p]
    if _is_token_ids(p):
        return [{"prompt_token_ids": p}]
    if isinstance(p, list) and p and all(isinstance(t, str) for t in p):
        return list(p)
    if isinstance(p, list) and p and all(_is_token_ids(ids) for ids in p):
        return [{"prompt_token_ids": ids} for ids in p]
    raise RequestError("prompt must be a string, a non-empty list of strings, a non-empty list of token ids, or a "
                       "non-empty list of non-empty lists of token ids", "prompt")


def _message_text(i: int, message: Any) -> str:
    """A chat message's content as text: a string, or OpenAI's list of parts whose text parts vLLM joins with
    newlines (minifer's models read text only)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a string 'role'", "messages")
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"messages[{i}].content must be a string or a list of content parts", "messages")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"messages[{i}].content: only parts {{'type': 'text', 'text': str}} are supported "
                               f"by minifer, got {part!r:.80}", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat request's messages, each with its content as text, for the chat template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': str, 'content': str}", "messages")
    texts = [_message_text(i, m) for i, m in enumerate(messages)]  # each checked to be an object before it is spread
    return [{**m, "content": text} for m, text in zip(messages, texts)]


@dataclass(frozen=True)
class Echo:
    """OpenAI's ``echo`` on /v1/completions: each choice's text, and its logprobs when asked for, begin with its
    prompt's, as scoring harnesses read them (the log-probability of each prompt token given those before it).
    ``prompt_only``: the client set ``max_tokens`` to 0 to score the prompt alone; the engine generates one token
    anyway, which the answer leaves out (finish reason "length", no completion tokens, as in vLLM).
    ``prompt_logprobs``: the client also asked for vLLM's ``prompt_logprobs`` field itself."""

    prompt_only: bool
    prompt_logprobs: bool


def echo_mode(body: dict[str, Any], *, chat: bool) -> Echo | None:
    """The request's ``Echo``, or None without ``echo``; a clear error where it cannot apply."""
    echo = body.get("echo")
    if echo is None or echo is False:
        field = max_tokens_field(body)
        if field is not None and body[field] == 0:
            raise RequestError(f"{field}=0 asks for no completion, which is for echo=true (to score the prompt "
                               f"alone); otherwise it must be an integer >= 1", field)
        return None
    if not isinstance(echo, bool):
        raise RequestError("echo must be true or false", "echo")
    if chat:
        raise RequestError("echo is not supported on /v1/chat/completions by minifer: use /v1/completions", "echo")
    field = max_tokens_field(body)
    return Echo(prompt_only=field is not None and body[field] == 0,
                prompt_logprobs=body.get("prompt_logprobs") is not None)


def _echo_logprobs_json(prompt_ids: list[int], entries: list | None, first_token: str) -> dict[str, Any] | None:
    """The prompt's part of an echoed choice's ``logprobs``: nothing predicts the first token (None, as in
    OpenAI's and vLLM's answers); each later one from ``prompt_logprobs``, its candidates decoded by the engine
    already. Offsets run from 0, the start of the echoed text."""
    if entries is None:
        return None
    first = {"tokens": [first_token], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    return _join_logprobs(first, _logprobs_object(entries[1:], prompt_ids[1:], len(first_token)))


def _join_logprobs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two ``logprobs`` objects one after the other (``b``'s offsets already continue ``a``'s text)."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def echoed_choice(o: RequestOutput, c: CompletionOutput, echo: Echo, decoded: dict[str, str],
                  token_ids: list[int] | None = None, text: str | None = None) -> dict[str, Any]:
    """A completion choice's ``text``, ``logprobs`` and ``finish_reason`` with its prompt echoed in front: of the
    whole completion, or of ``token_ids`` / ``text`` only (a stream's first chunk). ``decoded``: the prompt's
    text and first token, decoded on the request side (``minifer.entrypoints.openai.serving``). As in vLLM, the offsets run over every
    token's text from 0, prompt then completion, so a prompt's BOS token counts there though the text of a text
    prompt, echoed as sent, has none."""
    token_ids = c.token_ids if token_ids is None else token_ids
    text = c.text if text is None else text
    if echo.prompt_only:  # max_tokens=0: the one token the engine generated is not part of the answer
        token_ids, text = [], ""
    logprobs = None
    if c.logprobs is not None:
        logprobs = _echo_logprobs_json(o.prompt_token_ids, o.prompt_logprobs, decoded["first"])
        if token_ids:
            end = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            logprobs = _join_logprobs(logprobs, logprobs_json(c, token_ids, len(c.token_ids) - len(token_ids), end))
    finish = "length" if echo.prompt_only and c.finish_reason is not None else c.finish_reason
    return {"text": decoded["text"] + text, "logprobs": logprobs, "finish_reason": finish}


def logprobs_json(c: CompletionOutput, token_ids: list[int], start: int, text_start: int = 0) -> dict[str, Any] | None:
    """OpenAI's completions ``logprobs`` object for ``token_ids`` (the tokens of ``c`` from index ``start``, whose
    text begins at character ``text_start``). The engine thread decoded every candidate already
    (``Logprob.decoded_token``)."""
    if c.logprobs is None:
        return None
    return _logprobs_object(c.logprobs[start : start + len(token_ids)], token_ids, text_start)


def _logprobs_object(entries: list, token_ids: list[int], text_start: int) -> dict[str, Any]:
    """The ``logprobs`` lists for tokens and their engine entries; offsets a running sum of the tokens' texts."""
    tokens = [e[t].decoded_token or str(t) for e, t in zip(entries, token_ids)]
    return {"tokens": tokens, "token_logprobs": [e[t].logprob for e, t in zip(entries, token_ids)],
            "top_logprobs": [{(lp.decoded_token or str(tid)): lp.logprob for tid, lp in e.items()} for e in entries],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=text_start))
            if tokens else []}


def prompt_logprobs_json(entries) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` in a completion choice: per prompt token, None for the first, else each
    candidate's id (a string, as JSON keys are) -> its logprob, rank and decoded text."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]


def sse_events(text: str) -> list[dict[str, Any]]:
    """A client's side of a stream: the JSON of every ``data:`` event in a server-sent-events body, without the
    closing ``data: [DONE]``."""
    chunks = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    return [json.loads(c) for c in chunks if c != "[DONE]"]


def choice_index(ids: list[str], rid: str, n: int, index: int) -> int:
    """OpenAI numbers the choices of several prompts consecutively: prompt ``p``'s completion ``i`` is ``p*n+i``."""
    return ids.index(rid) * n + index


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


_ERROR_TYPES = {HTTPStatus.NOT_FOUND: "NotFoundError", HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError", HTTPStatus.UNAUTHORIZED: "AuthenticationError",
                HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError", HTTPStatus.NOT_IMPLEMENTED: "NotImplementedError",
                HTTPStatus.REQUEST_TIMEOUT: "RequestTimeoutError", HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE: "RequestHeaderFieldsTooLargeError"}


def error_body(e: RequestError) -> dict[str, Any]:
    """OpenAI's error object: ``{"message", "type", "param", "code"}`` (inside ``{"error": ...}``)."""
    return {"message": str(e), "type": _ERROR_TYPES.get(e.status, "BadRequestError"), "param": e.param,
            "code": int(e.status)}


# The engine's own validation (``LLM.make_sequence``, the scheduler) words its errors "prompt <i>: <field>...":
# the field a refusal is about, for OpenAI's ``param``. Anything else it refuses is about the prompt itself.
_ENGINE_FIELDS = ("logit_bias", "stop_token_ids", "prompt_logprobs", "logprobs", "min_tokens", "max_tokens")
_PROMPT_PREFIX = re.compile(r"prompt \d+: ")


def engine_error_param(message: str, prompt_field: str = "prompt", logprobs_field: str = "logprobs") -> str:
    """The request field an error of the engine's validation is about (``prompt_field``: "prompt" for
    completions, "messages" for chat; ``logprobs_field``: the field that asked for the candidates)."""
    rest = _PROMPT_PREFIX.sub("", message, count=1)
    for name in _ENGINE_FIELDS:
        if rest.startswith(name):
            return logprobs_field if name == "logprobs" else name
    return prompt_field
