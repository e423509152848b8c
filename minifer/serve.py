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

The OpenAI format itself (request fields to ``SamplingParams``, outputs to choices, logprobs, echo) is
``minifer/openai_protocol.py``; this module is the engine thread and the HTTP around it.

Failure stays local. A request with a bad field is answered 400 with a message naming the field, before it
reaches the engine (or by the engine's own validation); a client that disconnects mid-stream has its request
aborted and its KV blocks freed; an exception inside a step fails the requests in flight with a 500 and the
loop goes on serving new ones. Since a step samples the whole batch, one request's bad value would fail every
request in it: ``SamplingParams`` therefore refuses every value that could break a step (types included), and
an explicit ``max_tokens`` the context cannot hold is a 400 as in vLLM (the offline ``LLM`` clips it).
"""

from __future__ import annotations

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

from minifer.engine.sequence import sequences_of
from minifer.openai_protocol import (DIGITS, Echo, RequestError, chat_logprobs_json, chat_prompt, check_room,
                                     choice_index, completion_prompts, echo_mode, echo_prompt, echoed_choice,
                                     error_body, logprobs_json, max_tokens_field, prompt_logprobs_json,
                                     sampling_params, sse_events, stream_flags, usage)
from minifer.outputs import CompletionOutput, RequestOutput
from minifer.sampling import SamplingParams

__all__ = ["EngineLoop", "RequestError", "Server", "main", "sse_events", "start_server"]

_DONE = object()  # an HTTP request's queue gets this once none of its engine requests will report again
MAX_BODY_BYTES = 16 * 2**20
# Completions per HTTP request (n times the prompts): the engine thread, which serves every client, creates them
# all at once, so a request for 100,000 would stall everyone else (offline, LLM.generate has no such limit).
MAX_COMPLETIONS_PER_REQUEST = 256
POLL_S = 0.25  # how often a waiting handler checks that its client and the engine loop are still there
_HEX = re.compile(rb"[0-9A-Fa-f]+")  # a chunk size (int(x, 16) would also take "-5", "0x5" and "5_0")
_ROUTES = {"GET": ("/health", "/v1/models"), "POST": ("/v1/completions", "/v1/chat/completions")}


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
            echo = echo_mode(body, chat=chat)
            params = sampling_params(body, chat=chat, echo=echo)
            prompts = [chat_prompt(body, self.state.tokenizer)] if chat else completion_prompts(body)
            if params.n * len(prompts) > MAX_COMPLETIONS_PER_REQUEST:
                raise RequestError(f"n={params.n} for {len(prompts)} prompt(s) asks for {params.n * len(prompts)} "
                                   f"completions; this server makes at most {MAX_COMPLETIONS_PER_REQUEST} per request",
                                   "n")
            stream, include_usage = stream_flags(body)
        except RequestError as e:
            self._error(e)
            return
        prefix = "chatcmpl-" if chat else "cmpl-"
        request_id = prefix + uuid.uuid4().hex[:24]
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        echoed: dict[str, dict[str, str]] = {rid: {} for rid in ids} if echo is not None else {}
        if echo is not None:
            prompts = [echo_prompt(p, self.state.tokenizer, echoed[rid]) for rid, p in zip(ids, prompts)]
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
        if not DIGITS.fullmatch(length):
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
        for (rid, index), c in sorted(latest.items(), key=lambda kv: choice_index(ids, kv[0][0], n, kv[0][1])):
            idx = choice_index(ids, rid, n, index)
            if chat:
                choices.append({"index": idx, "message": {"role": "assistant", "content": c.text},
                                "logprobs": chat_logprobs_json(c, c.token_ids, 0, top_logprobs),
                                "finish_reason": c.finish_reason})
                continue
            choice = {"index": idx, "text": c.text, "logprobs": logprobs_json(c, c.token_ids, 0),
                      "finish_reason": c.finish_reason}
            if echo is not None:
                choice.update(echoed_choice(prompts[rid], c, echo, echoed[rid]))
            if prompts[rid].prompt_logprobs is not None and (echo is None or echo.prompt_logprobs):
                choice["prompt_logprobs"] = prompt_logprobs_json(prompts[rid].prompt_logprobs)
            choices.append(choice)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in prompts.values())
        completion_tokens = 0 if echo is not None and echo.prompt_only else sum(len(c.token_ids)
                                                                                 for c in latest.values())
        self._json(HTTPStatus.OK, {
            "id": request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.state.model_name, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)})

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
                    idx = choice_index(ids, o.request_id, n, c.index)
                    completion_tokens += 0 if echo is not None and echo.prompt_only else len(c.new_token_ids)
                    if chat:
                        delta = {"content": c.delta_text} if key in text_pos else {"role": "assistant",
                                                                                   "content": c.delta_text}
                        start = len(c.token_ids) - len(c.new_token_ids)
                        choice = {"index": idx, "delta": delta, "finish_reason": c.finish_reason,
                                  "logprobs": chat_logprobs_json(c, c.new_token_ids, start, top_logprobs)}
                    else:
                        start = len(c.token_ids) - len(c.new_token_ids)
                        choice = {"index": idx, "text": c.delta_text,
                                  "logprobs": logprobs_json(c, c.new_token_ids, start, text_pos.get(key, 0)),
                                  "finish_reason": c.finish_reason}
                        if key not in text_pos and o.prompt_logprobs is not None and (echo is None
                                                                                      or echo.prompt_logprobs):
                            choice["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)  # once, first
                        if echo is not None and key not in text_pos:  # the prompt goes out in the first chunk
                            choice.update(echoed_choice(o, c, echo, echoed[o.request_id], c.new_token_ids,
                                                        c.delta_text))
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
                self._event({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
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
                    self._event({"error": error_body(err)})
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
        self._json(e.status, {"error": error_body(e)}, close=True, headers=headers)


class ClientGone(Exception):
    """The client of an HTTP request closed its connection while waiting."""


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
