"""The worker process's side of `service.workers.pool`: the loop a worker runs (warm up, say "ready", then
run jobs one at a time and answer pings) and the `JobContext` through which a job asks its caller a
question mid-way. Workers ignore SIGINT and SIGTERM (the front drains, then stops them) and exit when the
front goes away.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from service.shm import exit_when_orphaned, keep_freed_memory

log = logging.getLogger("vitserve.workers")


class JobContext:
    """What a job function gets besides its arguments: a way to ask the front and wait for the answer."""

    def __init__(self, conn: Connection, job_id: int) -> None:
        self._conn, self._job_id = conn, job_id
        self._after_reply: list[Callable[[], None]] = []

    def once_answered(self, action: Callable[[], None]) -> None:
        """Run `action` after the job's result is sent. A job may run again if its worker dies before
        the result arrives, so what would spoil a second run (giving up an input) waits until then."""
        self._after_reply.append(action)

    def ask(self, question: Any) -> Any:
        """Send `question` to the caller's `on_ask` and return its answer; raises Aborted if it refused."""
        self._conn.send(("ask", self._job_id, question))
        while (reply := self._conn.recv())[0] == "ping":  # sent while it thought us idle
            self._conn.send(("pong",))
        if reply[0] == "abort":
            raise Aborted()
        return reply[1]


class Aborted(Exception):
    """The caller refused a job's question: the job stops without a result."""


def worker_main(conn: Connection, front_pid: int, warm_up: str | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    keep_freed_memory()
    import torch

    torch.set_num_threads(1)  # a worker is one core's worth of work; the pool spreads them
    try:
        os.nice(5)  # the event loop and the engines win the cores when they are contended
    except OSError:
        pass
    parent = os.getppid()
    # The front killed outright cannot stop us; its fork server exits with it, which re-parents us.
    threading.Thread(target=exit_when_orphaned, args=(parent, front_pid), daemon=True).start()
    if warm_up is not None:
        try:
            _resolve(warm_up)()
        except Exception:  # noqa: BLE001 - only the speed of the first job is at stake
            log.warning("worker warm-up %s failed", warm_up, exc_info=True)
    # Blocking sends on this end: this process has nothing else to do while the front reads.
    conn.send(("ready",))
    functions: dict[str, Callable[..., Any]] = {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            break
        if message[0] == "ping":
            conn.send(("pong",))
            continue
        if message[0] != "run":
            continue  # a stale reply to an abandoned question
        _, job_id, fn_path, args = message
        ctx = JobContext(conn, job_id)
        try:
            fn = functions.get(fn_path) or functions.setdefault(fn_path, _resolve(fn_path))
            result = fn(ctx, *args)
            conn.send(("done", job_id, result))
            for action in ctx._after_reply:
                action()
        except Aborted:
            conn.send(("done", job_id, None))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            if getattr(exc, "client_error", False):
                conn.send(("raised", job_id, exc))
            else:
                conn.send(("failed", job_id, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    os._exit(0)


def _resolve(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)

