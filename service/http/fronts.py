"""Several HTTP front processes on one port (`--fronts`): one per engine, so that parsing, response
writing and the event loop's other work use as many cores as there are engines.

The supervisor (the process `vitserve serve` started) binds the port, starts one front process per
engine and waits. Every front accepts on the same listening socket, so the kernel hands each new
connection to a front that is waiting in accept(): an idle front takes more. Each front is a whole
server (its own engine, worker processes and bounds, see `ServeSettings.for_front`) and also listens
on a private Unix socket, through which a front answering GET /metrics reads its siblings' series
(a scrape of the shared port sees the whole server, each series labelled with its `front`), and
GET /ready asks theirs (the server is ready once every front is).

Signals: SIGTERM and SIGINT to the supervisor are passed on to every front, which handles them as a
lone server does (`server.DrainingServer`): the first drains, a second ends the drain (SIGINT, a
second Ctrl-C: at once). Fronts sit in their own process group, so that Ctrl-C reaches them only
through the supervisor, once. A front that exits on its own (its engine failed)
stops the others, and the supervisor exits 1. Fronts exit if the supervisor dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from service.settings import ServeSettings

log = logging.getLogger("vitserve.server")
SIBLING_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class FrontRole:
    """This process's place among the fronts: its index, how many there are, and where each listens
    privately (the Unix sockets, by index)."""

    index: int
    count: int
    sockets: tuple[str, ...] = field(default=())

    @property
    def siblings(self) -> list[tuple[int, str]]:
        return [(i, path) for i, path in enumerate(self.sockets) if i != self.index]


def unix_socket_paths(folder: str, count: int) -> tuple[str, ...]:
    return tuple(str(Path(folder) / f"front-{i}.sock") for i in range(count))


def bind_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


# ---- the supervisor ------------------------------------------------------------------------------
def run_fronts(settings: ServeSettings, sock: socket.socket, count: int) -> int:
    """Start `count` fronts on `sock`, pass signals on, and return the exit code."""
    from service.preflight import EXIT_FAILED

    ctx = mp.get_context("spawn")  # each front starts CUDA in its engine process; nothing here is forked
    with tempfile.TemporaryDirectory(prefix="vitserve-fronts-") as folder:
        paths = unix_socket_paths(folder, count)
        fronts = []
        for i in range(count):
            role = FrontRole(i, count, paths)
            p = ctx.Process(target=front_main, name=f"vitserve-front-{i}",
                            args=(settings.for_front(i, count), sock, role, os.getpid()))
            p.start()
            fronts.append(p)
        log.info("started %d front processes on %s (pids %s)", count, sock.getsockname()[:2],
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
    """Entry point of one front process: a whole server on the shared socket and its own Unix socket."""
    import sys

    from service.http.server import configure_logging, serve

    os.setpgrp()  # Ctrl-C reaches the supervisor only, which passes one signal on
    configure_logging(settings.log_level, f"front-{role.index}")
    threading.Thread(target=_exit_with_supervisor, args=(supervisor,), name="vitserve-supervisor-watch",
                     daemon=True).start()
    private = bind_unix(role.sockets[role.index])
    sys.exit(serve(settings, sock, role, [private]))


def _exit_with_supervisor(supervisor: int) -> None:
    while os.getppid() == supervisor:
        time.sleep(1.0)
    os._exit(1)


# ---- /metrics across fronts --------------------------------------------------------------------
async def ask_siblings(role: FrontRole, path: str) -> list[tuple[str, Any]]:
    """(front, httpx response) of GET `path`?scope=front on every sibling; None where none came in time."""
    import httpx

    async def one(index: int, socket_path: str) -> tuple[str, Any]:
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path),
                                         timeout=SIBLING_TIMEOUT_S) as client:
                return str(index), await client.get(f"http://front{path}", params={"scope": "front"})
        except (httpx.HTTPError, OSError):
            return str(index), None

    return list(await asyncio.gather(*(one(i, p) for i, p in role.siblings)))


def merge_expositions(parts: Iterable[tuple[str, str]]) -> bytes:
    """Prometheus texts of several fronts as one, each sample labelled with its `front`."""
    families: dict[str, Metric] = {}
    for front, text in parts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                merged.add_sample(s.name, {"front": front, **s.labels}, s.value, s.timestamp, s.exemplar)

    class _Merged:
        def collect(self) -> Iterable[Metric]:
            return families.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())  # type: ignore[arg-type]
    return generate_latest(registry)
