"""Real servers on loopback for the HTTP tests: uvicorn in a thread (in-process) or in a subprocess."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import uvicorn
from PIL import Image

from service.engine.core import Engine
from service.http.app import create_app
from service.http.server import uvicorn_config
from service.metrics import Metrics
from service.settings import ServeSettings
from service.shm import POOL, SHM_DIR

ROOT = Path(__file__).resolve().parents[1]
# The encoder-output cache is off: most tests send the same media again and mean the engine to run it
# (tests/test_http_cache.py turns it on).
TEST_DEFAULTS: dict[str, Any] = dict(
    model="tiny-qwen2-vl", device="cpu", dtype="float32", max_batch_tokens=1024, preprocess_workers=2,
    log_level="warning", request_timeout_s=60, cache_bytes=0,
)


def settings(**overrides: Any) -> ServeSettings:
    return ServeSettings.from_sources({}, env={}, **{**TEST_DEFAULTS, **overrides})


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A noisy picture (so every pixel matters) in an encoded format."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if channels == 1 else arr, mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `create_app(settings)` from a background thread, on a free loopback port."""

    def __init__(self, cfg: ServeSettings, engine: Engine | None = None, wait_ready: bool = True) -> None:
        self.settings = cfg
        self.metrics = engine.metrics if engine else Metrics()
        self.engine = engine or Engine(cfg, self.metrics)
        self.app = create_app(cfg, engine=self.engine, metrics=self.metrics)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        # The server's own uvicorn configuration (its HTTP protocol and limits), less the logging.
        config = uvicorn_config(self.app, cfg, log_level="warning", timeout_graceful_shutdown=5, access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="test-uvicorn", daemon=True)
        self.wait_ready = wait_ready

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        if self.wait_ready:
            wait_ready(self.url, engine=self.engine)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)


def slow_engine(monkeypatch: Any, seconds: float) -> None:
    """Every batch of the in-process engines waits `seconds` before it runs (for admission, timeout and
    drain tests: work stays in flight)."""
    from service.engine import executor

    start = executor.BatchExecutor.start

    def slow_start(self: Any, job: Any) -> Any:
        time.sleep(seconds)
        return start(self, job)

    monkeypatch.setattr(executor.BatchExecutor, "start", slow_start)


def wait_ready(url: str, timeout: float = 120, proc: subprocess.Popen | None = None,
               engine: Engine | None = None) -> None:
    """Until /ready answers 200; fails at once when the server process exits or its engine failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        if engine is not None and engine.state == "failed":
            raise RuntimeError(f"the engine failed to start: {engine.load_error}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout}s")


class SubprocessServer:
    """`python -m service.http.server` in its own process (for signals), on a free loopback port."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, model: str | None = "tiny-qwen2-vl",
                 batch_delay_ms: float = 0, host: str = "127.0.0.1", port: int | None = None,
                 launcher: str | None = None, log_path: Path | None = None) -> None:
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        defaults = ["--device", "cpu", "--dtype", "float32", "--max-batch-tokens", "1024",
                    "--preprocess-workers", "2", "--log-level", "info", "--host", host, "--cache-bytes", "0"]
        if model is not None:
            defaults += ["--model", model]
        # A slow engine is a test-only launcher, never a server flag (tests/hooks/slow_server.py); so are a
        # hosts file (tests/hooks/hosts.py) and the broken paths of tests/hooks/broken_paths.py (`launcher`).
        module = launcher or ("tests.hooks.slow_server" if batch_delay_ms else "service.http.server")
        self.cmd = [sys.executable, "-m", module, *defaults, "--port", str(self.port), *flags]
        self.log_path = log_path  # the server's output goes there instead of a pipe (a long test's logs)
        # Only this test's VITSERVE_* variables reach the server.
        base = {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")}
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**base, "PYTHONPATH": path, "OMP_NUM_THREADS": "2", **(env or {}),
                    "VITSERVE_TEST_BATCH_DELAY_MS": str(batch_delay_ms)}
        self.proc: subprocess.Popen | None = None

    def start(self) -> SubprocessServer:
        """The process, without waiting for it to be ready (servers that start side by side)."""
        # A session of its own: `terminate(group=True)` signals its processes and not the tests'.
        out = open(self.log_path, "w") if self.log_path is not None else subprocess.PIPE  # noqa: SIM115
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=out,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        if self.log_path is not None:
            out.close()  # type: ignore[union-attr]
        return self

    def __enter__(self) -> SubprocessServer:
        self.start()
        assert self.proc is not None
        wait_ready(self.url, proc=self.proc)
        return self

    def run_to_exit(self, timeout: float = 60) -> tuple[int, str]:
        """For settings the server must refuse: run it and return (exit code, output)."""
        proc = subprocess.run(self.cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr

    def terminate(self, group: bool = False) -> None:
        """SIGTERM to the server, or to each of its processes (`group`: what systemd's default stop, an init
        that forwards to the group, or `pkill` do)."""
        assert self.proc is not None
        if group:
            os.killpg(self.proc.pid, signal.SIGTERM)
        else:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60) -> tuple[int, str]:
        assert self.proc is not None
        out, _ = self.proc.communicate(timeout=timeout)
        if self.log_path is not None:
            out = self.log_path.read_text()
        return self.proc.returncode, out

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=30)


class QuietHandler(BaseHTTPRequestHandler):
    """Base of the fake peers: `reply` sends a whole body with its length; nothing is logged."""

    def reply(self, status: int, body: bytes, content_type: str | None = None) -> None:
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # the client hung up: expected in these tests
            super().handle_error(request, client_address)


@contextmanager
def loopback_http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[ThreadingHTTPServer]:
    """A plain HTTP server on 127.0.0.1 and a free port, in a thread, for fake peers (vLLM, media hosts)."""
    httpd = _QuietServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.shutdown()
        httpd.server_close()


def server_url(httpd: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{httpd.server_address[1]}"


def shm_entries(prefix: str, pools: bool = True) -> list[str]:
    """What /dev/shm holds under names starting with `prefix`: segments, and (unless `pools` is False) the
    pools of retired files that a serving front keeps (service.shm.retire)."""
    return sorted(p.name for p in SHM_DIR.glob(f"{prefix}*") if pools or not p.name.endswith(f"_{POOL}"))
