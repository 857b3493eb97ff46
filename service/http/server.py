"""`vitserve serve`: flags, settings, logging, and uvicorn with a drain on SIGTERM.

With several fronts (`--fronts`), this process binds the port and supervises one front process per
engine (`run_fronts`; fronts.py says how they share the port, /metrics and /ready).

On the first SIGTERM (or Ctrl-C) the server keeps listening: /ready turns 503 and new /encode calls
get 503 while admitted requests run to completion (at most --request-timeout-s); a replica of a ring
(--replicas, --replicas-from) then keeps answering the LLM server's encoder-cache fetches until they stop
(`Peers.linger`, within the same bound); then uvicorn shuts down gracefully and the process exits 0. A
second signal exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from types import FrameType
from typing import Any

import uvicorn

from graphs.budgets import BudgetError, BudgetPlan
from models.presets import DEFAULT_MODEL
from service.engine.core import Engine
from service.http.app import create_app
from service.http.fronts import FrontRole, bind_unix, unix_socket_paths
from service.http.protocol import HeadLimits, limited_protocol
from service.http.service import Service
from service.metrics import Metrics
from service.preflight import EXIT_FAILED, EXIT_SETTINGS, StartupError, preflight
from service.settings import ServeSettings, SettingsError, add_serve_arguments
from service.shm import exit_when_orphaned, keep_freed_memory

log = logging.getLogger("vitserve.server")

def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    flags = {name: getattr(args, name, None) for name in ServeSettings.model_fields}
    return ServeSettings.from_sources(flags)


def configure_logging(level: str, process: str = "") -> None:
    """Log lines on stderr; `process` names this process in each line where several serve (fronts)."""
    numeric = logging.DEBUG if level == "trace" else getattr(logging, level.upper(), logging.INFO)
    where = f" {process}" if process else ""
    logging.basicConfig(level=numeric, format=f"%(asctime)s %(levelname)s{where} %(name)s: %(message)s", force=True)
    # httpx logs every request at INFO: the fronts' metrics reads and every media URL fetch
    logging.getLogger("httpx").setLevel(max(numeric, logging.WARNING))


def check_plan(settings: ServeSettings) -> None:
    """Refuse bad budget settings before anything loads (the real plan also needs the model)."""
    BudgetPlan.create(max_batch_tokens=settings.max_batch_tokens, budgets=settings.budgets,
                      max_items=settings.max_batch_items, t_capture=settings.t_capture,
                      steps_per_octave=settings.budget_steps)


def run_from_args(args: argparse.Namespace) -> int:
    """Settings, then every check that needs no weights (service/preflight.py), then the bound port
    and the server; a problem found before binding is one line on stderr and its exit code."""
    try:
        settings = settings_from_args(args)
        check_plan(settings)
        fronts = settings.front_count()
    except (SettingsError, BudgetError) as exc:
        print(f"vitserve serve: {exc}", file=sys.stderr)
        return EXIT_SETTINGS
    try:
        sockets = preflight(settings, fronts)
    except StartupError as exc:
        print(f"vitserve serve: {exc}", file=sys.stderr)
        return exc.code
    configure_logging(settings.log_level)
    if fronts > 1:
        return run_fronts(settings, sockets)
    return serve(settings, sockets[0])


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT starting a drain instead of an immediate shutdown."""

    def __init__(self, config: uvicorn.Config, service: Service, drain_timeout: float) -> None:
        super().__init__(config)
        self.service = service
        self.drain_timeout = drain_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or not self.started:
            # A second signal, or one before the server is up: stop now.
            self.should_exit = True
            self.force_exit = self.force_exit or sig == signal.SIGINT and self._drain_task is not None
            return
        log.info("signal %s: draining (ready -> 503, in-flight requests finish)", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        await self.service.drain(self.drain_timeout)
        if self.service.peers is not None:  # out of the ring now, but the LLM server may still fetch from here
            await self.service.peers.linger(deadline)
        self.should_exit = True

    def fatal(self, reason: str) -> None:
        """Start-up failed after the port was bound (called from the loading thread): exit non-zero."""
        self.exit_code = EXIT_FAILED
        self.should_exit = True


SWITCH_INTERVAL_S = 0.0005


def uvicorn_config(app: Any, settings: ServeSettings, **overrides: Any) -> uvicorn.Config:
    """uvicorn as the server runs it: the HTTP protocol with the request-head and connection bounds."""
    limits = HeadLimits(max_bytes=settings.max_header_bytes, max_line_bytes=settings.max_header_line_bytes,
                        max_fields=settings.max_header_fields, timeout_s=settings.header_timeout_s,
                        max_connections=settings.max_connections)
    service = getattr(getattr(app, "state", None), "service", None)  # None: a bare app (tests)
    on_drop = (lambda reason: service.metrics.connections_dropped.labels(reason).inc()) if service else None
    options: dict[str, Any] = dict(
        host=settings.host, port=settings.port, http=limited_protocol(limits, on_drop), log_config=None,
        log_level=settings.log_level, timeout_graceful_shutdown=10, server_header=False,
        timeout_keep_alive=settings.keep_alive_timeout_s, access_log=settings.log_level in ("debug", "trace"))
    return uvicorn.Config(app, **{**options, **overrides})


def serve(settings: ServeSettings, sock: socket.socket | None = None, front: FrontRole | None = None,
          private: Sequence[socket.socket] = ()) -> int:
    """Run the server on `sock` (bound by preflight), else on --host/--port; returns the exit code. A front
    (`front`, see `fronts.py`) also serves on its `private` Unix socket."""
    if settings.model_defaulted and (front is None or front.index == 0):
        log.warning("no --model given: serving the embedded %s preset (random weights, for trying the API)",
                    DEFAULT_MODEL)
    metrics = Metrics()
    engine = Engine(settings, metrics)
    app = create_app(settings, engine=engine, metrics=metrics, front=front)
    config = uvicorn_config(app, settings)
    server = DrainingServer(config, app.state.service, settings.request_timeout_s)
    engine.on_fatal = server.fatal
    # The engine thread and the event loop give the GIL up at every device call and must win it back
    # from the preprocessing threads; at the default 5 ms switch interval each such handover can
    # cost up to 5 ms, many times per batch.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    keep_freed_memory()
    log.info("settings: %s", settings.public_dict())
    if sock is not None:
        host, port = sock.getsockname()[:2]
        log.info("listening on http://%s:%d; loading the model in the background (GET /ready: 200 once done)",
                 host, port)
    server.run(sockets=None if sock is None else [sock, *private])
    return server.exit_code


# ---- several fronts (see fronts.py) -------------------------------------------------------------
def run_fronts(settings: ServeSettings, sockets: Sequence[socket.socket]) -> int:
    """Start a front on each of `sockets` (one port), pass signals on, and return the exit code (see
    fronts.py)."""
    ctx = mp.get_context("spawn")  # each front starts CUDA in its engine process; nothing here is forked
    count = len(sockets)
    with tempfile.TemporaryDirectory(prefix="vitserve-fronts-") as folder:
        paths = unix_socket_paths(folder, count)
        fronts = []
        for i, sock in enumerate(sockets):
            role = FrontRole(i, count, paths)
            p = ctx.Process(target=front_main, name=f"vitserve-front-{i}",
                            args=(settings.for_front(i, count), sock, role, os.getpid()))
            p.start()
            fronts.append(p)
        log.info("started %d front processes on %s (pids %s)", count, sockets[0].getsockname()[:2],
                 ", ".join(str(p.pid) for p in fronts))
        stopping = threading.Event()

        def stop(sig: int, _frame: object) -> None:
            again = stopping.is_set()
            stopping.set()
            log.info("signal %s: passing it on to the fronts (%s)", signal.Signals(sig).name,
                     "they stop" if again else "they drain")
            for p in fronts:
                if p.is_alive():
                    os.kill(p.pid, sig)

        previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            first = wait([p.sentinel for p in fronts])
            code = 0
            if not stopping.is_set():
                failed = next(p for p in fronts if p.sentinel in first)
                failed.join(5)  # its sentinel closes a moment before its exit status can be read
                log.error("front %s exited with code %s: stopping the others", failed.name, failed.exitcode)
                code = EXIT_FAILED
                stop(signal.SIGTERM, None)
            deadline = time.monotonic() + settings.request_timeout_s + 15
            for p in fronts:
                p.join(max(0.0, deadline - time.monotonic()))
                if p.is_alive():
                    log.warning("front %s did not stop in time: killing it", p.name)
                    p.kill()
                    p.join(5)
            return code or (EXIT_FAILED if any(p.exitcode for p in fronts) else 0)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def front_main(settings: ServeSettings, sock: socket.socket, role: FrontRole, supervisor: int) -> None:
    """Entry point of one front process: a whole server on its socket of the port and its own Unix socket."""
    os.setpgrp()  # Ctrl-C reaches the supervisor only, which passes one signal on
    configure_logging(settings.log_level, f"front-{role.index}")
    threading.Thread(target=exit_when_orphaned, args=(supervisor,), name="vitserve-supervisor-watch",
                     daemon=True).start()
    private = bind_unix(role.sockets[role.index])
    sys.exit(serve(settings, sock, role, [private]))




def main(argv: Sequence[str] | None = None) -> int:
    """`python -m service.http.server [serve flags]`: the serve subcommand on its own."""
    parser = argparse.ArgumentParser(prog="vitserve-serve", description="vitserve HTTP server")
    add_serve_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
