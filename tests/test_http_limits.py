"""Bounds the HTTP protocol puts on request heads and connections, before any route or API key check:
431/414 over a size bound, 408 past the head's deadline, 503 over the open connections, and the
server's memory and service unaffected by clients that send huge or endless heads."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from tests.http_helpers import ServerThread, SubprocessServer, b64, image_bytes, settings

BODY = {"items": [{"type": "image", "image": b64(image_bytes(64, 48, seed=4))}], "encoding_format": "base64"}
HEAD = b"GET /health HTTP/1.1\r\nHost: t\r\n"


def connect(port: int, timeout: float = 10) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as a close)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def send_all(sock: socket.socket, parts: Iterator[bytes]) -> bool:
    """Send until done or the server closes; True if the server cut the stream short."""
    try:
        for part in parts:
            sock.sendall(part)
    except (BrokenPipeError, ConnectionResetError):
        return True
    return False


def huge_header(total: int, chunk: int = 1 << 20, end: bool = True) -> Iterator[bytes]:
    """A GET /health whose one header value is `total` bytes, generated as it is sent."""
    yield HEAD + b"X-Huge: "
    for _ in range(total // chunk):
        yield b"a" * chunk
    if end:
        yield b"\r\n\r\n"


@pytest.fixture(scope="module")
def server():
    with ServerThread(settings(max_header_fields=20, max_header_line_bytes=4096, max_header_bytes=32768,
                               header_timeout_s=1.0)) as srv:
        yield srv


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


@pytest.mark.parametrize("head,status,code", [
    (HEAD + b"X-Big: " + b"v" * 5000 + b"\r\n\r\n", 431, "header_too_large"),
    (HEAD + b"".join(b"X-%d: 1\r\n" % i for i in range(25)) + b"\r\n", 431, "too_many_headers"),
    (HEAD + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 3000) for i in range(15)) + b"\r\n", 431, "header_too_large"),
    (b"GET /" + b"p" * 5000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", 414, "uri_too_long"),
], ids=["long line", "too many fields", "head too large", "long target"])
def test_a_head_over_a_bound_is_refused_and_closed(server, head, status, code):
    with connect(server.port) as sock:
        sock.sendall(head)
        reply = answer(sock)
    assert status_of(reply) == status, reply[:200]
    assert b"connection: close" in reply.lower()
    assert f'"code": "{code}"'.encode() in reply
    assert httpx.get(server.url + "/health").status_code == 200


def test_heads_within_the_bounds_are_served(server):
    headers = {f"X-{i}": "v" * 2000 for i in range(12)}  # 24 KiB in 19 fields with httpx's, lines under 4 KiB
    assert httpx.get(server.url + "/health", headers=headers).status_code == 200
    with httpx.Client(base_url=server.url) as c:  # one kept-alive connection, several heads
        for _ in range(3):
            assert c.post("/encode", json=BODY, headers=headers).status_code == 200


def test_a_slow_head_gets_408_and_an_idle_connection_is_closed(server):
    with connect(server.port) as slow, connect(server.port) as idle:
        slow.sendall(HEAD + b"X-Slow: ")
        start = time.monotonic()
        assert status_of(answer(slow)) == 408
        assert answer(idle) == b""  # sent nothing: closed without a word
        assert time.monotonic() - start < 5


def test_many_slow_or_huge_heads_do_not_hold_up_a_normal_request(server):
    with ExitStack() as stack:
        # Slow clients: each sends part of a head and then waits.
        slow = [stack.enter_context(connect(server.port)) for _ in range(40)]
        for sock in slow:
            sock.sendall(HEAD + b"X-Slow: ")
        # Huge unfinished heads, sent at the same time from threads.
        huge = [stack.enter_context(connect(server.port)) for _ in range(10)]
        senders = [threading.Thread(target=send_all, args=(s, huge_header(8 << 20, end=False))) for s in huge]
        for t in senders:
            t.start()
        start = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=10) as c:
            assert c.get("/health").status_code == 200
            assert c.post("/encode", json=BODY).status_code == 200
        assert time.monotonic() - start < 3
        for t in senders:
            t.join(10)
        assert all(status_of(answer(s)) == 431 for s in huge)


def test_connections_over_the_limit_get_503_but_health_answers(caplog):
    with ServerThread(settings(max_connections=4)) as srv, ExitStack() as stack:
        for _ in range(4):
            stack.enter_context(connect(srv.port))
        time.sleep(0.2)  # let the server accept them
        with caplog.at_level(logging.WARNING, logger="vitserve"):
            r = httpx.post(srv.url + "/encode", json=BODY)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "too_many_connections"
        assert len([rec for rec in caplog.records if error["error_id"] in rec.getMessage()]) == 1
        assert httpx.get(srv.url + "/health").status_code == 200
        stack.close()
        time.sleep(0.2)
        assert httpx.post(srv.url + "/encode", json=BODY).status_code == 200


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextmanager
def peak_rss(pid: int) -> Iterator[list[int]]:
    """Samples the process's resident memory every 10 ms while the block runs; yields the samples."""
    samples = [rss_bytes(pid)]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(rss_bytes(pid))
            time.sleep(0.01)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's memory from /proc")
def test_huge_heads_leave_the_servers_memory_alone():
    """The server process as deployed: a 50 MB header and ten unfinished 40 MB ones, all at once."""
    with SubprocessServer("--log-level", "warning") as srv:
        assert srv.proc is not None
        for _ in range(3):  # warm the paths a request takes before measuring
            httpx.post(srv.url + "/encode", json=BODY, timeout=30)
        with peak_rss(srv.proc.pid) as samples, ExitStack() as stack:
            socks = [stack.enter_context(connect(srv.port)) for _ in range(11)]
            jobs = [huge_header(50 << 20)] + [huge_header(40 << 20, end=False) for _ in range(10)]
            senders = [threading.Thread(target=send_all, args=(s, j)) for s, j in zip(socks, jobs)]
            for t in senders:
                t.start()
            for t in senders:
                t.join(60)
            replies = [answer(s) for s in socks]
            assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        # Refused (431) or closed; never served.
        assert all(r == b"" or status_of(r) == 431 for r in replies), [r[:80] for r in replies]
        growth = max(samples) - samples[0]
    assert growth < 16 << 20, f"the server grew by {growth / 2**20:.1f} MiB"
