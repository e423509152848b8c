"""An OpenAI-compatible HTTP server over ``LLMEngine``: ``python -m minifer serve MODEL --port 8000``.

The online engine (``LLMEngine``: ``add_request`` / ``step`` / ``abort_request``) is what a server needs; this
module puts it behind the routes that OpenAI clients, ``curl`` and benchmark tools speak, with vLLM's names
and extensions (``top_k``, ``min_p``, ``ignore_eos``, ``min_tokens``, ``prompt_logprobs``, ...), so a client moves
between minifer and ``vllm serve`` unchanged:

    GET  /health                  200 when the engine loop is alive
    GET  /v1/models               the one served model
    POST /v1/completions          prompt (a text, token ids, or a list of either) -> choices, usage; SSE if "stream"
    POST /v1/chat/completions     messages through the tokenizer's chat template (Qwen3 / Llama-3 instruct)

``echo`` (with ``logprobs``, and ``max_tokens`` 0 to score the prompt alone) returns each prompt's text and
token log-probabilities before its completion, as evaluation harnesses ask an OpenAI-style server for them.
Chat answers carry OpenAI's chat ``logprobs`` (``logprobs: true``, ``top_logprobs: k``).

Two threads matter. The engine is not thread-safe, so one thread (``EngineLoop``) owns it: HTTP handlers hand
it requests and aborts through a queue, and it applies them between steps, steps while anything is unfinished,
and puts each output on the queue of the HTTP request that asked for it. The HTTP side is the standard
library's ``ThreadingHTTPServer`` (a thread per connection, no dependencies): a handler validates, submits,
and waits on its queue. Continuous batching happens in the engine thread: concurrent HTTP requests share its
steps.

Failure stays local. A request with a bad field is answered 400 with a message naming the field, before it
reaches the engine (or by the engine's own validation); a client that disconnects mid-stream has its request
aborted and its KV blocks freed; an exception inside a step fails the requests in flight with a 500 and the
loop goes on serving new ones. Since a step samples the whole batch, one request's bad value would fail every
request in it: ``SamplingParams`` therefore refuses every value that could break a step (types included), and
an explicit ``max_tokens`` the context cannot hold is a 400 as in vLLM (the offline ``LLM`` clips it).
"""

from __future__ import annotations

import itertools
import json
import queue
import re
import select
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from minifer.engine.sequence import Sequence, sequences_of
from minifer.loader import chat_token_ids
from minifer.outputs import CompletionOutput, RequestOutput
from minifer.sampling import SamplingParams

_DONE = object()  # an HTTP request's queue gets this once none of its engine requests will report again
MAX_BODY_BYTES = 16 * 2**20
# Completions per HTTP request (n times the prompts): the engine thread, which serves every client, creates them
# all at once, so a request for 100,000 would stall everyone else (offline, LLM.generate has no such limit).
MAX_COMPLETIONS_PER_REQUEST = 256
POLL_S = 0.25  # how often a waiting handler checks that its client and the engine loop are still there


class RequestError(ValueError):
    """A request the server refuses: answered with ``status`` and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.param, self.status = param, status


# --- the engine thread -----------------------------------------------------------------------------------


class EngineLoop:
    """Owns an ``LLMEngine`` on one thread. ``submit`` queues engine requests whose outputs (``RequestOutput``s,
    an ``Exception`` if the engine refused or failed one, then ``_DONE``) go to one ``queue.Queue``.

    Everything that touches the engine or its tokenizer runs on this thread, prompts included: a prompt may be a
    callable (a chat template to apply) that is called here. A fast tokenizer shared between threads can fail
    ("Already borrowed") when one thread encodes while another changes its settings."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        # engine request id -> (its HTTP request's queue, the ids of that HTTP request, whether it streams)
        self._routes: dict[str, tuple[queue.Queue, list[str], bool]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minifer-engine", daemon=True)
        self.steps = 0
        self.aborted = 0  # engine requests aborted because their client went away
        self.peak_in_flight = 0  # most unfinished engine requests at once so far (the batching traffic allowed)

    def start(self) -> "EngineLoop":
        self.engine.owner = self._thread  # from now on other threads get a clear error if they step it
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=30)

    def submit(self, requests: list[tuple[str, Any, SamplingParams]], stream: bool = True,
               max_tokens_field: str | None = None) -> queue.Queue:
        """Queue engine requests ``(id, prompt, params)``. ``stream=False``: only the outputs in which a completion
        finished are delivered (a plain answer needs nothing else), so its handler thread wakes once per
        completion (and every ``POLL_S`` to check its client) instead of at every step, competing less with the
        engine thread for the interpreter lock. ``max_tokens_field``: the field in which the client set
        ``max_tokens`` itself (None: a default), which must then fit in the context (``check_room``)."""
        out: queue.Queue = queue.Queue()
        if self._stop.is_set() or not self.alive():
            out.put(RuntimeError("the engine loop has stopped"))
            out.put(_DONE)
        else:
            self._commands.put(("add", (requests, stream, max_tokens_field), out))
        return out

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", request_ids, None))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._iteration()
                except Exception as e:  # noqa: BLE001 - whatever went wrong, fail what was in flight and go on
                    traceback.print_exc()
                    self._fail_all(RuntimeError(f"engine failed: {type(e).__name__}: {e}"))
        finally:  # stopped: nobody may wait for this loop any more
            self._stop.set()
            self._fail_all(RuntimeError("the engine loop has stopped"))
            self.engine.owner = None
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd is not None and cmd[0] == "add":  # ("add", (requests, stream, max_tokens_field), out)
                    cmd[2].put(RuntimeError("the engine loop has stopped"))
                    cmd[2].put(_DONE)

    def _iteration(self) -> None:
        busy = self.engine.has_unfinished_requests()
        try:  # idle: sleep until a command arrives; busy: take what is queued, then step
            cmd = self._commands.get_nowait() if busy else self._commands.get()
        except queue.Empty:
            cmd = None
        while cmd is not None:
            self._apply(*cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                cmd = None
        self.peak_in_flight = max(self.peak_in_flight, len(self.engine.requests))
        if self.engine.has_unfinished_requests():
            self._step()

    def _apply(self, kind: str, items: list, out: queue.Queue | None) -> None:
        if kind == "abort":
            for rid in items:
                if rid in self.engine.requests:
                    self.engine.abort_request(rid)
                    self.aborted += 1
                self._finish(rid)
            return
        assert out is not None
        items, stream, max_tokens_field = items
        added: list[str] = []
        try:
            for i, (rid, prompt, params) in enumerate(items):
                request = self.engine.add_request(rid, prompt() if callable(prompt) else prompt, params,
                                                  prompt_index=i)
                added.append(rid)
                if max_tokens_field is not None:
                    check_room(sequences_of(request)[0], max_tokens_field)
        except Exception as e:  # noqa: BLE001 - nothing of this HTTP request runs, the others are untouched
            for rid in added:
                self.engine.abort_request(rid)
            refused = isinstance(e, (ValueError, TypeError)) and not isinstance(e, RequestError)
            out.put(RequestError(str(e)) if refused else e)  # the engine's validation: 400; anything else: 500
            out.put(_DONE)
            return
        ids = [rid for rid, _, _ in items]
        for rid in ids:
            self._routes[rid] = (out, ids, stream)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - a bug in a step must not stop the server: fail what was in flight
            traceback.print_exc()
            self._fail_all(RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        self.steps += 1
        for o in outputs:
            route = self._routes.get(o.request_id)
            if route is None:
                continue
            if route[2] or o.finished or any(c.finished() for c in o.outputs):
                route[0].put(o)
            if o.finished:
                self._finish(o.request_id)

    def _fail_all(self, error: Exception) -> None:
        """Abort every request in flight (finished-but-unretired ones too: a step may fail half-way) and tell
        their HTTP requests; a request the engine cannot even abort is still reported."""
        for rid in list(self._routes):
            try:
                if rid in self.engine.requests:
                    self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            out = self._routes[rid][0]
            out.put(error)
            self._finish(rid)

    def _finish(self, rid: str) -> None:
        """Forget an engine request; its HTTP request's queue is closed once all its siblings are done."""
        route = self._routes.pop(rid, None)
        if route is not None and not any(s in self._routes for s in route[1]):
            route[0].put(_DONE)


def check_room(seq: Sequence, field: str) -> None:
    """Refuse a ``max_tokens`` the client set itself that the context cannot hold after the prompt, with vLLM's
    400. The offline ``LLM`` clips it instead (``Sequence.max_tokens``: clipped to exactly the room left, so
    a clipped one tells the room), and a default (16 for completions) is clipped here too, as vLLM does."""
    asked, room, n = seq.params.max_tokens, seq.max_tokens, len(seq.prompt_token_ids)
    if asked is not None and asked > room:
        limit = n + room
        raise RequestError(f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum "
                           f"context length is {limit} tokens and your request has {n} input tokens "
                           f"({asked} > {limit} - {n}).", field)


# --- the OpenAI request format -------------------------------------------------------------------------

_SAMPLING_FIELDS = {  # OpenAI's name (and vLLM's extensions) -> SamplingParams field
    "n": "n", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "max_tokens": "max_tokens", "min_tokens": "min_tokens", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "seed": "seed",
    "skip_special_tokens": "skip_special_tokens", "logit_bias": "logit_bias", "prompt_logprobs": "prompt_logprobs",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
# Fields minifer accepts only with the value that means "off" (clients often send these defaults).
_NO_OP_FIELDS = {"best_of": (1, None), "suffix": (None,), "user": None}
_DIGITS = re.compile(r"[0-9]+")  # a token id or a Content-Length (int() also takes " 5", "+5", "5_0" and "-3")
_HEX = re.compile(rb"[0-9A-Fa-f]+")  # a chunk size (int(x, 16) would also take "-5", "0x5" and "5_0")
_ROUTES = {"GET": ("/health", "/v1/models"), "POST": ("/v1/completions", "/v1/chat/completions")}


def sampling_params(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    """``SamplingParams`` from a request body, with OpenAI's defaults (``max_tokens`` 16 for completions, up to
    the context for chat). ``null`` means the default, as OpenAI's clients send it for fields they leave unset.
    Unknown fields and unsupported values are errors that name the field."""
    known = {"model", "prompt", "messages", "stream", "stream_options", "logprobs", "top_logprobs",
             "max_completion_tokens", "echo", *_SAMPLING_FIELDS, *_NO_OP_FIELDS}
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(map(repr, unknown))}", unknown[0])
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
        top = _chat_top_logprobs(body)
        if top is not None:
            kwargs["logprobs"] = top
    elif logprobs is not None:
        kwargs["logprobs"] = logprobs
    echo = echo_mode(body, chat=chat)
    if echo is not None and echo.prompt_only:
        kwargs["max_tokens"] = 1  # the engine always generates; the one token is dropped from the answer
    if echo is not None and logprobs is not None and kwargs.get("prompt_logprobs") is None:
        kwargs["prompt_logprobs"] = logprobs  # the echoed prompt's logprobs, with as many candidates
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        field = str(e).split()[0].removeprefix("SamplingParams.") if str(e).startswith("SamplingParams.") else None
        raise RequestError(str(e), field) from None


def _chat_top_logprobs(body: dict[str, Any]) -> int | None:
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


def _chat_logprobs_json(c: CompletionOutput, token_ids: list[int], start: int, top: int) -> dict[str, Any] | None:
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
    """A ``logit_bias`` key: a token id written in plain decimal digits."""
    if not _DIGITS.fullmatch(key):
        raise RequestError(f"logit_bias keys must be token ids (decimal digits), got {key!r}", "logit_bias")
    return int(key)


def max_tokens_field(body: dict[str, Any]) -> str | None:
    """The field in which the client set ``max_tokens`` (vLLM: ``max_completion_tokens or max_tokens``), or None
    when it left it to the default: only a limit the client chose is refused when the context cannot hold it."""
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return name
    return None


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """``(stream, include_usage)``. As in vLLM, ``stream_options`` is for streams only."""
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream")
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


def _prompts(body: dict[str, Any]) -> list[Any]:
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


def _chat_prompt(body: dict[str, Any], tokenizer):
    """A chat request's prompt, as a function for the engine thread to call (it owns the tokenizer)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': str, 'content': str}", "messages")
    messages = [{**m, "content": _message_text(i, m)} for i, m in enumerate(messages)]
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template: use /v1/completions", "messages")

    def encode() -> dict[str, list[int]]:
        try:
            return {"prompt_token_ids": chat_token_ids(tokenizer, messages)}
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages (jinja raises its own)
            raise RequestError(f"the chat template failed on these messages: {e}", "messages") from None

    return encode


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
    thread already. Offsets run from 0, the start of the echoed text."""
    if entries is None:
        return None
    tokens = [first_token] + [e[t].decoded_token or str(t) for e, t in zip(entries[1:], prompt_ids[1:])]
    return {"tokens": tokens,
            "token_logprobs": [None] + [e[t].logprob for e, t in zip(entries[1:], prompt_ids[1:])],
            "top_logprobs": [None] + [{(lp.decoded_token or str(tid)): lp.logprob for tid, lp in e.items()}
                                      for e in entries[1:]],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))}


def _echo_prompt(prompt: Any, tokenizer, slot: dict[str, str]):
    """A completion prompt as a function for the engine thread to call (it owns the tokenizer), which also
    leaves in ``slot`` what echoing needs decoded: the prompt's ``text`` (a text prompt as sent, token ids
    decoded, BOS included, as vLLM echoes them) and its ``first`` token's text (the one no logprob covers)."""
    def encode() -> Any:
        if tokenizer is None:  # the engine names the problem with a text prompt; token ids echo as numbers
            ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else []
            slot.update(text=prompt if isinstance(prompt, str) else "", first=str(ids[0]) if ids else "")
            return prompt
        ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else list(tokenizer(prompt)["input_ids"])
        slot.update(text=prompt if isinstance(prompt, str) else "", first=str(ids[0]) if ids else "")
        try:
            slot.update(text=prompt if isinstance(prompt, str) else tokenizer.decode(ids),
                        first=tokenizer.decode(ids[:1]))
        except (OverflowError, TypeError, ValueError):  # ids out of range: the engine refuses them, naming them
            pass
        return prompt

    return encode


def _join_logprobs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two ``logprobs`` objects one after the other (``b``'s offsets already continue ``a``'s text)."""
    if a is None or b is None:
        return a or b
    return {k: a[k] + b[k] for k in a}


def _echoed(o: RequestOutput, c: CompletionOutput, echo: Echo, decoded: dict[str, str],
            token_ids: list[int] | None = None, text: str | None = None) -> dict[str, Any]:
    """A completion choice's ``text``, ``logprobs`` and ``finish_reason`` with its prompt echoed in front: of the
    whole completion, or of ``token_ids`` / ``text`` only (a stream's first chunk). ``decoded``: the prompt's
    text and first token, from the engine thread (``_echo_prompt``). As in vLLM, the offsets run over every
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
            logprobs = _join_logprobs(logprobs, _logprobs_json(c, token_ids, len(c.token_ids) - len(token_ids), end))
    finish = "length" if echo.prompt_only and c.finish_reason is not None else c.finish_reason
    return {"text": decoded["text"] + text, "logprobs": logprobs, "finish_reason": finish}


def _logprobs_json(c: CompletionOutput, token_ids: list[int], start: int, text_start: int = 0
                   ) -> dict[str, Any] | None:
    """OpenAI's completions ``logprobs`` object for ``token_ids`` (the tokens of ``c`` from index ``start``, whose
    text begins at character ``text_start``). The engine thread decoded every candidate already
    (``Logprob.decoded_token``)."""
    if c.logprobs is None:
        return None
    entries = c.logprobs[start : start + len(token_ids)]
    tokens = [e[t].decoded_token or str(t) for e, t in zip(entries, token_ids)]
    offsets, at = [], text_start
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [e[t].logprob for e, t in zip(entries, token_ids)],
            "top_logprobs": [{(lp.decoded_token or str(tid)): lp.logprob for tid, lp in e.items()} for e in entries],
            "text_offset": offsets}


def _prompt_logprobs_json(entries) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs`` in a completion choice: per prompt token, None for the first, else each
    candidate's id (a string, as JSON keys are) -> its logprob, rank and decoded text."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]


# --- HTTP -----------------------------------------------------------------------------------------------


@dataclass
class ServerState:
    loop: EngineLoop
    model_name: str
    tokenizer: Any
    created: int


class Handler(BaseHTTPRequestHandler):
    """One HTTP request: parse, validate, submit to the engine loop, answer (JSON or server-sent events)."""

    server_version = "minifer"
    protocol_version = "HTTP/1.1"
    state: ServerState  # set on the subclass ``make_server`` builds

    def log_message(self, format: str, *args: Any) -> None:  # quiet by default: notebooks and tests read stdout
        pass

    # routes
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self._route("GET")
        if path == "/health":
            ok = self.state.loop.alive()
            self._json(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, {"status": "ok" if ok else "down"})
        elif path == "/v1/models":
            model = {"id": self.state.model_name, "object": "model", "created": self.state.created,
                     "owned_by": "minifer"}
            self._json(HTTPStatus.OK, {"object": "list", "data": [model]})

    def do_POST(self) -> None:  # noqa: N802
        path = self._route("POST")
        if path is None:
            return
        chat = path == "/v1/chat/completions"
        try:
            body = self._body()
            if "model" not in body:
                raise RequestError("missing field 'model'", "model")
            if body["model"] != self.state.model_name:
                raise RequestError(f"model {body.get('model')!r} is not served here; this server serves "
                                   f"{self.state.model_name!r}", "model", HTTPStatus.NOT_FOUND)
            params = sampling_params(body, chat=chat)
            echo = echo_mode(body, chat=chat)
            prompts = [_chat_prompt(body, self.state.tokenizer)] if chat else _prompts(body)
            if params.n * len(prompts) > MAX_COMPLETIONS_PER_REQUEST:
                raise RequestError(f"n={params.n} for {len(prompts)} prompt(s) asks for {params.n * len(prompts)} "
                                   f"completions; this server makes at most {MAX_COMPLETIONS_PER_REQUEST} per request",
                                   "n")
            stream, include_usage = _stream_flags(body)
        except RequestError as e:
            self._error(e)
            return
        prefix = "chatcmpl-" if chat else "cmpl-"
        request_id = prefix + uuid.uuid4().hex[:24]
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        echoed: dict[str, dict[str, str]] = {rid: {} for rid in ids} if echo is not None else {}
        if echo is not None:
            prompts = [_echo_prompt(p, self.state.tokenizer, echoed[rid]) for rid, p in zip(ids, prompts)]
        out = self.state.loop.submit([(rid, p, params) for rid, p in zip(ids, prompts)], stream=stream,
                                     max_tokens_field=max_tokens_field(body))
        if stream:
            self._stream(out, request_id, ids, params.n, chat, include_usage, echo, echoed, params.logprobs or 0)
        else:
            self._respond(out, request_id, ids, params.n, chat, echo, echoed, params.logprobs or 0)

    def _route(self, method: str) -> str | None:
        """The request's path without its query string, if ``method`` serves it; else None, answered already:
        404 for no route, 405 (with ``Allow``) for a route of the other method."""
        path = urlsplit(self.path).path
        if path in _ROUTES[method]:
            return path
        other = next((m for m, paths in _ROUTES.items() if m != method and path in paths), None)
        if other is None:
            self._error(RequestError(f"no route {path!r}", status=HTTPStatus.NOT_FOUND))
        else:
            self._error(RequestError(f"{path} accepts {other} only, got {method}",
                                     status=HTTPStatus.METHOD_NOT_ALLOWED), headers={"Allow": other})
        return None

    # reading
    def _body(self) -> dict[str, Any]:
        raw = self._read_chunked() if self._chunked() else self._read_sized()
        if not raw.strip():
            raise RequestError("the body is empty: send a JSON object")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def _chunked(self) -> bool:
        """Whether the body comes as ``Transfer-Encoding: chunked`` (which takes precedence over Content-Length)."""
        encoding = self.headers.get("Transfer-Encoding")
        if encoding is None:
            return False
        if encoding.strip().lower() != "chunked":
            raise RequestError(f"Transfer-Encoding {encoding!r} is not supported: send the body with "
                               "Content-Length or as 'chunked'", status=HTTPStatus.NOT_IMPLEMENTED)
        return True

    def _read_sized(self) -> bytes:
        length = self.headers.get("Content-Length", "0").strip()
        if not _DIGITS.fullmatch(length):
            raise RequestError(f"the Content-Length header must be a number of bytes (>= 0), got {length!r}")
        if int(length) > MAX_BODY_BYTES:
            raise RequestError(f"the body must be at most {MAX_BODY_BYTES:,} bytes, got {int(length):,}",
                               status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        return self.rfile.read(int(length))

    def _read_chunked(self) -> bytes:
        """A chunked body: chunks of ``<hex size>[;extensions]CRLF<data>CRLF``, a last one of size 0,
        then optional trailer lines and an empty line. At most ``MAX_BODY_BYTES`` in all."""
        body = bytearray()
        while True:
            size_line = self.rfile.readline(1024).split(b";", 1)[0].strip()
            if not _HEX.fullmatch(size_line):
                raise RequestError(f"malformed chunked body: chunk size {size_line[:20]!r} is not hexadecimal")
            size = int(size_line, 16)
            if len(body) + size > MAX_BODY_BYTES:
                raise RequestError(f"the body must be at most {MAX_BODY_BYTES:,} bytes",
                                   status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            if size == 0:
                break
            chunk = self.rfile.read(size)
            if len(chunk) != size or self.rfile.readline(2) != b"\r\n":
                raise RequestError("malformed chunked body: a chunk is shorter than its size or lacks its CRLF")
            body += chunk
        for _ in range(64):  # trailers, until the empty line that ends the message
            if self.rfile.readline(1024) in (b"\r\n", b"\n", b""):
                return bytes(body)
        raise RequestError("malformed chunked body: too many trailer lines")

    def _events(self, out: queue.Queue, ids: list[str]) -> Iterator[RequestOutput]:
        """The engine's outputs for this HTTP request until it is done; raises what the engine reported. While
        waiting it checks every ``POLL_S`` that the engine loop is alive and that the client is still there (one
        that left has its requests aborted: ``ClientGone``)."""
        checked = time.monotonic()
        while True:
            try:
                item = out.get(timeout=POLL_S)
            except queue.Empty:
                item = None
            if item is None or time.monotonic() - checked > POLL_S:  # outputs may come every step: check anyway
                checked = time.monotonic()
                if not self.state.loop.alive() and item is None:
                    raise RuntimeError("the engine loop has stopped")
                if self._client_gone():
                    self.state.loop.abort(ids)
                    raise ClientGone()
            if item is None:
                continue
            if item is _DONE:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def _client_gone(self) -> bool:
        """Whether the client closed its end: its socket reads as end-of-file (it sends nothing more after the
        request it is waiting for)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    # writing
    def _respond(self, out: queue.Queue, request_id: str, ids: list[str], n: int, chat: bool,
                 echo: Echo | None = None, echoed: dict[str, dict[str, str]] | None = None,
                 top_logprobs: int = 0) -> None:
        latest: dict[tuple[str, int], CompletionOutput] = {}  # each completion's last report (they end apart)
        prompts: dict[str, RequestOutput] = {}  # each prompt's last report: its tokens and prompt_logprobs
        try:
            for o in self._events(out, ids):
                prompts[o.request_id] = o
                for c in o.outputs:
                    latest[o.request_id, c.index] = c
        except ClientGone:
            self.close_connection = True
            return
        except RequestError as e:
            self._error(e)
            return
        except Exception as e:  # noqa: BLE001
            self._error(RequestError(str(e), status=HTTPStatus.INTERNAL_SERVER_ERROR))
            return
        choices = []
        for (rid, index), c in sorted(latest.items(), key=lambda kv: _choice_index(ids, kv[0][0], n, kv[0][1])):
            idx = _choice_index(ids, rid, n, index)
            if chat:
                choices.append({"index": idx, "message": {"role": "assistant", "content": c.text},
                                "logprobs": _chat_logprobs_json(c, c.token_ids, 0, top_logprobs),
                                "finish_reason": c.finish_reason})
                continue
            choice = {"index": idx, "text": c.text, "logprobs": _logprobs_json(c, c.token_ids, 0),
                      "finish_reason": c.finish_reason}
            if echo is not None:
                choice.update(_echoed(prompts[rid], c, echo, echoed[rid]))
            if prompts[rid].prompt_logprobs is not None and (echo is None or echo.prompt_logprobs):
                choice["prompt_logprobs"] = _prompt_logprobs_json(prompts[rid].prompt_logprobs)
            choices.append(choice)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in prompts.values())
        completion_tokens = 0 if echo is not None and echo.prompt_only else sum(len(c.token_ids)
                                                                                 for c in latest.values())
        self._json(HTTPStatus.OK, {
            "id": request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.state.model_name, "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens)})

    def _stream(self, out: queue.Queue, request_id: str, ids: list[str], n: int, chat: bool,
                include_usage: bool, echo: Echo | None = None,
                echoed: dict[str, dict[str, str]] | None = None, top_logprobs: int = 0) -> None:
        """Server-sent events: one ``data: {chunk}`` per completion that advanced, then ``data: [DONE]``. A
        client that goes away has its requests aborted instead of left to run."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        head = {"id": request_id, "object": obj, "created": created, "model": self.state.model_name}
        started = False
        text_pos: dict[tuple[str, int], int] = {}  # per completion seen: where its next token's logprob offset is
        prompt_tokens = completion_tokens = 0
        try:
            for o in self._events(out, ids):
                if not started:
                    self._start_events()
                    started = True
                for c in o.outputs:
                    key = (o.request_id, c.index)
                    idx = _choice_index(ids, o.request_id, n, c.index)
                    completion_tokens += 0 if echo is not None and echo.prompt_only else len(c.new_token_ids)
                    if chat:
                        delta = {"content": c.delta_text} if key in text_pos else {"role": "assistant",
                                                                                   "content": c.delta_text}
                        start = len(c.token_ids) - len(c.new_token_ids)
                        choice = {"index": idx, "delta": delta, "finish_reason": c.finish_reason,
                                  "logprobs": _chat_logprobs_json(c, c.new_token_ids, start, top_logprobs)}
                    else:
                        start = len(c.token_ids) - len(c.new_token_ids)
                        choice = {"index": idx, "text": c.delta_text,
                                  "logprobs": _logprobs_json(c, c.new_token_ids, start, text_pos.get(key, 0)),
                                  "finish_reason": c.finish_reason}
                        if key not in text_pos and o.prompt_logprobs is not None and (echo is None
                                                                                      or echo.prompt_logprobs):
                            choice["prompt_logprobs"] = _prompt_logprobs_json(o.prompt_logprobs)  # once, first
                        if echo is not None and key not in text_pos:  # the prompt goes out in the first chunk
                            choice.update(_echoed(o, c, echo, echoed[o.request_id], c.new_token_ids, c.delta_text))
                        elif echo is not None and echo.prompt_only:
                            choice.update(text="", logprobs=None, finish_reason=choice["finish_reason"] and "length")
                    # offsets run over the tokens' texts, as in the plain answer, whatever text a chunk held back
                    lp = None if chat else choice["logprobs"]
                    text_pos[key] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp and lp["tokens"] else \
                        text_pos.get(key, 0)
                    self._event({**head, "choices": [choice]})
                if o.finished:
                    prompt_tokens += len(o.prompt_token_ids)
            if include_usage:
                self._event({**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
            self._write(b"data: [DONE]\n\n")
        except ClientGone:
            pass
        except OSError:  # the client went away while we wrote (broken pipe, reset, ...): free its sequences
            self.state.loop.abort(ids)
        except Exception as e:  # noqa: BLE001 - RequestError (400) or a failure (500)
            err = e if isinstance(e, RequestError) else RequestError(str(e), status=HTTPStatus.INTERNAL_SERVER_ERROR)
            if not started:
                self._error(err)
            else:  # the status line has gone: report in the stream, as vLLM does, and end it
                try:
                    self._event({"error": _error_body(err)})
                    self._write(b"data: [DONE]\n\n")
                except OSError:
                    pass
        self.close_connection = True

    def _start_events(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()

    def _event(self, payload: dict[str, Any]) -> None:
        self._write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def _json(self, status: HTTPStatus, payload: dict[str, Any], close: bool = False,
              headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if close:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client left before its answer: nothing to do
            self.close_connection = True

    def _error(self, e: RequestError, headers: dict[str, str] | None = None) -> None:
        self.close_connection = True  # the body may not have been read: do not parse its rest as a request
        self._json(e.status, {"error": _error_body(e)}, close=True, headers=headers)


def sse_events(text: str) -> list[dict[str, Any]]:
    """A client's side of a stream: the JSON of every ``data:`` event in a server-sent-events body, without the
    closing ``data: [DONE]``."""
    chunks = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    return [json.loads(c) for c in chunks if c != "[DONE]"]


class ClientGone(Exception):
    """The client of an HTTP request closed its connection while waiting."""


def _choice_index(ids: list[str], rid: str, n: int, index: int) -> int:
    """OpenAI numbers the choices of several prompts consecutively: prompt ``p``'s completion ``i`` is ``p*n+i``."""
    return ids.index(rid) * n + index


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _error_body(e: RequestError) -> dict[str, Any]:
    kind = {HTTPStatus.NOT_FOUND: "NotFoundError", HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
            HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError", HTTPStatus.NOT_IMPLEMENTED: "NotImplementedError"}
    return {"message": str(e), "type": kind.get(e.status, "BadRequestError"), "param": e.param, "code": int(e.status)}


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a handler still waiting when the server stops does not keep the process alive
    # socketserver's default backlog is 5 connections waiting to be accepted: 16 clients connecting at once
    # overflowed it, and Linux then reset connections that the clients had already written a request on.
    request_queue_size = 1024


class Server:
    """A running server: ``url``, ``loop`` (the engine thread) and ``shutdown()``. Built by ``start_server``."""

    def __init__(self, httpd: ThreadingHTTPServer, loop: EngineLoop, thread: threading.Thread) -> None:
        self.httpd, self.loop, self._thread = httpd, loop, thread
        host, port = httpd.server_address[:2]
        self.url = f"http://{host}:{port}"

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.loop.stop()
        self._thread.join(timeout=10)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def start_server(llm, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None) -> Server:
    """Serve ``llm`` (an ``LLM`` with ``batching="continuous"``) in background threads and return at once.
    ``port=0`` picks a free port (``server.url`` tells which). Use as a context manager or call ``shutdown()``."""
    if llm.engine is None:
        raise ValueError("the server needs LLM(..., batching='continuous'): it drives the online LLMEngine")
    loop = EngineLoop(llm.engine).start()
    name = model_name or str(getattr(llm, "model_name", None) or llm.model_path.name)
    state = ServerState(loop, name, llm.tokenizer, int(time.time()))
    handler = type("MiniferHandler", (Handler,), {"state": state})
    httpd = _HTTPServer((host, port), handler)
    thread = threading.Thread(target=httpd.serve_forever, name="minifer-http", daemon=True)
    thread.start()
    return Server(httpd, loop, thread)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from minifer import LLM

    ap = argparse.ArgumentParser(prog="python -m minifer serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="bundled name, local HF folder or hub id")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", default=None, help="the name clients pass as 'model' (default: MODEL)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--quantization", default=None, choices=["int8", "int4", "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"])
    ap.add_argument("--speculative-config", default=None, type=json.loads,
                    help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    args = ap.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              speculative_config=args.speculative_config)
    server = start_server(llm, host=args.host, port=args.port, model_name=args.served_model_name or args.model)

    def stop(signum: int, frame: Any) -> None:  # Ctrl-C, or SIGTERM from a process manager: a clean shutdown
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # set, not inherited: a parent may have told us to ignore them
        signal.signal(sig, stop)
    print(f"serving {server.url}/v1 (model {args.served_model_name or args.model!r}); Ctrl-C stops", flush=True)
    try:
        while server.loop.alive():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        died = not server.loop.alive()
        server.shutdown()
    if died:
        print("the engine loop stopped on its own (see the traceback above)", flush=True)
        return 1
    return 0
