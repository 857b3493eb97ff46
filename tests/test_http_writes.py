"""Large response bodies written by writer threads (service/http/writes.py), through the server's own
uvicorn protocol on a real loopback socket, under uvloop (as served) and asyncio's own loop."""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from service.http import writes
from service.http.responses import PartsResponse
from service.http.server import uvicorn_config
from tests.http_helpers import settings

BIG = 3 << 20


def parts_for(path: str) -> list[bytes]:
    """A response in parts as /encode sends them: small pieces around large ones."""
    seed = int(path.strip("/") or 0)
    big = bytes((seed + i) % 251 for i in range(256)) * (BIG // 256)
    return [b'{"head":1,"data":[', big, b",", big[: 1 << 20], b'],"tail":' + str(seed).encode() + b"}"]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await PartsResponse(parts_for(scope["path"]), "application/octet-stream")(scope, receive, send)


class Served:
    def __init__(self, loop: str) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, settings(), log_level="warning", access_log=False))
        self.loop = loop
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if self.loop == "uvloop":
            import uvloop

            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                runner.run(self.server.serve(sockets=[self.sock]))
        else:
            asyncio.run(self.server.serve(sockets=[self.sock]))

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.connect(("127.0.0.1", self.port))
        return s


@pytest.fixture(params=["uvloop", "asyncio"])
def served(request: Any) -> Iterator[Served]:
    srv = Served(request.param)
    srv.thread.start()
    deadline = time.monotonic() + 30
    while not srv.server.started:
        assert time.monotonic() < deadline and srv.thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    yield srv
    srv.server.should_exit = True
    srv.thread.join(15)
    srv.sock.close()


@pytest.fixture
def thread_writes(monkeypatch: Any) -> list[tuple[str, int, int]]:
    """(thread name, bytes given, bytes left) of every writer-thread write."""
    seen: list[tuple[str, int, int]] = []
    real = writes.write_once

    def recorded(fd: int, buffers: list[memoryview]) -> Any:
        given = sum(len(b) for b in buffers)
        left, error = real(fd, buffers)
        seen.append((threading.current_thread().name, given, sum(len(b) for b in left)))
        return left, error

    monkeypatch.setattr(writes, "write_once", recorded)
    return seen


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of the next response (with a Content-Length) on `sock`."""
    f = sock.makefile("rb")  # buffered: bytes it reads ahead stay with `sock`'s later calls only here
    lines = []
    while (line := f.readline()) not in (b"\r\n", b""):
        lines.append(line)
    assert lines, "the connection closed before the response head"
    length = next(int(v.split(b":")[1]) for v in lines if v.lower().startswith(b"content-length"))
    body = f.read(length)
    assert len(body) == length, f"the connection closed after {len(body)} of {length} body bytes"
    return b"".join(lines), body


def request(path: str, close: bool = False) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\n" + ("Connection: close\r\n" if close else "") + "\r\n").encode()


def test_large_bodies_arrive_whole_and_in_order_from_writer_threads(served: Served, thread_writes: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    for i in range(4):  # one kept-alive connection
        conn.request("GET", f"/{i}")
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.read() == b"".join(parts_for(f"/{i}"))
    conn.close()
    deadline = time.monotonic() + 5  # a thread records its write after the client may have read it
    while len(thread_writes) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Each response went to the kernel in one hand-over: head and every part, small ones included.
    whole = [given for _, given, _ in thread_writes]
    assert len(whole) == 4 and all(given > len(b"".join(parts_for("/0"))) for given in whole)
    assert all(name.startswith("vitserve-write-") for name, _, _ in thread_writes)


def test_pipelined_requests_get_their_responses_in_order(served: Served, thread_writes: list) -> None:
    with served.connect() as s:
        s.sendall(request("/1") + request("/2") + request("/3"))
        f = s.makefile("rb")
        for i in (1, 2, 3):
            lines = []
            while (line := f.readline()) != b"\r\n":
                lines.append(line)
            length = next(int(v.split(b":")[1]) for v in lines if v.lower().startswith(b"content-length"))
            assert f.read(length) == b"".join(parts_for(f"/{i}"))


def test_a_client_that_reads_late_gets_every_byte(served: Served, thread_writes: list) -> None:
    """The socket takes only part of the body at once: the transport sends the rest as the client reads."""
    with served.connect(rcvbuf=4096) as s:
        s.sendall(request("/5"))
        time.sleep(0.5)  # not reading: the thread's one pass fills the buffers and hands the rest back
        _, body = read_response(s)
        assert body == b"".join(parts_for("/5"))
        s.sendall(request("/6"))  # the connection serves on
        assert read_response(s)[1] == b"".join(parts_for("/6"))
    assert thread_writes and thread_writes[0][2] > 0, "the socket took the whole body at once: nothing was left"


def test_connection_close_waits_for_the_body(served: Served, thread_writes: list) -> None:
    """uvicorn closes the transport right after the last part; the close waits for the writer thread."""
    with served.connect(rcvbuf=4096) as s:
        s.sendall(request("/7", close=True))
        time.sleep(0.3)
        _, body = read_response(s)
        assert body == b"".join(parts_for("/7"))
        assert s.recv(1) == b""  # then the server closed the connection


def test_a_client_gone_mid_body_leaves_the_server_serving(served: Served, thread_writes: list) -> None:
    for _ in range(3):
        s = served.connect(rcvbuf=4096)
        s.sendall(request("/8"))
        s.recv(1024)  # the response started
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # reset, with most of the body unread
    time.sleep(0.3)
    with served.connect() as s:
        s.sendall(request("/9"))
        assert read_response(s)[1] == b"".join(parts_for("/9"))
    # Nothing of the reset connections is left open on the server's side.
    deadline = time.monotonic() + 10
    while len(served.server.server_state.connections) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(served.server.server_state.connections) == 0


def test_small_writes_of_one_turn_leave_in_one_system_call(monkeypatch: Any) -> None:
    """Below THREAD_BYTES, a turn's writes (a response's head and parts) reach the transport joined."""
    loop = asyncio.new_event_loop()
    written: list[bytes] = []

    class Transport:
        def write(self, data: bytes) -> None:
            written.append(bytes(data))

        def is_closing(self) -> bool:
            return False

        def get_write_buffer_size(self) -> int:
            return 0

        def close(self) -> None:
            written.append(b"<closed>")

    t = writes.ThreadedWrites(Transport(), loop)  # type: ignore[arg-type]
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")
    t.write(memoryview(b'{"a":'))
    t.write(b"1}")
    t.close()
    assert written == []  # nothing before the end of the turn
    loop.call_soon(loop.stop)
    loop.run_forever()
    loop.close()
    assert written == [b'HTTP/1.1 200 OK\r\n\r\n{"a":1}', b"<closed>"]


def test_the_writer_thread_closes_its_descriptor() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    fd = os.dup(a.fileno())
    left, error = writes.write_once(fd, [memoryview(b"abc")])
    assert (left, error) == ([], None) and b.recv(3) == b"abc"
    with pytest.raises(OSError):
        os.fstat(fd)
    a.close()
    b.close()


def test_a_failing_write_drops_its_connection_and_the_writers_serve_on(served: Served, monkeypatch: Any) -> None:
    """A bug in a write must not end the writer thread nor leave its client waiting for ever."""
    real = writes.write_once
    broken = {"left": 1}

    def failing_once(fd: int, buffers: list[memoryview]) -> Any:
        if broken["left"]:
            broken["left"] -= 1
            os.close(fd)
            raise ValueError("a bug")
        return real(fd, buffers)

    monkeypatch.setattr(writes, "write_once", failing_once)
    with served.connect() as s:
        s.settimeout(10)
        s.sendall(request("/1"))
        data = b""
        while chunk := s.recv(1 << 20):  # the server drops the connection
            data += chunk
        assert len(data) < len(b"".join(parts_for("/1")))
    for _ in range(2 * writes.WRITER_THREADS):  # every writer thread still writes
        with served.connect() as s:
            s.sendall(request("/2"))
            assert read_response(s)[1] == b"".join(parts_for("/2"))
