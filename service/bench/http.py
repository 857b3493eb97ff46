"""`vitserve bench --http`: a bounded HTTP load benchmark of `vitserve serve` on loopback, against the
engine alone measured in this process on the same images.

The server is either started here (`vitserve serve` as a subprocess on 127.0.0.1) or an already running
one named by `--url`, which must resolve to a loopback address: this tool generates load, and it only
aims it at the machine it runs on. Each concurrency level sends one 448x448 JPEG per request
(`encoding_format: "base64"`, `dtype: "bfloat16"`), from C client threads on keep-alive connections,
until its request count or its time limit is reached. The engine-only reference loads the same model
with the server's settings (read from `/info`) into a `GraphRunner` and times preprocessing plus
`runner.encode`: a full batch for throughput, one image for latency (back to back, and each after a
`IDLE_GAP_S` pause, as a lone request's processes run).

Targets: throughput at saturation >= 0.95x the engine's; p50 at concurrency 1 at most 2 ms above the
engine's single-image latency.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import io
import ipaddress
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

DEFAULT_CONCURRENCY = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DEFAULT_REQUESTS_PER_LEVEL = 1024
DEFAULT_LEVEL_TIME_S = 30.0
GPU_MODEL, CPU_MODEL = "random:qwen2.5-vl-7b", "tiny-qwen2-vl"
IMAGE_SIDE = 448
THROUGHPUT_TARGET = 0.95  # HTTP images/s at saturation over engine-only images/s, at least
LATENCY_TARGET_MS = 2.0  # p50 at concurrency 1 minus engine-only single-image latency, at most
# The engine alone is also timed with this pause before each image: back to back its caches stay hot,
# while each of a server's processes handles a lone request after idling (2-core dev box: preprocessing
# one bench JPEG 1.20 ms back to back, 1.88 ms after a 6 ms sleep).
IDLE_GAP_S = 0.01
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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


# ---- the target --------------------------------------------------------------------------------


def check_loopback(url: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL whose host resolves to loopback addresses only; BenchError otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"--url must be an http(s) URL with a host, got {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise BenchError(f"--url host {parts.hostname!r} does not resolve ({exc}); only loopback is allowed") from None
    addresses = {info[4][0].split("%", 1)[0] for info in infos}
    foreign = sorted(a for a in addresses if not ipaddress.ip_address(a).is_loopback)
    if foreign or not addresses:
        raise BenchError(f"--url {url} resolves to {', '.join(foreign) or 'nothing'}: the load benchmark only "
                         "targets loopback addresses (127.0.0.0/8, ::1)")
    return parts.hostname, port


def get_json(url: str, api_key: str | None = None, timeout: float = 10) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with _NO_PROXY.open(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, OSError):
        return 0, None


def wait_ready(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"the server exited with {proc.returncode} before it was ready")
        if get_json(url + "/ready", timeout=2)[0] == 200:
            return
        time.sleep(0.2)
    raise BenchError(f"{url} was not ready after {timeout:.0f}s")


class ServerProcess:
    """`vitserve serve` on a free loopback port, started with only the given flags (no VITSERVE_* variables).
    `launcher`: what runs it (another entry point taking the same flags, e.g. `tools/front_cost.py`)."""

    def __init__(self, model: str, flags: Sequence[str], log_path: Path, ready_timeout_s: float,
                 launcher: Sequence[str] = ("-m", "service.cli", "serve")) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, *launcher, "--model", model, *flags,
                    "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
        with open(self.log_path, "wb") as log:  # a file, not a pipe: nobody has to drain it
            self.proc = subprocess.Popen(self.cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            _preload_engine()  # while the server starts: the reference needs the same heavy imports
            wait_ready(self.url, self.ready_timeout_s, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # drains: nothing is in flight by now
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def _preload_engine() -> None:
    import transformers  # noqa: F401 - presets build their configs with it

    import graphs.runner  # noqa: F401
    import models  # noqa: F401


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
    sent or `time_limit_s` has passed; requests in flight then finish. Throughput is successes over the
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


# Server-side histograms whose mean over a level shows where a request's time went ("name@phase": one
# phase of vitserve_request_phase_duration_seconds).
PHASES = "vitserve_request_phase_duration_seconds"
STAGES = {
    "request": "vitserve_request_duration_seconds",
    "body": f"{PHASES}@body",
    "parse": f"{PHASES}@parse",
    "prepare_wall": f"{PHASES}@prepare",  # worker waits, decoding and hops, until the last item is queued
    "engine_wall": f"{PHASES}@engine",  # queue, device and replies, until the last result is back
    "preprocess": "vitserve_preprocess_duration_seconds",
    "queue": "vitserve_queue_duration_seconds",
    "gpu_per_batch": "vitserve_gpu_duration_seconds",  # staged to written: includes the batch before it
    "device_per_batch": "vitserve_device_duration_seconds",
    # the engine's host steps per batch (the rest of gpu_per_batch is waiting for the device)
    "engine_stage": "vitserve_engine_step_duration_seconds@stage",
    "engine_launch": "vitserve_engine_step_duration_seconds@launch",
    "engine_write": "vitserve_engine_step_duration_seconds@write",
    "render": "vitserve_render_duration_seconds",
    "worker_wait": "vitserve_worker_wait_duration_seconds",  # per job: a request has two or more
    "items_per_batch": "vitserve_batch_items",
    "loop_lag": "vitserve_event_loop_lag_seconds",  # per 0.1 s sample: the front's event loop, late
}
# The share of those samples over 25 ms late (`loop_lag_over_25ms`): stalls long enough to leave a GPU
# without its next batch, which a mean of a few milliseconds can hide.
LOOP_LAG, LOOP_STALL_LE, LOOP_STALL_KEY = "vitserve_event_loop_lag_seconds", "0.025", "loop_lag_le_25ms"


def server_metrics(base_url: str, api_key: str | None = None) -> list[Any]:
    """The server's /metrics as sample lists ([] when unavailable)."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(base_url + "/metrics")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - loopback only (check_loopback)
            text = resp.read().decode()
    except OSError:
        return []
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def server_stage_totals(base_url: str, api_key: str | None = None) -> dict[str, tuple[float, float]]:
    """(sum, count) of each STAGES histogram from the server's /metrics, over all its fronts; {} when
    unavailable."""
    samples: dict[str, float] = {}
    for sample in server_metrics(base_url, api_key):
        if sample.name == f"{LOOP_LAG}_bucket" and sample.labels.get("le") == LOOP_STALL_LE:
            samples[LOOP_STALL_KEY] = samples.get(LOOP_STALL_KEY, 0.0) + sample.value
            continue
        label = sample.labels.get("phase") or sample.labels.get("step")
        labels = set(sample.labels) - {"phase", "step"}
        if labels <= {"front", "job"}:  # summed over fronts, and over jobs for worker_wait
            key = sample.name + (f"@{label}" if label else "")
            samples[key] = samples.get(key, 0.0) + sample.value
    totals = {}
    for stage, name in STAGES.items():
        metric, at, phase = name.partition("@")
        totals[stage] = (samples.get(f"{metric}_sum{at}{phase}", 0.0), samples.get(f"{metric}_count{at}{phase}", 0.0))
    if LOOP_STALL_KEY in samples:  # (samples on time or at most 25 ms late, all samples)
        totals[LOOP_STALL_KEY] = (samples[LOOP_STALL_KEY], totals["loop_lag"][1])
    if "process_cpu_seconds_total" in samples:  # with the time it was read: CPU seconds per second
        totals["cpu"] = (samples["process_cpu_seconds_total"], time.monotonic())
    return totals


def stage_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                wall_s: float | None = None) -> dict[str, float]:
    """Mean of each stage over the level (ms; items for items_per_batch), the share of the event loop's
    lag samples over 25 ms late (`loop_lag_over_25ms`), the server process's CPU use over it in cores
    (`cpu_cores`: near 1 with idle cores left means one thread, or the GIL, is the limit) and how busy
    its devices were over the level's `wall_s` (`device_busy`: device seconds per second, summed over
    the engines: at most their number)."""
    out = {}
    if "cpu" in before and "cpu" in after and after["cpu"][1] > before["cpu"][1]:
        # Over the level's wall time when given: the reads also span the client processes' start, idle.
        span = wall_s or after["cpu"][1] - before["cpu"][1]
        out["cpu_cores"] = round((after["cpu"][0] - before["cpu"][0]) / span, 2)
    if wall_s and "device_per_batch" in before and "device_per_batch" in after:
        out["device_busy"] = round((after["device_per_batch"][0] - before["device_per_batch"][0]) / wall_s, 3)
    if LOOP_STALL_KEY in before and LOOP_STALL_KEY in after:
        on_time = after[LOOP_STALL_KEY][0] - before[LOOP_STALL_KEY][0]
        samples = after[LOOP_STALL_KEY][1] - before[LOOP_STALL_KEY][1]
        if samples > 0:
            out["loop_lag_over_25ms"] = round(1 - on_time / samples, 3)
    for stage in STAGES:
        if stage not in before or stage not in after:
            continue
        total, count = after[stage][0] - before[stage][0], after[stage][1] - before[stage][1]
        if count > 0:
            scale = 1 if stage == "items_per_batch" else 1e3
            out[stage] = round(total / count * scale, 3)
    return out


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


# ---- the engine alone --------------------------------------------------------------------------


def engine_reference(images: Sequence[bytes], *, model: str, device: str, dtype: str, max_batch_tokens: int,
                     budgets: list[int] | None = None, max_batch_items: int | None = None, t_capture: int = 8,
                     eager: bool = False, workers: int = 2, single_reps: int = 20,
                     batch_reps: int = 5) -> dict[str, Any]:
    """Preprocessing (`preprocess_image_bytes`, in a pool of the server's worker count) plus
    `GraphRunner.encode` up to a device sync, the server's model and plan, same images. Throughput: one
    full batch (the largest budget's worth of these images); latency: one image. Outputs stay on the
    device (the server also converts them to bf16 and copies them to the host)."""
    import torch

    from graphs.runner import GraphRunner, plan_for
    from models import load_tower
    from service.engine.loading import bind_device

    tower = load_tower(model, device=device, dtype=dtype)
    dev = next(tower.parameters()).device
    bind_device(dev)  # captures and replays run on the current device's streams: cuda:1 must be current
    plan = plan_for(tower, max_batch_tokens, budgets, max_batch_items, t_capture)
    runner = GraphRunner(tower, dev, plan, use_graphs=not eager)
    runner.capture()
    try:
        with torch.inference_mode():
            times = _time_engine(runner, images, workers, single_reps, batch_reps)
    finally:
        graphs = len(runner.pool.graphs)
        del runner, tower  # the server shares this device: give the memory back before the load
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": str(dev), "dtype": dtype, "graphs": graphs, **times,
            "single_reps": single_reps, "batch_reps": batch_reps}


def _time_engine(runner: Any, images: Sequence[bytes], workers: int, single_reps: int,
                 batch_reps: int) -> dict[str, Any]:
    import torch

    from service.media.image_preprocess import preprocess_image_bytes

    proc, dev = runner.tower.processor, runner.device

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def prep(data: bytes):
        return preprocess_image_bytes(data, proc)

    tokens = prep(images[0]).num_tokens(runner.tower.merge)
    n = max(1, min(runner.plan.max_items, runner.plan.max_budget // tokens))
    batch_bytes = [images[i % len(images)] for i in range(n)]

    def single(i: int, idle_s: float = 0.0) -> tuple[float, float]:
        time.sleep(idle_s)
        t0 = time.perf_counter()
        item = prep(images[i % len(images)])
        t1 = time.perf_counter()
        runner.encode([item])
        sync()
        return t1 - t0, time.perf_counter() - t1

    with ThreadPoolExecutor(max(1, workers)) as pool:
        def batch() -> tuple[float, float]:
            t0 = time.perf_counter()
            items = list(pool.map(prep, batch_bytes))
            t1 = time.perf_counter()
            runner.encode(items)
            sync()
            return t1 - t0, time.perf_counter() - t1

        for i in range(min(3, single_reps)):  # warm-up
            single(i)
        batch()
        singles = [single(i) for i in range(single_reps)]
        after_idle = [single(i, IDLE_GAP_S) for i in range(single_reps)]
        batches = [batch() for _ in range(batch_reps)]

    def med(values: list[float]) -> float:
        return statistics.median(values) * 1e3

    single_ms = med([a + b for a, b in singles])
    batch_ms = med([a + b for a, b in batches])
    return {
        "tokens_per_image": tokens,
        "single_ms": round(single_ms, 3), "single_preprocess_ms": round(med([a for a, _ in singles]), 3),
        "single_encode_ms": round(med([b for _, b in singles]), 3),
        "single_after_idle_ms": round(med([a + b for a, b in after_idle]), 3),
        "single_after_idle_preprocess_ms": round(med([a for a, _ in after_idle]), 3),
        "batch_images": n, "batch_ms": round(batch_ms, 3),
        "batch_preprocess_ms": round(med([a for a, _ in batches]), 3),
        "batch_encode_ms": round(med([b for _, b in batches]), 3),
        "images_per_s": round(n / batch_ms * 1e3, 3),
        "encode_only_images_per_s": round(n / med([b for _, b in batches]) * 1e3, 3),
    }


# ---- the whole run -----------------------------------------------------------------------------


def engine_counts(base_url: str, api_key: str | None) -> dict[str, tuple[float, float]]:
    """engine -> (batches, items): per GPU behind one front (`vitserve_engine_*`), else per front."""
    gpus: dict[str, list[float]] = {}
    fronts: dict[str, list[float]] = {}
    for sample in server_metrics(base_url, api_key):
        if sample.name in ("vitserve_engine_batches_total", "vitserve_engine_items_total"):
            gpus.setdefault(f"gpu {sample.labels['gpu']}", [0.0, 0.0])[sample.name.endswith("items_total")] += \
                sample.value
        elif sample.name in ("vitserve_batch_items_count", "vitserve_batch_items_sum") and "front" in sample.labels:
            fronts.setdefault(f"front {sample.labels['front']}", [0.0, 0.0])[sample.name.endswith("_sum")] += \
                sample.value
    return {k: (v[0], v[1]) for k, v in (gpus or fronts).items()}


def items_per_batch(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    out = {}
    for gpu, (batches, items) in after.items():
        b0, i0 = before.get(gpu, (0, 0))
        out[gpu] = round((items - i0) / (batches - b0), 2) if batches > b0 else 0.0
    return out


def targets(levels: list[dict[str, Any]], engine: dict[str, Any], replicas: int = 1) -> dict[str, Any]:
    """The two target ratios. With `replicas` engines in the server (`--data-parallel`), the throughput
    reference is that many times the one engine measured here (linear scaling)."""
    best = max(levels, key=lambda lv: lv["images_per_s"])
    reference = engine["images_per_s"] * replicas
    ratio = best["images_per_s"] / reference if reference else None
    steady = best.get("steady_images_per_s")
    steady_ratio = steady / reference if reference and steady is not None else None
    lowest = min(levels, key=lambda lv: lv["concurrency"])
    overhead = lowest["p50_ms"] - engine["single_ms"] if lowest["p50_ms"] is not None else None
    after_idle = engine.get("single_after_idle_ms")
    overhead_idle = lowest["p50_ms"] - after_idle if lowest["p50_ms"] is not None and after_idle else None
    return {
        "saturation": {"concurrency": best["concurrency"], "images_per_s": best["images_per_s"]},
        "engine_replicas": replicas,
        "reference": "the engine alone" if replicas == 1 else
                     f"the engine alone on one GPU, times {replicas} (linear scaling over --data-parallel {replicas})",
        "throughput_ratio": round(ratio, 3) if ratio is not None else None,
        "throughput_ratio_target": THROUGHPUT_TARGET,
        "throughput_ratio_met": ratio is not None and ratio >= THROUGHPUT_TARGET,
        "steady_throughput_ratio": round(steady_ratio, 3) if steady_ratio is not None else None,
        "latency_concurrency": lowest["concurrency"],
        "latency_p50_ms": lowest["p50_ms"],
        "latency_overhead_ms": round(overhead, 3) if overhead is not None else None,
        "latency_overhead_target_ms": LATENCY_TARGET_MS,
        "latency_overhead_met": overhead is not None and overhead <= LATENCY_TARGET_MS,
        "latency_overhead_after_idle_ms": round(overhead_idle, 3) if overhead_idle is not None else None,
    }


def environment() -> dict[str, Any]:
    import torch

    env = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__,
           "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        env["cpu"] = platform.processor()
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def run(*, model: str | None = None, url: str | None = None, concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
        requests_per_level: int = DEFAULT_REQUESTS_PER_LEVEL, level_time_s: float = DEFAULT_LEVEL_TIME_S,
        max_batch_tokens: int = 16384, serve_flags: Sequence[str] = (), out: Path | None = None,
        distinct_images: int = 4, warmup_requests: int = 8, single_reps: int = 20, batch_reps: int = 5,
        ready_timeout_s: float = 900, client: str = "http.client", client_processes: int = 1,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole benchmark; returns (and writes to `out`, when given) the result document."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    levels_wanted = sorted(set(concurrency))
    if not levels_wanted or levels_wanted[0] < 1 or requests_per_level < 1 or level_time_s <= 0:
        raise BenchError("concurrency levels, --requests-per-level and the level time must be positive")
    Poster("http://127.0.0.1", None, 1, client).close()  # an unknown or missing client fails here, not in 256 threads
    api_key = None
    if url is not None:
        check_loopback(url)
        url = url.rstrip("/")
        api_key = os.environ.get("VITSERVE_API_KEY") or None
    images = bench_images(distinct_images)
    bodies = [request_body(img) for img in images]
    json_path = output_path(out)

    def measure(base_url: str, spawned: list[str] | None) -> dict[str, Any]:
        status, info = get_json(base_url + "/info", api_key)
        if status != 200 or not isinstance(info, dict):
            raise BenchError(f"GET {base_url}/info answered {status or 'nothing'} (set VITSERVE_API_KEY?)")
        s = info.get("settings", {})
        if model and spawned is None and s.get("model") != model:
            raise BenchError(f"--model {model} but the server at {base_url} serves {s.get('model')}")
        server = {"url": base_url, "spawned": spawned is not None, "command": spawned, "model": s.get("model"),
                  "family": info.get("family"), "device": info.get("device"), "dtype": info.get("dtype"),
                  "settings": {k: s.get(k) for k in ("max_batch_tokens", "budgets", "max_batch_items", "max_wait_ms",
                                                     "preprocess_workers", "eager", "t_capture", "data_parallel")},
                  # one per front (each front's /info shows its own share of the settings), or behind one front
                  "engines": int((info.get("front") or {}).get("of") or s.get("data_parallel") or 1)}
        # With several engines (--data-parallel) the reference is one engine on the first of their devices,
        # counted as many times (linear scaling): `targets` says so.
        first_device = str(info["device"]).split(",")[0]
        log(f"server: {server['model']} on {server['device']} ({server['dtype']}); engine-only reference on "
            f"{first_device} ...")
        engine = engine_reference(
            images, model=str(s["model"]), device=first_device, dtype=str(info["dtype"]),
            max_batch_tokens=int(s["max_batch_tokens"]), budgets=s.get("budgets"),
            max_batch_items=s.get("max_batch_items"), t_capture=int(s.get("t_capture") or 8),
            eager=bool(s.get("eager")), workers=int(s.get("preprocess_workers") or 2), single_reps=single_reps,
            batch_reps=batch_reps)
        log(f"engine: {engine['images_per_s']:.1f} images/s ({engine['batch_images']} per batch), "
            f"{engine['single_ms']:.2f} ms for one image")
        workload = {"distinct_images": len(images), "width": IMAGE_SIDE, "height": IMAGE_SIDE, "format": "JPEG",
                    "jpeg_bytes": [len(i) for i in images], "encoding_format": "base64", "dtype": "bfloat16",
                    **check_response(base_url, bodies[0], api_key, client)}
        for i in range(warmup_requests):  # one at a time, cycling through the images
            check_response(base_url, bodies[i % len(bodies)], api_key, client)
        levels = []
        for c in levels_wanted:
            before = server_stage_totals(base_url, api_key)
            engines_before = engine_counts(base_url, api_key)
            level = run_level(base_url, bodies, c, requests_per_level, level_time_s, api_key, client=client,
                              processes=min(client_processes, c))
            level["server_ms"] = stage_means(before, server_stage_totals(base_url, api_key), level["elapsed_s"])
            level["items_per_batch_by_engine"] = items_per_batch(engines_before, engine_counts(base_url, api_key))
            levels.append(level)
            log(f"c={c:4d}: {level['images_per_s']:9.1f} images/s ({level['steady_images_per_s']} steady)  "
                f"p50 {level['p50_ms']} ms  p90 {level['p90_ms']} "
                f"ms  p99 {level['p99_ms']} ms  errors {sum(level['errors'].values())} ({level['stopped_by']}); "
                f"in flight {level['in_flight_mean']} (clients late {level['start_late_s']} s); "
                f"server means {level['server_ms']}")
        return {"server": server, "workload": workload, "engine": engine, "levels": levels}

    limits = {"concurrency": levels_wanted, "requests_per_level": requests_per_level, "level_time_s": level_time_s,
              "client_processes": client_processes,
              "warmup_requests": warmup_requests, "engine_single_reps": single_reps, "engine_batch_reps": batch_reps}
    if url is None:
        name = model or default_model()
        # The encoder-output cache off: the benchmark repeats a few images and measures the engine's path.
        flags = ["--max-batch-tokens", str(max_batch_tokens), "--cache-bytes", "0", *serve_flags]
        if json_path is not None:
            log_path = json_path.with_name(json_path.stem + ".server.log")
        else:
            fd, tmp = tempfile.mkstemp(prefix="vitserve-http-bench-", suffix=".server.log")
            os.close(fd)
            log_path = Path(tmp)
        with ServerProcess(name, flags, log_path, ready_timeout_s) as srv:
            log(f"started {shlex.join(srv.cmd)} (log: {log_path})")
            body = measure(srv.url, srv.cmd)
    else:
        body = measure(url, None)
    result = {"env": {**environment(), "client": client_name(client)}, "limits": limits, **body,
              "targets": targets(body["levels"], body["engine"], body["server"]["engines"])}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
    print_summary(result)
    return result


def default_model() -> str:
    import torch

    return GPU_MODEL if torch.cuda.is_available() else CPU_MODEL


def output_path(out: Path | None) -> Path | None:
    """`--out x.json` is the file; any other `--out` is a folder holding http_bench.json. A spawned
    server's log goes next to it (`<stem>.server.log`), or to a temporary file without `--out`."""
    if out is None:
        return None
    path = out if out.suffix == ".json" else out / "http_bench.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def print_summary(result: dict[str, Any]) -> None:
    e, t = result["engine"], result["targets"]
    print(f"{'concurrency':>11} {'images/s':>10} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} {'errors':>7}")
    for lv in result["levels"]:
        print(f"{lv['concurrency']:>11} {lv['images_per_s']:>10.1f} {lv['p50_ms'] or 0:>9.2f} "
              f"{lv['p90_ms'] or 0:>9.2f} {lv['p99_ms'] or 0:>9.2f} {sum(lv['errors'].values()):>7}")
    print(f"engine only: {e['images_per_s']:.1f} images/s (batch of {e['batch_images']}), {e['single_ms']:.2f} ms "
          "for one image (preprocessing included)")
    print(f"throughput at saturation / engine: {t['throughput_ratio']} (target >= {THROUGHPUT_TARGET}: "
          f"{'met' if t['throughput_ratio_met'] else 'missed'}); after the level's first quarter: "
          f"{t['steady_throughput_ratio']}")
    best = next(lv for lv in result["levels"] if lv["concurrency"] == t["saturation"]["concurrency"])
    if best["stopped_by"] == "requests":
        print(f"note: the c={best['concurrency']} level stopped after {best['requests']} requests "
              f"({best['elapsed_s']:.1f} s), start included: for a throughput at saturation, give the levels "
              "time (--level-time-s) and a --requests-per-level they do not reach")
    print(f"p50 at concurrency {t['latency_concurrency']} - engine single image: {t['latency_overhead_ms']} ms "
          f"(target <= {LATENCY_TARGET_MS} ms: {'met' if t['latency_overhead_met'] else 'missed'})")
    if t.get("latency_overhead_after_idle_ms") is not None:
        print(f"  against the engine timed after {IDLE_GAP_S * 1e3:.0f} ms idle ({e['single_after_idle_ms']:.2f} ms): "
              f"{t['latency_overhead_after_idle_ms']} ms")


def run_from_args(args: argparse.Namespace) -> int:
    """`vitserve bench --http ...`: 0 when every request succeeded, 1 with errors, 2 when it cannot run."""
    try:
        levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else DEFAULT_CONCURRENCY
        result = run(model=args.model, url=args.url, concurrency=levels,
                     requests_per_level=args.requests_per_level or DEFAULT_REQUESTS_PER_LEVEL,
                     level_time_s=args.level_time_s or DEFAULT_LEVEL_TIME_S, max_batch_tokens=args.max_batch_tokens,
                     serve_flags=shlex.split(args.serve_flags or ""), out=args.out,
                     client_processes=getattr(args, "client_processes", None) or 1)
    except (BenchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if any(lv["errors"] for lv in result["levels"]) else 0
