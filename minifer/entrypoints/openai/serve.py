"""An OpenAI-compatible server over ``LLMEngine``: ``python -m minifer serve MODEL --port 8000``.

The online engine (``LLMEngine``: ``add_request`` / ``step`` / ``abort_request``) is what a server needs; this
module puts it behind the routes that OpenAI clients, ``curl``, evaluation harnesses and benchmark tools speak,
with vLLM's names, extensions and flags, so a client moves between minifer and ``vllm serve`` unchanged.

It runs on the stack vLLM's own server uses: an ASGI application (FastAPI, ``minifer.entrypoints.openai.api_server``)
under uvicorn, on an event loop in one thread, with the engine on another (``EngineLoop``: the only thread that
touches the engine; requests and aborts reach it through a queue). Parsing, chat templates, tokenizing and
length checks run on a worker of the request side (``minifer.entrypoints.openai.serving``), so a huge prompt costs
its own request time, never the engine's. Below the application, uvicorn's HTTP/1.1 protocol gets a read
timeout for request heads and a bound on open connections (``minifer.entrypoints.openai.http_protocol``); the body is
read under a size cap and a deadline. Prometheus metrics under vLLM's names are at ``/metrics``
(``minifer.entrypoints.openai.metrics``); OpenAI's format itself is ``minifer.entrypoints.openai.protocol``.

``start_server(llm)`` serves an ``LLM`` from a notebook or a test, in background threads; ``main`` is the
command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from minifer.entrypoints.openai.engine_loop import EngineLoop
from minifer.entrypoints.openai.protocol import RequestError, sse_events
from minifer.entrypoints.openai.serving import MAX_COMPLETIONS_PER_REQUEST

__all__ = ["EngineLoop", "MAX_COMPLETIONS_PER_REQUEST", "RequestError", "Server", "main", "sse_events",
           "start_server"]

CHAT_TEMPLATES = Path(__file__).resolve().parents[2] / "assets" / "chat_templates"
# the chat template the command line uses for a bundled model, whose tokenizer has none
BUNDLED_CHAT_TEMPLATES = {"tinystories-target": "tinystories", "tinystories-draft": "tinystories"}


class Server:
    """A running server: ``url``, ``loop`` (the engine thread), ``metrics`` and ``shutdown()``. Built by
    ``start_server``."""

    def __init__(self, uvicorn_server, thread: threading.Thread, loop: EngineLoop, pre, metrics, url: str) -> None:
        self._uvicorn, self._thread, self.loop, self._pre, self.metrics, self.url = (uvicorn_server, thread, loop,
                                                                                   pre, metrics, url)

    def shutdown(self) -> None:
        """Stop listening, then stop the engine loop, which ends every request in flight with a 503 (a stream's
        last event), so uvicorn finds their connections closed rather than cancelling them after its grace time
        (with a traceback in the log and no word to the client)."""
        self._uvicorn.should_exit = True
        self.loop.stop()
        self._thread.join(timeout=30)
        self._pre.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def resolve_chat_template(value: str | None) -> str | None:
    """vLLM's ``--chat-template``: a file, or the template itself; minifer adds the names of its shipped ones
    (``minifer/assets/chat_templates``: ``tinystories``)."""
    if value is None:
        return None
    shipped = CHAT_TEMPLATES / f"{value}.jinja"
    if shipped.is_file():
        return shipped.read_text()
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    shipped_names = ", ".join(p.stem for p in sorted(CHAT_TEMPLATES.glob("*.jinja")))
    raise ValueError(f"--chat-template {value!r} is neither a file, a template, nor a shipped name ({shipped_names})")


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (0: a free port), made with protocol ``IPPROTO_TCP``: asyncio sets
    ``TCP_NODELAY`` only on accepted sockets whose protocol says TCP, and without it an answer written in two
    pieces (head, then body) waits for the client's delayed ACK of the first: 40 ms per answer on Linux,
    measured here as a 48 ms round trip for a one-token completion instead of 2.4 ms (the
    ``http.server`` code this replaced had the same stall on plain answers: 59 ms). The backlog is deep: 128
    clients connecting at once overflowed socketserver's default of 5, and Linux reset the connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def start_server(llm, *, host: str = "127.0.0.1", port: int = 8000, model_name: str | list[str] | None = None,
                 api_key: str | None = None, chat_template: str | None = None, read_timeout: float = 30.0,
                 timeout_keep_alive: float = 5.0, max_connections: int = 1024, access_log: bool = False,
                 allowed_origins=("*",), allowed_methods=("*",), allowed_headers=("*",),
                 allow_credentials: bool = False, log_level: str = "warning") -> Server:
    """Serve ``llm`` (an ``LLM`` with ``batching="continuous"``) in background threads and return once it
    listens. ``port=0`` picks a free port (``server.url`` tells which). ``model_name``: the name(s) clients pass
    as ``model`` (default: the model's). ``chat_template``: a template, file or shipped name
    (``resolve_chat_template``). ``read_timeout``: seconds for a request's head, and again for its body.
    Use as a context manager or call ``shutdown()``."""
    import uvicorn

    from minifer.entrypoints.openai.api_server import ServerState, build_app
    from minifer.entrypoints.openai.http_protocol import protocol_class
    from minifer.entrypoints.openai.metrics import ServerMetrics
    from minifer.entrypoints.openai.serving import Preprocessor

    if llm.engine is None:
        raise ValueError("the server needs LLM(..., batching='continuous'): it drives the online LLMEngine")
    names = [model_name] if isinstance(model_name, str) else list(model_name or [])
    names = names or [str(getattr(llm, "model_name", None) or llm.model_path.name)]
    pre = Preprocessor(llm, names, resolve_chat_template(chat_template))
    metrics = ServerMetrics(names[0], llm.max_model_len)
    loop = EngineLoop(llm.engine, metrics).start()
    metrics.attach(loop)
    state = ServerState(loop, pre, metrics, names, llm.max_model_len, api_key, read_timeout)
    app = build_app(state, allowed_origins=allowed_origins, allowed_methods=allowed_methods,
                    allowed_headers=allowed_headers, allow_credentials=allow_credentials)
    sock = listening_socket(host, port)
    config = uvicorn.Config(app, http=protocol_class(read_timeout, max_connections), lifespan="off", ws="none",
                            loop="asyncio", log_config=None, log_level=log_level, access_log=access_log,
                            timeout_keep_alive=timeout_keep_alive, timeout_graceful_shutdown=3, backlog=2048)
    if access_log:  # one line per request at INFO, whatever --uvicorn-log-level quiets
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="minifer-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        loop.stop()
        raise RuntimeError("the HTTP server did not start")
    bound_host, bound_port = sock.getsockname()[:2]
    return Server(server, thread, loop, pre, metrics, f"http://{bound_host}:{bound_port}")


def make_arg_parser() -> argparse.ArgumentParser:
    """The command line, with vLLM's flag names for what both do."""
    ap = argparse.ArgumentParser(prog="python -m minifer serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="bundled name, local HF folder or hub id")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="the name(s) clients pass as 'model' (default: MODEL)")
    ap.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MINIFER_API_KEY)")
    ap.add_argument("--chat-template", default=None,
                    help="a Jinja template, a file, or a shipped name (bundled models default to 'tinystories')")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-logprobs", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-gpu-blocks-override", type=int, default=None, dest="num_kv_blocks",
                    help="KV-cache blocks (default: from the memory budget)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", "-q", default=None, choices=["int8", "int4", "fp8", "w8a8"],
                    help="weight-only int8/int4/fp8, or w8a8 (int8 weights and per-token int8 activations)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"])
    ap.add_argument("--speculative-config", default=None, type=json.loads,
                    help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    ap.add_argument("--allowed-origins", type=json.loads, default=["*"], help="CORS, a JSON list")
    ap.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS, a JSON list")
    ap.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS, a JSON list")
    ap.add_argument("--allow-credentials", action="store_true", help="CORS")
    ap.add_argument("--timeout-keep-alive", type=float, default=5.0, help="seconds an idle connection stays open")
    ap.add_argument("--read-timeout", type=float, default=30.0,
                    help="seconds for a request's head to arrive, and again for its body")
    ap.add_argument("--max-connections", type=int, default=1024, help="open connections; more are answered 503")
    ap.add_argument("--disable-uvicorn-access-log", action="store_true")
    ap.add_argument("--uvicorn-log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug", "trace"])
    return ap


def main(argv: list[str] | None = None) -> int:
    from minifer import LLM
    from minifer.engine.arg_utils import EngineArgs

    args = make_arg_parser().parse_args(argv)
    api_key = args.api_key or os.environ.get("MINIFER_API_KEY") or None
    template = args.chat_template or BUNDLED_CHAT_TEMPLATES.get(args.model)
    logging.basicConfig(level=args.uvicorn_log_level.upper() if args.uvicorn_log_level != "trace" else "DEBUG",
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    llm = LLM(**EngineArgs.from_cli_args(args).to_kwargs())  # the flags named as EngineArgs' fields
    names = args.served_model_name or [args.model]
    server = start_server(llm, host=args.host, port=args.port, model_name=names, api_key=api_key,
                          chat_template=template, read_timeout=args.read_timeout,
                          timeout_keep_alive=args.timeout_keep_alive, max_connections=args.max_connections,
                          access_log=not args.disable_uvicorn_access_log, allowed_origins=args.allowed_origins,
                          allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
                          allow_credentials=args.allow_credentials, log_level=args.uvicorn_log_level)

    def stop(signum: int, frame: Any) -> None:  # Ctrl-C, or SIGTERM from a process manager: a clean shutdown
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # set, not inherited: a parent may have told us to ignore them
        signal.signal(sig, stop)
    print(f"serving {server.url}/v1 (model {', '.join(map(repr, names))}); Ctrl-C stops", flush=True)
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
