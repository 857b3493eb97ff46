"""The HTTP/1.1 protocol the server runs: uvicorn's httptools protocol with bounds on each request's head.

uvicorn bounds neither the size nor the duration of a request head with httptools (only its h11
protocol has `h11_max_incomplete_event_size`, and no deadline either): httptools joins the pieces of
a header line as they arrive and hands the line over only once it ends, so before any route or API
key check a client could make the server hold a 50 MB header, or keep a connection for ever by
sending a byte every few seconds. This subclass bounds, before the app sees anything:

- the head's size: at most `max_bytes` reach the parser before the head ends;
- each line of it: the request target, and each header field (name and value), `max_line_bytes`;
- its field count, `max_fields`;
- its duration: `timeout_s` from the connection's start (or from the first byte of a later request on
  a kept-alive connection) to the end of the head.

Over a size bound the client gets 431 (Request Header Fields Too Large; 414 for the request target),
over the deadline 408 (a connection that sent nothing is closed silently), and the connection is
closed either way. Beyond `max_connections` open connections a request is answered 503 with
`Retry-After` and its connection closed, except `GET /health`, so that a liveness probe does not
restart a server that is merely busy. Error bodies have the API's JSON error shape.

Every connection closed without an answer to a request is logged with its reason and counted
(`on_drop`, the `vitserve_connections_dropped_total{reason}` counter):

- `idle_timeout`: a kept-alive connection idle for `--keep-alive-timeout-s` (logged at DEBUG: routine);
- `no_request`: a connection that sent nothing within `--header-timeout-s` (DEBUG);
- `client_closed`: the client closed or reset it with a request unanswered (INFO: its doing);
- `aborted`: the server gave up on it mid-request or mid-response, e.g. after an error once the
  response had started (WARNING).

Closing an idle connection races a request sent at that moment: the client's request is then reset,
and it sees a dropped connection (httpx `ReadError`) for a request the server never read. Under
uvloop, which runs expired timers before it polls the sockets, this happened whenever the loop was
held (a busy process, GC, a stop) past the keep-alive deadline with the next request already in the
socket. So an idle connection is closed only when nothing waits to be read on it; and the default
keep-alive timeout sits above common clients' own idle expiry (see the setting), so that in the
ordinary case the client closes first.

Large response bodies are written by a writer thread (`writes.ThreadedWrites`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import select
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from service.engine.types import new_error_id
from service.http.writes import ThreadedWrites

log = logging.getLogger("vitserve.http")


@dataclass(frozen=True)
class HeadLimits:
    max_bytes: int = 64 * 1024
    max_line_bytes: int = 8 * 1024
    max_fields: int = 100
    timeout_s: float = 10.0
    max_connections: int = 1024


class HeadRefused(Exception):
    """Raised from a parser callback to stop parsing a head over a bound (the parser then fails)."""


def error_body(type_: str, code: str, message: str, error_id: str | None = None) -> bytes:
    error: dict[str, Any] = {"type": type_, "message": message, "index": None, "code": code}
    if error_id:
        error["error_id"] = error_id
    return json.dumps({"error": error}).encode()


async def _too_many_connections(error_id: str, scope: Any, receive: Any, send: Any) -> None:
    """The ASGI app that answers in the app's place while the server holds too many connections."""
    body = error_body("overloaded", "too_many_connections",
                      "the server holds too many open connections (--max-connections): retry later", error_id)
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


DROP_LEVELS = {"idle_timeout": logging.DEBUG, "no_request": logging.DEBUG, "client_closed": logging.INFO,
               "aborted": logging.WARNING}


def _readable(transport: asyncio.BaseTransport) -> bool:
    """Whether bytes (or the peer's close) wait to be read on the transport's socket."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return False


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` with `limits` on every request head and a record of every connection closed
    without an answer (see the module docstring)."""

    limits = HeadLimits()
    on_drop: Callable[[str], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0  # bytes of the current head fed to the parser; None: past the head
        self._head_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str, str] | None = None  # why a parser callback stopped the head
        self._begun = 0  # requests whose first byte came
        self._answered = 0  # of those, answered in full (or refused with a response)
        self._closed_by_us: str | None = None  # why this side closed the connection, once it did

    # ---- connection -----------------------------------------------------------------------
    transport: ThreadedWrites  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(ThreadedWrites(transport, self.loop))  # type: ignore[arg-type]
        self._start_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._begun > self._answered or self._head_bytes:
            if self._closed_by_us is None and not self.transport.closed_here:
                how = f"reset it ({type(exc).__name__})" if exc is not None else "closed it"
                self._dropped("client_closed", f"the client {how} with a request unanswered")
            elif self._closed_by_us != "answered":
                why = self._closed_by_us or "the app stopped mid-request or mid-response (see the error above)"
                self._dropped("aborted", f"the server closed it with a request unanswered: {why}")
        super().connection_lost(exc)

    def _dropped(self, reason: str, why: str) -> None:
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.log(DROP_LEVELS[reason], "connection from %s dropped without a response [%s]: %s", client, reason, why)
        if self.on_drop is not None:
            self.on_drop(reason)

    def _close_idle(self, reason: str, why: str) -> None:
        """Close a connection that has no request in progress, unless its next one is already waiting to
        be read: then the loop reads it next (the timer only came first)."""
        if _readable(self.transport):
            return
        self._closed_by_us = reason
        self._dropped(reason, why)
        self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        self.timeout_keep_alive_task = None
        if self.transport.is_closing():
            return
        if _readable(self.transport):  # read next; the keep-alive clock starts again if it was not a request
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)
            return
        self._close_idle("idle_timeout", f"idle for {self.timeout_keep_alive:g}s (--keep-alive-timeout-s)")

    def shutdown(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._closed_by_us = "shutdown"
        super().shutdown()

    def on_response_complete(self) -> None:
        self._answered = min(self._answered + 1, self._begun)
        if self.transport.is_closing():  # Connection: close after this response
            self._closed_by_us = "answered"
        super().on_response_complete()

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is None:  # a body: bounded by the app (--max-payload-bytes)
            super().data_received(data)
            return
        room = self.limits.max_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        # Feed no more than the bound; whatever follows the head's end in this chunk goes on after.
        self._head_bytes += room
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._head_bytes is not None and self._head_bytes >= self.limits.max_bytes:
            self._refuse(431, "header_too_large", f"the request head is over {self.limits.max_bytes} bytes "
                                                  "(--max-header-bytes)")
            return
        self.data_received(data[room:])

    # ---- parser callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._begun += 1
        super().on_message_begin()
        if self._head_timer is None:  # a later request on a kept-alive connection: its own deadline
            self._start_head_timer()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.limits.max_line_bytes:
            self._stop(414, "uri_too_long", f"the request target is over {self.limits.max_line_bytes} bytes "
                                            "(--max-header-line-bytes)")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > self.limits.max_line_bytes:
            self._stop(431, "header_too_large", f"a header field is over {self.limits.max_line_bytes} bytes "
                                                "(--max-header-line-bytes)")
        if len(self.headers) >= self.limits.max_fields:
            self._stop(431, "too_many_headers", f"the request has over {self.limits.max_fields} header fields "
                                                "(--max-header-fields)")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._cancel_head_timer()
        # Open connections include this one. uvicorn's own limit_concurrency would answer in plain text.
        busy = len(self.connections) > self.limits.max_connections and self.url.split(b"?")[0] != b"/health"
        self.app = self.config.loaded_app
        if busy:
            error_id = new_error_id()
            self.app = functools.partial(_too_many_connections, error_id)
            log.warning("answered 503 (too_many_connections), error id %s: %d open connections "
                        "(--max-connections %d)", error_id, len(self.connections), self.limits.max_connections)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes = 0  # whatever comes next on this connection is the next request's head

    # ---- refusals -------------------------------------------------------------------------
    def _stop(self, status: int, code: str, message: str) -> None:
        self._refusal = (status, code, message)
        raise HeadRefused(message)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a parser error; one raised by `_stop` gets its own status instead."""
        if self._refusal is None:
            self._answered, self._head_bytes, self._closed_by_us = self._begun, None, "answered"
            super().send_400_response(msg)
            return
        self._refuse(*self._refusal)

    def _refuse(self, status: int, code: str, message: str) -> None:
        self._cancel_head_timer()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.warning("refused the request head from %s with %d: %s", client, status, message)
        body = error_body("timeout" if status == 408 else "invalid_request", code, message)
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n", b"content-length: ", str(len(body)).encode(), b"\r\n",
                 b"connection: close\r\n\r\n"]
        self._answered, self._head_bytes, self._closed_by_us = self._begun, None, "answered"
        self.transport.write(b"".join(head) + body)
        self.transport.close()

    # ---- the head's deadline --------------------------------------------------------------
    def _start_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._head_bytes is None:
            return
        if self._head_bytes == 0:  # nothing sent (an idle or pre-opened connection): just close it
            self._close_idle("no_request", f"nothing sent within {self.limits.timeout_s:g}s (--header-timeout-s)")
            return
        self._refuse(408, "header_timeout", f"the request head took over {self.limits.timeout_s:g}s "
                                            "(--header-timeout-s)")


def limited_protocol(limits: HeadLimits,
                     on_drop: Callable[[str], None] | None = None) -> type[LimitedHttpToolsProtocol]:
    """A protocol class with these limits, for `uvicorn.Config(http=...)` (uvicorn builds one per connection);
    `on_drop(reason)` is called for each connection closed without an answer."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,),
                {"limits": limits, "on_drop": staticmethod(on_drop) if on_drop else None})
