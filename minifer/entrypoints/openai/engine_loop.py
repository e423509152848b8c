"""The engine thread: one thread owns ``LLMEngine``; the HTTP side reaches it through a queue.

The engine is not thread-safe, so ``EngineLoop`` is the only thread that touches it: request handlers hand it
sequences (already tokenized and validated on the request side, ``minifer.entrypoints.openai.serving``) and
aborts through a queue; it applies them between steps, steps while anything is unfinished, and hands each
output to the callback of the HTTP request that asked for it. Nothing here tokenizes, parses or formats: a
request that costs the request side seconds (a huge prompt) costs this thread nothing, so it never stalls the
streams of other clients.

Failure stays local: a request the engine refuses is reported to its own caller only, and an exception inside
a step fails the requests in flight (their blocks are freed) while the loop goes on serving new ones.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import queue
import threading
import time
import traceback
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from minifer.entrypoints.openai.protocol import RequestError, engine_error_param
from minifer.request import Request, sequences_of

DONE = object()  # delivered once none of an HTTP request's engine requests will report again


def stopped() -> RequestError:
    """What a request in flight or arriving gets once the loop stops (the server shuts down): a 503, which a stream
    in progress reports as its last event before it closes."""
    return RequestError("the engine loop has stopped: the server is shutting down", status=HTTPStatus.SERVICE_UNAVAILABLE)

Deliver = Callable[[Any], None]


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim``; elsewhere nothing). A large request's
    transient buffers (prompt logprobs, a 10 MB answer) leave free memory that glibc keeps in its arenas: after
    one, the server's RSS stayed ~20-90 MB up until this ran when the engine went idle (about 0.1-2 ms)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class _Route:
    """What the loop knows of one engine request: where its outputs go and the HTTP request it belongs to."""

    __slots__ = ("arrival", "deliver", "ids", "last_token", "request", "stream")

    def __init__(self, deliver: Deliver, ids: list[str], stream: bool, request, arrival: float) -> None:
        self.deliver, self.ids, self.stream, self.request, self.arrival = deliver, ids, stream, request, arrival
        self.last_token: dict[int, float] = {}  # completion index -> when its previous token came


class EngineLoop:
    """Owns an ``LLMEngine`` on one thread. ``submit`` queues sequences whose outputs (``RequestOutput``s, an
    ``Exception`` if the engine refused or failed one, then ``DONE``) go to a ``deliver`` callback, called on
    this thread (an asyncio caller passes ``loop.call_soon_threadsafe``-wrapped puts).

    ``metrics`` (a ``minifer.entrypoints.openai.metrics.ServerMetrics`` or None) is told of tokens and finished requests here,
    where they happen; ``stats()`` reads the engine's state on this thread, between steps."""

    def __init__(self, engine, metrics=None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.Queue = queue.Queue()
        self._routes: dict[str, _Route] = {}  # engine request id -> its route
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="minifer-engine", daemon=True)
        self.steps = 0
        self.aborted = 0  # engine requests aborted because their client went away
        self.peak_in_flight = 0  # most unfinished engine requests at once so far (the batching traffic allowed)
        self.prompt_tokens = self.generation_tokens = 0  # counters for /metrics

    def start(self) -> EngineLoop:
        self.engine.owner = self._thread  # from now on other threads get a clear error if they step it
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=30)

    def submit(self, seqs: list[Request], deliver: Deliver, stream: bool = True,
               arrival: float | None = None) -> None:
        """Queue sequences (``LLM.make_sequence``'s, validated). ``stream=False``: only the outputs in which a
        completion finished are delivered (a plain answer needs nothing else), so its handler wakes once per
        completion instead of at every step. ``arrival``: ``time.perf_counter()`` when the HTTP request came."""
        if self._stop.is_set() or not self.alive():
            deliver(stopped())
            deliver(DONE)
            return
        self._commands.put(("add", (seqs, deliver, stream, arrival or time.perf_counter()), None))

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", request_ids, None))

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The engine's ``stats()`` and this loop's counters, read on the engine thread between two steps (the
        engine's structures change during a step). Raises ``RuntimeError`` if the loop has stopped."""
        if not self.alive():
            raise RuntimeError("the engine loop has stopped")
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("stats", None, answer))
        return answer.result(timeout=timeout)

    # --- the thread -------------------------------------------------------------------------------------

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
            self._fail_all(stopped())
            self.engine.owner = None
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd is not None and cmd[0] == "add":
                    deliver = cmd[1][1]
                    deliver(stopped())
                    deliver(DONE)
                elif cmd is not None and cmd[0] == "stats":
                    cmd[2].set_exception(RuntimeError("the engine loop has stopped"))

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
            if not self.engine.has_unfinished_requests():
                trim_heap()

    def _apply(self, kind: str, items: Any, answer: concurrent.futures.Future | None) -> None:
        if kind == "abort":
            for rid in items:
                if rid in self.engine.requests:
                    route, now = self._routes.get(rid), time.perf_counter()
                    if self.metrics is not None and route is not None:  # its completions not finished yet
                        for seq in sequences_of(route.request):
                            if not seq.is_finished:
                                self.metrics.completion_finished(seq, "abort", now, route.arrival)
                    self.engine.abort_request(rid)
                    self.aborted += 1
                self._finish(rid)
            return
        if kind == "stats":
            traffic = self.engine.kv_cache_manager.prefix_cache_stats
            answer.set_result({**self.engine.stats(), "prompt_tokens": self.prompt_tokens,
                               "generation_tokens": self.generation_tokens,
                               "prefix_cache_queries_blocks": traffic.queries, "prefix_cache_hits_blocks": traffic.hits,
                               "block_size": self.engine.kv_cache_manager.block_size,
                               **({"spec_num_drafts": self.engine.speculator.stats.num_verifies}
                                  if self.engine.speculator is not None else {})})
            return
        seqs, deliver, stream, arrival = items
        added = []
        try:
            for seq in seqs:
                added.append(self.engine.add_sequence(seq))
        except Exception as e:  # noqa: BLE001 - nothing of this HTTP request runs, the others are untouched
            for request in added:
                self.engine.abort_request(request.request_id)
            refused = isinstance(e, (ValueError, TypeError)) and not isinstance(e, RequestError)
            deliver(RequestError(str(e), engine_error_param(str(e))) if refused else e)  # 400; anything else: 500
            deliver(DONE)
            return
        ids = [seq.request_id for seq in seqs]
        for seq, request in zip(seqs, added):
            self._routes[seq.request_id] = _Route(deliver, ids, stream, request, arrival)
            self.prompt_tokens += len(seq.prompt_token_ids)
            if self.metrics is not None:  # n once per request; all else per completion
                self.metrics.n.observe(seq.params.n)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - a bug in a step must not stop the server: fail what was in flight
            traceback.print_exc()
            self._fail_all(RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        self.steps += 1
        now = time.perf_counter()
        metrics = self.metrics
        if metrics is not None:
            metrics.iteration_tokens.observe(self.engine.step_tokens)
        for o in outputs:
            route = self._routes.get(o.request_id)
            if route is None:
                continue
            for c in o.outputs:
                if c.new_token_ids:
                    self.generation_tokens += len(c.new_token_ids)
                    if metrics is not None:  # TTFT at a completion's first token, then the gap of each step
                        last = route.last_token.get(c.index)
                        metrics.token_step(now - (route.arrival if last is None else last), first=last is None)
                        route.last_token[c.index] = now
                if c.finished() and metrics is not None:  # a completion counts when it ends, as vLLM's children
                    metrics.completion_finished(sequences_of(route.request)[c.index], c.finish_reason, now,
                                                route.arrival)
            if route.stream or o.finished or any(c.finished() for c in o.outputs):
                route.deliver(o)
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
            route = self._routes.get(rid)
            if route is not None:
                route.deliver(error)
            self._finish(rid)

    def _finish(self, rid: str) -> None:
        """Forget an engine request; its HTTP request is told ``DONE`` once all its siblings are done."""
        route = self._routes.pop(rid, None)
        if route is not None and not any(s in self._routes for s in route.ids):
            route.deliver(DONE)


__all__ = ["DONE", "EngineLoop"]
