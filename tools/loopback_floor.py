"""The floor of one lone /encode answer on this host, with no model and no server logic: an 80 KB request
body in, a prebuilt 2.4 MB JSON answer (one Qwen2.5-VL-7B 448x448 image, bf16, base64) out, over
loopback, through uvicorn (httptools, uvloop) and through bare sockets; plus two host steps a real
render adds (read 1.8 MB from /dev/shm, base64 it).

    OUT=out python3 tools/loopback_floor.py [port]

Use it on a new host before reading `vitserve bench --http`'s c=1 figure: it is that figure's floor there.

What `vitserve bench --http`'s c=1 target ("p50 at most 2 ms above the engine alone") leaves for
everything else, since the engine alone pays none of this. Prints one JSON object, also written to
$OUT/loopback_floor.json.
"""

import base64
import http.client
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

BODY_OUT = b'{"data":[{"embedding":"' + base64.b64encode(os.urandom(1806336)) + b'"}]}'
BODY_IN = json.dumps({"input": base64.b64encode(os.urandom(60000)).decode()}).encode()

APP = r'''
import sys, uvicorn
sys.path.insert(0, sys.argv[2])
from loopback_floor import BODY_OUT as body  # the answer the client checks, built once
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    more = True
    while more:
        msg = await receive()
        more = msg.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", http="httptools", log_level="warning")
'''


def p50(xs):
    return round(statistics.median(xs) * 1e3, 3)


def http_floor(port: int, n: int = 300, gap: float = 0.01) -> dict:
    proc = subprocess.Popen([sys.executable, "-c", APP, str(port), os.path.dirname(os.path.abspath(__file__))])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", port)
        times = []
        for i in range(n + 20):
            t = time.perf_counter()
            conn.request("POST", "/encode", BODY_IN, {"Content-Type": "application/json"})
            data = conn.getresponse().read()
            if i >= 20:
                times.append(time.perf_counter() - t)
            assert len(data) == len(BODY_OUT)
            time.sleep(gap)
        return {"p50_ms": p50(times), "p90_ms": round(sorted(times)[int(0.9 * len(times))] * 1e3, 3)}
    finally:
        proc.kill()


def socket_floor(n: int = 300, gap: float = 0.01) -> dict:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        c, _ = srv.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            got = 0
            while got < len(BODY_IN):
                chunk = c.recv(1 << 20)
                if not chunk:
                    os._exit(0)
                got += len(chunk)
            c.sendall(BODY_OUT)
    cl = socket.create_connection(("127.0.0.1", port))
    cl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for i in range(n + 20):
        t = time.perf_counter()
        cl.sendall(BODY_IN)
        got = 0
        while got < len(BODY_OUT):
            got += len(cl.recv(1 << 21))
        if i >= 20:
            times.append(time.perf_counter() - t)
        time.sleep(gap)
    cl.close()
    os.kill(pid, 9)
    return {"p50_ms": p50(times)}


def host_steps(n: int = 200, gap: float = 0.01) -> dict:
    import pybase64

    sys.path.insert(0, os.getcwd())
    from service.shm import keep_freed_memory  # noqa: E402 - after the path

    keep_freed_memory()
    raw = os.urandom(1806336)
    path = "/dev/shm/loopback-floor-probe"
    with open(path, "wb") as f:
        f.write(raw)
    buf = bytearray(len(raw))
    reads, b64s = [], []
    for _ in range(n):
        t = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        os.preadv(fd, [buf], 0)
        os.close(fd)
        t2 = time.perf_counter()
        pybase64.b64encode(buf)
        t3 = time.perf_counter()
        reads.append(t2 - t)
        b64s.append(t3 - t2)
        time.sleep(gap)
    os.unlink(path)
    return {"pread_1_8MB_ms": p50(reads), "base64_1_8MB_ms": p50(b64s)}


if __name__ == "__main__":
    out = {"host": platform.uname()._asdict(), "proc_version": open("/proc/version").read().strip(),
           "answer_bytes": len(BODY_OUT), "request_bytes": len(BODY_IN),
           "http_uvicorn": http_floor(int(sys.argv[1]) if len(sys.argv) > 1 else 43999),
           "tcp_socket": socket_floor(), "host_steps": host_steps()}
    print(json.dumps(out))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "loopback_floor.json"), "w") as f:
            json.dump(out, f, indent=1)
