"""uvicorn's HTTP/1.1 protocol (h11) with what a public endpoint needs below the application:

- a read timeout for a request's head: a connection that opens and sends nothing, or a request line and headers
  that trickle in (slowloris), or a TLS handshake sent to this plain-HTTP port, is answered 408 and closed after
  ``read_timeout`` seconds (uvicorn's own ``timeout_keep_alive`` covers only the idle time between two requests
  and is cancelled by the first byte of the next one). The body has its deadline in the application, which
  reads it;
- a bound on a request head's size, 16 KiB, whether it arrives in pieces (h11's own limit) or in one read
  (which h11 would accept whole), answered 431;
- a bound on open connections: past ``max_connections`` a new one is answered 503 and closed at once, before
  it can hold anything (uvicorn's ``limit_concurrency`` answers only once the request's head has arrived);
- every answer the protocol gives itself (a malformed request, an oversized head, a timeout, the bound) is a
  JSON body in OpenAI's error shape instead of uvicorn's plain text.
"""

from __future__ import annotations

import json
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_S = 2.0  # how long a connection answered by the protocol itself may stay half-open for its client to read
MAX_HEAD_BYTES = 16 * 1024  # h11's limit for a head still arriving, applied to the whole head however it is split


def head_bytes_in(tail: bytes, data: bytes) -> tuple[int, bytes]:
    """How many bytes of ``data`` belong to a request head still arriving, and the tail to carry to the next read.

    The head ends at its blank line, which may straddle two reads, so the search runs over the previous read's
    last 3 bytes too; what follows the blank line (a body) is not counted."""
    buf = tail + data
    end = buf.find(b"\r\n\r\n")
    return (len(data) if end < 0 else max(0, end - len(tail))), buf[-3:]


def error_response(status: HTTPStatus, message: str) -> bytes:
    """A whole HTTP/1.1 response with OpenAI's error body, closing the connection."""
    from minifer.entrypoints.openai.protocol import RequestError, error_body

    body = json.dumps({"error": error_body(RequestError(message, status=status))}).encode()
    head = (f"HTTP/1.1 {status.value} {status.phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class TimedH11Protocol(H11Protocol):
    """``H11Protocol`` with a read timeout for request heads and a connection bound (module docstring). Subclass
    it with other values of ``read_timeout`` and ``max_connections`` (``protocol_class``)."""

    read_timeout: float = 30.0
    max_connections: int = 1024

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_timer = None
        self._protocol_error = None
        next_event = self.conn.next_event

        def next_event_noting_errors():  # uvicorn answers h11's errors with a fixed 400 text
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._protocol_error = (str(e), e.error_status_hint)  # 431 for a long head
                raise

        self.conn.next_event = next_event_noting_errors
        self._head_seen, self._head_tail = 0, b""  # bytes of the request head now arriving, up to its blank line
        self._refused = len(self.connections) > self.max_connections
        if self._refused:
            self._answer(HTTPStatus.SERVICE_UNAVAILABLE, f"this server holds at most {self.max_connections} open "
                                                         "connections: try again later")
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.conn.their_state is h11.IDLE:  # between requests: these bytes are (part of) the next head
            counted, self._head_tail = head_bytes_in(self._head_tail, data)
            self._head_seen += counted
            if self._head_seen > MAX_HEAD_BYTES:
                self._answer(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                             f"invalid HTTP request: the request head is larger than {MAX_HEAD_BYTES // 1024} KiB")
                return
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head arrived: the application's body deadline takes over
            self._disarm()

    def on_response_complete(self) -> None:
        self._head_seen, self._head_tail = 0, b""
        if not self.transport.is_closing():
            self._arm()  # for the next request's head; handle_events disarms it if one is already buffered
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        reason, hint = self._protocol_error or (msg, 400)  # h11's other hint, 501, stays 400 as uvicorn answers it
        status = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE if hint == 431 else HTTPStatus.BAD_REQUEST
        self._answer(status, f"invalid HTTP request: {reason}")

    # --- helpers ---------------------------------------------------------------------------------------------

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if getattr(self, "_read_timer", None) is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        if self.conn.our_state is h11.IDLE:  # no answer begun on this connection: say why it closes
            self._answer(HTTPStatus.REQUEST_TIMEOUT, f"no complete request head within {self.read_timeout:g} s")
        else:
            self.transport.close()

    def _answer(self, status: HTTPStatus, message: str) -> None:
        """Answer and end the connection: close our side for writing, drop what the client still sends, and
        close fully once it has read the answer and closed (or after ``LINGER_S``). Closing at once with unread
        bytes in the socket would make the kernel reset it, and the client could lose the answer."""
        self._refused = True  # data_received drops what comes now
        self._disarm()
        self.transport.write(error_response(status, message))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


def protocol_class(read_timeout: float, max_connections: int) -> type[TimedH11Protocol]:
    return type("MiniferH11Protocol", (TimedH11Protocol,),
                {"read_timeout": read_timeout, "max_connections": max_connections})


__all__ = ["TimedH11Protocol", "error_response", "protocol_class"]
