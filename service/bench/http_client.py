"""The load side of `vitserve bench --http`: seeded bench JPEGs, the keep-alive client (`Poster`), and one
concurrency level (`run_level`) run from threads, or from several client processes that start together."""

from __future__ import annotations

import http.client
import io
import json
import platform
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

IMAGE_SIDE = 448


class BenchError(RuntimeError):
    """The benchmark cannot run (bad --url, server not ready); the CLI exits with 2."""


# ---- inputs ------------------------------------------------------------------------------------


def bench_images(count: int = 4, side: int = IMAGE_SIDE, seed: int = 0) -> list[bytes]:
    """Distinct seeded JPEGs: smooth colour fields plus mild noise, so sizes look like photos, not noise."""
    from PIL import Image

    out = []
    for i in range(count):
        rng = np.random.default_rng(seed + i)
        coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((side, side),
                                                                                         Image.Resampling.BICUBIC)
        arr = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (side, side, 3))
        buf = io.BytesIO()
        Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def request_body(image: bytes) -> bytes:
    import base64

    body = {"items": [{"type": "image", "image": base64.b64encode(image).decode("ascii")}],
            "encoding_format": "base64", "dtype": "bfloat16"}
    return json.dumps(body).encode()

# ---- clients -----------------------------------------------------------------------------------


class Poster:
    """One keep-alive connection posting prepared bodies to /encode.

    The default client is the standard library's `http.client` (what urllib uses underneath, without
    urllib's connection per request): it reads a 2.4 MB answer (one Qwen2.5-VL-7B image in bf16, base64)
    in about 1.3 ms of client CPU where httpx 0.28 took about 11 ms on the same loopback server, which
    would swamp the 5 ms latency target and cap the load one process can generate. `client="httpx"`
    is kept for comparison."""

    def __init__(self, base_url: str, api_key: str | None, timeout: float, client: str = "http.client") -> None:
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.parts = urlsplit(base_url)
        self.timeout = timeout
        self.httpx: Any = None
        self.conn: http.client.HTTPConnection | None = None
        if client == "httpx":
            import httpx

            self.httpx = httpx.Client(base_url=base_url, timeout=timeout, headers=self.headers, trust_env=False)
        elif client != "http.client":
            raise BenchError(f"client must be http.client or httpx, got {client!r}")

    def post(self, body: bytes) -> tuple[int, bytes]:
        if self.httpx is not None:
            r = self.httpx.post("/encode", content=body)
            return r.status_code, r.content
        if self.conn is None:
            cls = http.client.HTTPSConnection if self.parts.scheme == "https" else http.client.HTTPConnection
            self.conn = cls(self.parts.hostname or "127.0.0.1", self.parts.port, timeout=self.timeout)
        try:
            self.conn.request("POST", self.parts.path.rstrip("/") + "/encode", body, self.headers)
            resp = self.conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException):
            self.conn.close()  # the next request reconnects
            self.conn = None
            raise

    def close(self) -> None:
        if self.httpx is not None:
            self.httpx.close()
        elif self.conn is not None:
            self.conn.close()


# Names of the exceptions that mean the connection ended without a whole response to a request sent
# on it: the server dropped it (or reset it), whatever the client library. A refused connection is not
# one (nothing was sent); a timeout is not either (the client gave up).
DROPPED = frozenset({"ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError", "RemoteDisconnected",
                     "IncompleteRead", "BadStatusLine", "ReadError", "WriteError", "RemoteProtocolError"})


def dropped(errors: dict[str, int]) -> int:
    """How many of the errors (by exception name or status) are dropped connections (`DROPPED`)."""
    return sum(n for name, n in errors.items() if name in DROPPED)


def client_name(client: str) -> str:
    if client == "httpx":
        import httpx

        return f"httpx {httpx.__version__}"
    return f"http.client (Python {platform.python_version()})"


def percentiles_ms(latencies: Sequence[float]) -> dict[str, float | None]:
    if not latencies:
        return {"p50_ms": None, "p90_ms": None, "p99_ms": None, "mean_ms": None, "max_ms": None}
    arr = np.asarray(latencies) * 1e3
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50_ms": round(float(p50), 3), "p90_ms": round(float(p90), 3), "p99_ms": round(float(p99), 3),
            "mean_ms": round(float(arr.mean()), 3), "max_ms": round(float(arr.max()), 3)}


def run_level(base_url: str, bodies: Sequence[bytes], concurrency: int, max_requests: int, time_limit_s: float,
              api_key: str | None = None, timeout_s: float = 120, client: str = "http.client",
              processes: int = 1) -> dict[str, Any]:
    """C threads, each on its own connection, send requests back to back until `max_requests` have been
    sent or `time_limit_s` has passed; requests in flight then finish. `errors` counts failures by HTTP
    status or exception name; `dropped_connections` is the part of them whose connection ended without a
    response (`DROPPED`), a server fault even where the client's retry would hide it. Throughput is successes over the
    wall time from the common start to the last answer; that wall time includes the start, when every
    client waits for its first answer at once, and the end, when fewer requests are in flight, so
    `steady_images_per_s` also counts only the successes from a quarter of the time limit on to its end
    (levels stopped by time). `client_cpu_util` is the clients' CPU time over
    that wall time, per client process: near 1, a client process itself may be the bottleneck; then
    spread the threads over several `processes` (they start together, at one agreed time)."""
    shares = [(concurrency * (k + 1)) // processes - (concurrency * k) // processes for k in range(processes)]
    quotas = [(max_requests * (k + 1)) // processes - (max_requests * k) // processes for k in range(processes)]
    args = [(base_url, bodies, c, q, time_limit_s, api_key, timeout_s, client)
            for c, q in zip(shares, quotas) if c > 0]
    if len(args) == 1:
        parts = [_client_threads(*args[0], start=lambda: time.time() + 0.2)]
    else:
        parts = _client_processes(args, wait_s=time_limit_s + timeout_s + 60)
    start_at = parts[0]["start_at"]  # the same in every part
    latencies = [x for p in parts for x in p["latencies"]]
    errors: Counter[str] = Counter()
    for p in parts:
        errors.update(p["errors"])
    issued = sum(p["issued"] for p in parts)
    wall = max(p["end"] for p in parts) - start_at
    cpu = sum(p["cpu"] for p in parts)
    stopped_by = "requests" if issued >= max_requests else "time"
    # Little's law: the requests in flight on average. Well under `concurrency`, the clients spent time
    # between requests (or started late: `start_late_s`), and the level measured them, not the server.
    in_flight = sum(latencies) / wall if wall > 0 else None
    steady = steady_rate([t for p in parts for t in p["ends"]], start_at + time_limit_s / 4,
                         start_at + time_limit_s) if stopped_by == "time" else None
    return {"concurrency": concurrency, "requests": issued, "ok": len(latencies), "errors": dict(errors),
            "dropped_connections": dropped(errors),
            "elapsed_s": round(wall, 4), "images_per_s": round(len(latencies) / wall, 3) if wall > 0 else 0.0,
            "steady_images_per_s": steady, **percentiles_ms(latencies), "stopped_by": stopped_by,
            "client_cpu_util": round(cpu / wall / len(parts), 3) if wall > 0 else None,
            "in_flight_mean": round(in_flight, 1) if in_flight is not None else None,
            "start_late_s": round(max(p["late_s"] for p in parts), 3)}


def steady_rate(ends: Sequence[float], start: float, stop: float) -> float | None:
    """Successes per second among those that ended within [start, stop) (wall-clock times)."""
    if stop <= start:
        return None
    return round(sum(start <= t < stop for t in ends) / (stop - start), 3)


def _client_processes(args: list[tuple[Any, ...]], wait_s: float) -> list[dict[str, Any]]:
    """Runs each share of a level in its own process. The start time is agreed only once every process
    has imported its modules and built its threads: a start fixed beforehand came up to 2 s late on a
    loaded host (each spawned process imports the main module, hence torch), and a level then measured
    fewer clients than it named."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    built = ctx.Barrier(len(args) + 1)
    go = ctx.Event()
    start_value = ctx.Value("d", 0.0)
    results = ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(a, built, go, start_value, results), daemon=True) for a in args]
    for proc in procs:
        proc.start()
    try:
        try:
            built.wait(120)
        except threading.BrokenBarrierError as exc:
            raise BenchError("the client processes did not start within 120 s") from exc
        start_value.value = time.time() + 0.2
        go.set()
        try:
            parts = [results.get(timeout=wait_s) for _ in procs]
        except queue.Empty as exc:
            raise BenchError(f"a client process sent no result within {wait_s:.0f} s") from exc
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return parts


def _client_process(args: tuple[Any, ...], built: Any, go: Any, start_value: Any, results: Any) -> None:
    def start() -> float:
        built.wait(120)
        go.wait(120)
        return start_value.value

    results.put(_client_threads(*args, start=start))


def _client_threads(base_url: str, bodies: Sequence[bytes], concurrency: int, max_requests: int, time_limit_s: float,
                    api_key: str | None, timeout_s: float, client: str, start: Callable[[], float]) -> dict[str, Any]:
    """One client process's share of a level. Once its threads are built, `start()` gives the agreed
    start time (wall clock), which every process shares."""
    lock = threading.Lock()
    issued = 0
    latencies: list[float] = []
    ends: list[float] = []  # wall-clock time of each success
    errors: Counter[str] = Counter()
    ready = threading.Barrier(concurrency + 1)
    go = threading.Event()
    deadline = 0.0

    def worker() -> None:
        nonlocal issued
        poster = Poster(base_url, api_key, timeout_s, client)
        try:
            ready.wait(60)
            go.wait()
            while True:
                with lock:
                    if issued >= max_requests or time.time() >= deadline:
                        return
                    i = issued
                    issued += 1
                t0 = time.perf_counter()
                try:
                    status, _ = poster.post(bodies[i % len(bodies)])
                except Exception as exc:  # counted, never fatal: a load test reports its failures
                    with lock:
                        errors[type(exc).__name__] += 1
                    continue
                elapsed = time.perf_counter() - t0
                with lock:
                    if status == 200:
                        latencies.append(elapsed)
                        ends.append(time.time())
                    else:
                        errors[str(status)] += 1
        finally:
            poster.close()

    threads = [threading.Thread(target=worker, name=f"bench-{k}", daemon=True) for k in range(concurrency)]
    for t in threads:
        t.start()
    ready.wait(60)  # every client is built: creating 256 of them is not part of the measurement
    start_at = start()
    deadline = start_at + time_limit_s
    time.sleep(max(0.0, start_at - time.time()))
    cpu0 = time.process_time()
    started = time.time()
    go.set()
    for t in threads:
        t.join()
    return {"latencies": latencies, "ends": ends, "errors": dict(errors), "issued": issued, "end": time.time(),
            "cpu": time.process_time() - cpu0, "start_at": start_at, "late_s": started - start_at}


def check_response(base_url: str, body: bytes, api_key: str | None, client: str = "http.client") -> dict[str, Any]:
    """One request, fully checked: 200, one item, bfloat16 bytes matching the announced shape."""
    import base64

    poster = Poster(base_url, api_key, 300, client)
    try:
        status, data = poster.post(body)
    finally:
        poster.close()
    if status != 200:
        raise BenchError(f"warm-up request failed with HTTP {status}: {data[:300]!r}")
    entry = json.loads(data)["data"][0]
    raw = base64.b64decode(entry["embedding"])
    if entry["dtype"] != "bfloat16" or len(raw) != 2 * int(np.prod(entry["shape"])):
        raise BenchError(f"unexpected response: dtype {entry['dtype']}, shape {entry['shape']}, {len(raw)} bytes")
    return {"grid_thw": entry["grid_thw"], "tokens_per_image": entry["num_tokens"], "shape": entry["shape"],
            "response_bytes": len(data)}
