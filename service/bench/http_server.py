"""The server side of `vitserve bench --http`: the loopback-only rule for `--url`, a `vitserve serve`
subprocess on a free loopback port, and the server's own /metrics read into per-stage means."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from service.bench.http_client import BenchError

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


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

# ---- the server's metrics ------------------------------------------------------------------------


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


def server_drops(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's count of connections it closed, or saw closed, without an answer to a request, by
    reason (`vitserve_connections_dropped_total`), summed over its fronts."""
    out: dict[str, float] = {}
    for sample in server_metrics(base_url, api_key):
        if sample.name == "vitserve_connections_dropped_total":
            reason = sample.labels.get("reason", "")
            out[reason] = out.get(reason, 0.0) + sample.value
    return out


def drops_between(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """What each reason's count grew by (reasons that did not grow left out)."""
    grown = {reason: int(n - before.get(reason, 0.0)) for reason, n in after.items()}
    return {reason: n for reason, n in sorted(grown.items()) if n > 0}


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
