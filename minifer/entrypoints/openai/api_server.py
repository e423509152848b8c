"""The ASGI application (FastAPI): OpenAI's routes and vLLM's, over one ``EngineLoop``.

    GET  /health, /ping           200 while the engine loop is alive (503 once it stopped); /ping takes POST too
    GET  /version                 minifer's version
    GET  /metrics                 Prometheus metrics under vLLM's names (``minifer.entrypoints.openai.metrics``)
    GET  /v1/models, /v1/models/{model_id}   the served model under each of its names, with ``max_model_len``
    POST /v1/completions          prompt (a text, token ids, or a list of either) -> choices, usage; SSE if "stream"
    POST /v1/chat/completions     messages through the chat template
    POST /tokenize, /detokenize   vLLM's: text or messages to token ids, and back
    GET  /tokenizer_info          vLLM's: the tokenizer's config (class, special tokens, chat template)
    GET  /openapi.json, /docs     FastAPI's: these routes' OpenAPI schema, and Swagger UI over it

Each request costs the event loop only its I/O: the body is read under a size cap and a deadline, then parsed,
checked and tokenized on the request side's worker (``Preprocessor``), and its sequences go to the engine
thread, whose outputs come back through an ``asyncio.Queue``. A client that leaves has its requests aborted
(their KV blocks freed): a stream when its connection closes under the response, a plain request when the
disconnect arrives while it waits. Every error is OpenAI's JSON body, ``{"error": {message, type, param,
code}}``, with ``param`` naming the field at fault. With an API key, the ``/v1`` routes need
``Authorization: Bearer <key>`` (compared in constant time), as in vLLM; the probes, metrics and schema stay open.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import secrets
import time
import traceback
import uuid
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minifer.entrypoints.openai.engine_loop import DONE, EngineLoop
from minifer.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from minifer.entrypoints.openai.protocol import (
    KNOWN_FIELDS,
    RequestError,
    body_schema,
    chat_logprobs_json,
    choice_index,
    echoed_choice,
    error_body,
    loggable,
    logprobs_json,
    prompt_logprobs_json,
    usage,
)
from minifer.entrypoints.openai.serving import Prepared, Preprocessor
from minifer.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("minifer.entrypoints.openai.serve")


@dataclass
class ServerState:
    loop: EngineLoop
    pre: Preprocessor
    metrics: ServerMetrics
    served_names: list[str]
    max_model_len: int
    api_key: str | None = None
    read_timeout: float = 30.0
    created: int = field(default_factory=lambda: int(time.time()))


def error_response(e: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error_body(e)}, status_code=int(e.status), headers=headers)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def authorize(request: Request) -> None:  # async: FastAPI runs a plain ``def`` dependency on a thread
    key, given = server_state(request).api_key, request.headers.get("authorization", "")
    if key is not None and not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
        raise RequestError("invalid or missing API key: send 'Authorization: Bearer <key>'",
                           status=HTTPStatus.UNAUTHORIZED)


# As in vLLM, the routes live on module-level routers that ``build_app`` includes, and each finds the server's
# ``ServerState`` in ``request.app.state``: one set of routes serves any number of applications.
router = APIRouter()  # the probes, the metrics and the tokenizer: open to all
v1_router = APIRouter(dependencies=[Depends(authorize)])  # OpenAI's routes: the API key, if the server has one


def build_app(state: ServerState, *, allowed_origins=("*",), allowed_methods=("*",), allowed_headers=("*",),
              allow_credentials: bool = False) -> FastAPI:
    """The application over ``state``; CORS as vLLM configures it (its flags' defaults allow any origin)."""
    app = FastAPI(title="minifer", redoc_url=None, exception_handlers={
        RequestError: _refused, StarletteHTTPException: _http_error, ClientDisconnect: _gone, _ClientGone: _gone,
        RequestValidationError: _invalid, Exception: _failed})
    app.state.server = state
    app.add_middleware(_failures)  # added first, so that it runs inside CORSMiddleware
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                       allow_headers=list(allowed_headers), allow_credentials=allow_credentials)
    app.include_router(router)
    app.include_router(v1_router)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, each operation with an id of its own: FastAPI gives all the methods of one route (/health's
    GET and HEAD) the id of its first, ``<name><path>_<method>``, and warns of it; each gets its own method."""
    if app.openapi_schema is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for ops in FastAPI.openapi(app)["paths"].values():
                for method, op in ops.items():
                    op["operationId"] = f"{op['operationId'].rsplit('_', 1)[0]}_{method}"
                    if "requestBody" in op:  # a copy (the route's is shared), naming the models this server serves
                        op["requestBody"] = copy.deepcopy(op["requestBody"])
                        fields = op["requestBody"]["content"]["application/json"]["schema"]["properties"]
                        fields["model"] = {"enum": app.state.server.served_names}
    return app.openapi_schema


# exception handlers: each failure as OpenAI's error body

async def _refused(request: Request, e: RequestError) -> JSONResponse:
    # the body may be unread (413, 408): do not parse the rest of it as the next request
    close = e.status in (HTTPStatus.REQUEST_ENTITY_TOO_LARGE, HTTPStatus.REQUEST_TIMEOUT)
    return error_response(e, {"Connection": "close"} if close else None)


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    status = HTTPStatus(e.status_code)
    message = {HTTPStatus.NOT_FOUND: f"no route {request.url.path!r}",
               HTTPStatus.METHOD_NOT_ALLOWED: f"{request.url.path} accepts {(e.headers or {}).get('Allow')} "
                                              f"only, got {request.method}"}.get(status, str(e.detail))
    return error_response(RequestError(message, status=status), e.headers)


async def _gone(request: Request, e: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; uvicorn drops it


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    return error_response(RequestError(str(e)[:500]))


async def _failed(request: Request, e: Exception) -> JSONResponse:
    # not logger.exception: the exception's message may quote the client, and a traceback prints it as it is
    logger.error("request failed: %s: %s\n%s", type(e).__name__, loggable([str(e)], chars=500),
                 "".join(traceback.format_tb(e.__traceback__)).rstrip())
    return error_response(RequestError(f"{type(e).__name__}: {e}", status=HTTPStatus.INTERNAL_SERVER_ERROR))


def _failures(app):
    """Middleware answering an exception no handler took with ``_failed``'s 500 inside ``CORSMiddleware``, so that
    it carries CORS headers too (Starlette's own catch-all, ``ServerErrorMiddleware``, sits outside all middleware).
    One raised after the answer began (a stream's) goes on up: its status line has gone."""

    async def answer_failures(scope, receive, send) -> None:
        started = False

        async def send_noting(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await app(scope, receive, send_noting)
        except Exception as e:
            if started or scope["type"] != "http":
                raise
            await (await _failed(Request(scope), e))(scope, receive, send)

    return answer_failures


# probes

@router.api_route("/ping", methods=["GET", "HEAD", "POST"])  # decorators apply bottom up: /health, then /ping
@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> JSONResponse:
    ok = server_state(request).loop.alive()
    return JSONResponse({"status": "ok" if ok else "down"}, status_code=200 if ok else 503)


@router.get("/version")
async def show_version() -> JSONResponse:
    from minifer import __version__

    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def show_metrics(request: Request) -> Response:
    data = await asyncio.get_running_loop().run_in_executor(None, server_state(request).metrics.render)
    return Response(data, media_type=CONTENT_TYPE)


# models

def model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "minifer",
            "root": state.served_names[0], "parent": None, "max_model_len": state.max_model_len, "permission": []}


@v1_router.get("/v1/models")
async def show_available_models(request: Request) -> JSONResponse:
    state = server_state(request)
    return JSONResponse({"object": "list", "data": [model_card(state, n) for n in state.served_names]})


@v1_router.get("/v1/models/{model_id:path}")
async def show_model(model_id: str, request: Request) -> JSONResponse:
    state = server_state(request)
    if model_id not in state.served_names:
        raise RequestError(f"model {model_id!r} is not served here", "model", HTTPStatus.NOT_FOUND)
    return JSONResponse(model_card(state, model_id))


def _json_body(*fields: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """OpenAPI's schema of a JSON body that a route reads itself (``read_body``), for clients and fuzzers."""
    schema = body_schema(fields, required)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# tokenizer

@router.post("/tokenize", openapi_extra=_json_body("model", "prompt", "add_special_tokens", "messages",
                                                   "return_token_strs"))
async def tokenize(request: Request) -> JSONResponse:
    pre = server_state(request).pre
    return JSONResponse(await pre.run(pre.tokenize, await read_body(request)))


@router.post("/detokenize", openapi_extra=_json_body("model", "tokens", required=("tokens",)))
async def detokenize(request: Request) -> JSONResponse:
    pre = server_state(request).pre
    return JSONResponse(await pre.run(pre.detokenize, await read_body(request)))


@router.get("/tokenizer_info")
async def get_tokenizer_info(request: Request) -> JSONResponse:
    return JSONResponse(server_state(request).pre.tokenizer_info())


# generation

@v1_router.post("/v1/completions", openapi_extra=_json_body(*sorted(KNOWN_FIELDS - {"messages", "top_logprobs"}),
                                                            required=("model", "prompt")))
async def create_completion(request: Request) -> Response:
    return await generate(request, chat=False)


@v1_router.post("/v1/chat/completions",
                openapi_extra=_json_body(*sorted(KNOWN_FIELDS - {"prompt", "echo", "prompt_logprobs"}),
                                         required=("model", "messages")))
async def create_chat_completion(request: Request) -> Response:
    return await generate(request, chat=True)


async def read_body(request: Request) -> bytes:
    """The body, at most ``max_body_bytes`` of it, within ``read_timeout`` seconds."""
    state = server_state(request)
    cap = state.pre.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise RequestError(f"the body must be at most {cap:,} bytes (the longest prompt this model takes), got "
                           f"{int(length):,}", status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    parts: list[bytes] = []

    async def read() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise RequestError(f"the body must be at most {cap:,} bytes (the longest prompt this model "
                                   "takes)", status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            parts.append(chunk)

    try:
        await asyncio.wait_for(read(), state.read_timeout)
    except asyncio.TimeoutError:
        raise RequestError(f"the body did not arrive within {state.read_timeout:g} s",
                           status=HTTPStatus.REQUEST_TIMEOUT) from None
    return b"".join(parts)


async def generate(request: Request, chat: bool) -> Response:
    state = server_state(request)
    arrival = time.perf_counter()
    raw = await read_body(request)
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    prep: Prepared = await state.pre.run(state.pre.completion, raw, chat, request_id, arrival)
    if prep.ignored:  # vLLM's behaviour: unknown fields are ignored, and said so
        logger.warning("request %s: fields ignored (minifer does not know them): %s", request_id,
                       loggable(prep.ignored))
    outputs: asyncio.Queue = asyncio.Queue()
    aloop = asyncio.get_running_loop()

    def deliver(item: Any) -> None:  # called on the engine thread
        try:
            aloop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # the event loop has closed (shutdown): nobody waits for this any more
            pass

    state.loop.submit(prep.seqs, deliver, stream=prep.stream, arrival=arrival)
    events = _Events(outputs, state.loop, prep.ids)
    try:
        if prep.stream:  # the status line waits for the first output: an engine refusal is still a 400
            first = await until_disconnect(request, events.next())
            response = StreamingResponse(stream(prep, events, first), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            events = None  # the stream owns them now
            return response
        return JSONResponse(await until_disconnect(request, answer(prep, events)))
    finally:
        if events is not None:
            events.close()  # a no-op once all finished; else the client left or it failed: free its sequences


class _ClientGone(Exception):
    """The client closed its connection while its request ran."""


async def until_disconnect(request: Request, work):
    """Await ``work`` unless the client disconnects first (then ``_ClientGone``; ``work`` is cancelled)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise _ClientGone()


class _Events:
    """An HTTP request's outputs from the engine thread. ``close()`` aborts what has not finished."""

    def __init__(self, outputs: asyncio.Queue, loop: EngineLoop, ids: list[str]) -> None:
        self.outputs, self.loop, self.ids = outputs, loop, ids
        self.done = False

    async def next(self) -> RequestOutput | None:
        """The next output, or None when there are no more; raises what the engine reported."""
        if self.done:
            return None
        item = await self.outputs.get()
        if item is DONE:
            self.done = True
            return None
        if isinstance(item, RequestError):
            raise item
        if isinstance(item, Exception):  # the engine failed (a step, or the loop stopped): this request's 500
            raise RequestError(str(item), status=HTTPStatus.INTERNAL_SERVER_ERROR)
        return item

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.loop.abort(self.ids)


async def answer(prep: Prepared, events: _Events) -> dict[str, Any]:
    """A plain (non-streamed) answer: every completion's last report, once all finished."""
    latest: dict[tuple[str, int], CompletionOutput] = {}  # each completion's last report (they end apart)
    prompts: dict[str, RequestOutput] = {}  # each prompt's last report: its tokens and prompt_logprobs
    ids, echo, n = prep.ids, prep.echo, prep.n
    while (o := await events.next()) is not None:
        prompts[o.request_id] = o
        for c in o.outputs:
            latest[o.request_id, c.index] = c
    choices = []
    for (rid, index), c in sorted(latest.items(), key=lambda kv: choice_index(ids, kv[0][0], n, kv[0][1])):
        idx = choice_index(ids, rid, n, index)
        if prep.chat:
            choices.append({"index": idx, "message": {"role": "assistant", "content": c.text},
                            "logprobs": chat_logprobs_json(c, c.token_ids, 0, prep.top_logprobs),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            continue
        choice = {"index": idx, "text": c.text, "logprobs": logprobs_json(c, c.token_ids, 0),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if echo is not None:
            choice.update(echoed_choice(prompts[rid], c, echo, prep.echoed[rid]))
        if prompts[rid].prompt_logprobs is not None and (echo is None or echo.prompt_logprobs):
            choice["prompt_logprobs"] = prompt_logprobs_json(prompts[rid].prompt_logprobs)
        choices.append(choice)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in prompts.values())
    completion_tokens = 0 if echo is not None and echo.prompt_only else sum(len(c.token_ids) for c in latest.values())
    return {"id": prep.request_id, "object": "chat.completion" if prep.chat else "text_completion",
            "created": int(time.time()), "model": prep.model, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _stream_choice(prep: Prepared, o: RequestOutput, c: CompletionOutput, first: bool, offset: int) -> dict[str, Any]:
    """A completion's choice in a chunk: the role, echo and prompt logprobs go in its ``first``."""
    echo = prep.echo
    idx = choice_index(prep.ids, o.request_id, prep.n, c.index)
    start = len(c.token_ids) - len(c.new_token_ids)
    if prep.chat:
        delta = {"role": "assistant", "content": c.delta_text} if first else {"content": c.delta_text}
        return {"index": idx, "delta": delta, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "logprobs": chat_logprobs_json(c, c.new_token_ids, start, prep.top_logprobs)}
    choice = {"index": idx, "text": c.delta_text, "logprobs": logprobs_json(c, c.new_token_ids, start, offset),
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if first and o.prompt_logprobs is not None and (echo is None or echo.prompt_logprobs):
        choice["prompt_logprobs"] = prompt_logprobs_json(o.prompt_logprobs)  # once, first
    if echo is not None and first:  # the prompt goes out in the first chunk
        choice.update(echoed_choice(o, c, echo, prep.echoed[o.request_id], c.new_token_ids, c.delta_text))
    elif echo is not None and echo.prompt_only:
        choice.update(text="", logprobs=None, finish_reason=choice["finish_reason"] and "length")
    return choice


async def stream(prep: Prepared, events: _Events, first: RequestOutput | None) -> AsyncIterator[bytes]:
    """Server-sent events: one ``data: {chunk}`` per completion that advanced, then ``data: [DONE]``. Closing
    the generator (the client left: Starlette cancels it) aborts what has not finished."""
    head = {"id": prep.request_id, "object": "chat.completion.chunk" if prep.chat else "text_completion",
            "created": int(time.time()), "model": prep.model}
    echo = prep.echo
    text_pos: dict[tuple[str, int], int] = {}  # per completion seen: where its next token's logprob offset is
    prompt_tokens = completion_tokens = 0
    o = first
    try:
        while o is not None:
            for c in o.outputs:
                key = (o.request_id, c.index)
                completion_tokens += 0 if echo is not None and echo.prompt_only else len(c.new_token_ids)
                choice = _stream_choice(prep, o, c, key not in text_pos, text_pos.get(key, 0))
                # offsets run over the tokens' texts, as in the plain answer, whatever text a chunk held back
                lp = None if prep.chat else choice["logprobs"]
                text_pos[key] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp and lp["tokens"] else \
                    text_pos.get(key, 0)
                yield _event({**head, "choices": [choice]})
            if o.finished:
                prompt_tokens += len(o.prompt_token_ids)
            o = await events.next()
        if prep.include_usage:
            yield _event({**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except RequestError as e:  # the status line has gone: report in the stream, as vLLM does
        yield _event({"error": error_body(e)})
    finally:
        events.close()  # a no-op once everything finished; else the client left: free its sequences
    yield b"data: [DONE]\n\n"


__all__ = ["ServerState", "build_app"]
