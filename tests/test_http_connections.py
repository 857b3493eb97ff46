"""Connections the server closes, or sees closed, without an answer: each one logged with its reason and
counted in `vitserve_connections_dropped_total{reason}`; and no request dropped because its connection's
keep-alive deadline passed while it waited to be read.

The app is the real one (its engine never started: /health answers without a model), under the server's
own uvicorn protocol and uvloop, as served, on a real loopback socket.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
import uvloop
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from service.http.app import create_app
from service.http.server import uvicorn_config
from tests.http_helpers import settings

KEEP_ALIVE_S = 0.5
HEAD_TIMEOUT_S = 1.0
HOLD_S = 2 * KEEP_ALIVE_S + 0.5
GET = b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n"


class Served:
    """The app on uvloop in a thread."""

    def __init__(self) -> None:
        cfg = settings(keep_alive_timeout_s=KEEP_ALIVE_S, header_timeout_s=HEAD_TIMEOUT_S, log_level="info")
        self.app = create_app(cfg, start_engine=False)

        async def broken() -> StreamingResponse:
            async def parts() -> Iterator[bytes]:
                yield b"a first part"
                raise RuntimeError("a failure once the response has started")

            return StreamingResponse(parts())

        async def echo(request: Request) -> Response:
            return Response(await request.body())

        self.app.add_api_route("/broken", broken)
        self.app.add_api_route("/echo", echo, methods=["POST"])
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn_config(self.app, cfg, log_level="warning", access_log=False)
        config.load()
        served = config.http_protocol_class

        class Holding(served):  # type: ignore[valid-type, misc]
            """`HOLD` from a client holds the loop inside a socket's read callback, as a busy process does."""

            def data_received(self, data: bytes) -> None:
                if data == b"HOLD":
                    time.sleep(HOLD_S)
                    return
                super().data_received(data)

        config.http_protocol_class = Holding
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(self.server.serve(sockets=[self.sock]))

    def dropped(self) -> dict[str, float]:
        text = self.app.state.service.metrics.render().decode()
        return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "vitserve_connections_dropped_total"}

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    srv = Served()
    srv.thread.start()
    deadline = time.monotonic() + 30
    while not srv.server.started:
        assert time.monotonic() < deadline and srv.thread.is_alive(), "the test server did not start"
        time.sleep(0.01)
    yield srv
    srv.server.should_exit = True
    srv.thread.join(30)
    srv.sock.close()


def response(conn: socket.socket) -> bytes:
    """One response read whole (by its Content-Length), or what came before the connection ended."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_request_waiting_as_the_keep_alive_deadline_passes_is_answered(served):
    """The loop is held past the keep-alive deadline while the next request already waits in the socket
    (a busy process): uvloop runs the expired timer before it polls the sockets again, and the connection
    must not close under the request."""
    with served.connect() as conn, served.connect() as other:
        conn.sendall(GET)
        assert response(conn).startswith(b"HTTP/1.1 200")
        other.sendall(b"HOLD")  # the loop is held from now
        time.sleep(0.2)
        conn.sendall(GET)  # before the deadline; read only after it
        assert response(conn).startswith(b"HTTP/1.1 200")
        conn.sendall(GET)  # the connection still serves
        assert response(conn).startswith(b"HTTP/1.1 200")


def test_an_idle_connection_is_closed_logged_and_counted(served, caplog):
    caplog.set_level(logging.DEBUG, "vitserve.http")
    before = served.dropped()
    with served.connect() as conn:
        conn.sendall(GET)
        assert response(conn).startswith(b"HTTP/1.1 200")
        assert conn.recv(1) == b""  # closed by the server after the keep-alive timeout
    wait_for(lambda: served.dropped().get("idle_timeout", 0) == before.get("idle_timeout", 0) + 1)
    with served.connect() as conn:  # sends nothing
        assert conn.recv(1) == b""
    wait_for(lambda: served.dropped().get("no_request", 0) == before.get("no_request", 0) + 1)
    lines = [r for r in caplog.records if "dropped without a response" in r.getMessage()]
    assert [r.levelno for r in lines] == [logging.DEBUG] * 2
    assert "[idle_timeout]" in lines[0].getMessage() and "[no_request]" in lines[1].getMessage()


def test_a_client_gone_mid_request_is_logged_and_counted(served, caplog):
    caplog.set_level(logging.INFO, "vitserve.http")
    before = served.dropped().get("client_closed", 0)
    with served.connect() as conn:
        conn.sendall(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\nhalf a body")
        time.sleep(0.2)
    with served.connect() as conn:  # half a head, then a reset
        conn.sendall(b"GET /health HTTP/1.1\r\nHo")
        time.sleep(0.2)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    wait_for(lambda: served.dropped().get("client_closed", 0) == before + 2)
    lines = [r.getMessage() for r in caplog.records if "dropped without a response" in r.getMessage()]
    assert len(lines) == 2 and all("[client_closed]" in line for line in lines), lines
    assert "closed it" in lines[0] and "reset it (ConnectionResetError)" in lines[1], lines


def test_a_response_cut_by_the_server_is_logged_and_counted(served, caplog):
    caplog.set_level(logging.INFO, "vitserve.http")
    before = served.dropped().get("aborted", 0)
    with served.connect() as conn:
        conn.sendall(b"GET /broken HTTP/1.1\r\nHost: test\r\n\r\n")
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and not data.endswith(b"0\r\n\r\n")  # cut: no last chunk
    wait_for(lambda: served.dropped().get("aborted", 0) == before + 1)
    (line,) = [r for r in caplog.records if "dropped without a response" in r.getMessage()]
    assert line.levelno == logging.WARNING and "[aborted]" in line.getMessage()


def test_answered_connections_are_not_counted(served):
    before = served.dropped()
    with served.connect() as conn:
        conn.sendall(GET.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        assert response(conn).startswith(b"HTTP/1.1 200")
        assert conn.recv(1) == b""
    with served.connect() as conn:  # a head over a bound: refused with a response, then closed
        conn.sendall(b"GET /" + b"x" * 10000 + b" HTTP/1.1\r\nHost: test\r\n\r\n")
        assert response(conn).startswith(b"HTTP/1.1 414")
    with served.connect() as conn:  # answered, then closed by the client while idle
        conn.sendall(GET)
        assert response(conn).startswith(b"HTTP/1.1 200")
    time.sleep(0.3)
    assert served.dropped() == before
