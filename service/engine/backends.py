"""Backends: where the batcher's jobs run. Each backend is one engine on one device, seen from the server:
it loads the model, takes batch jobs (`submit`) and reports each job's outcome on the event loop.

- `ProcessBackend`: an engine process (the GPU, one per device; `--data-parallel N` starts N). Its
  process has its own interpreter, so nothing it does waits for the HTTP side's GIL, and its death
  fails only its own batches. Jobs and replies are small messages on a pipe (the front's end a
  `service.channel.Channel`: a message of any size goes whole); pixels and embeddings travel in shared
  memory (`service.shm`).
- `LocalBackend`: the same job loop in a thread of the server (the CPU, and tests).

Both run `executor.serve_jobs`, so a job behaves the same wherever it runs. Engine processes are
started with spawn (CUDA cannot be used in a forked child), ignore SIGINT (Ctrl-C reaches the whole
process group: the server drains first, then stops them) and exit on their own if the server dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn, Protocol

from service.channel import Channel
from service.engine.executor import BatchExecutor, serve_jobs
from service.engine.loading import bind_device, build_runner
from service.engine.types import BatchJob, LearnBudget, ModelInfo
from service.settings import ServeSettings
from service.shm import exit_when_orphaned, keep_freed_memory

log = logging.getLogger("vitserve.engine")

OnReply = Callable[["Backend", tuple], None]
OnExit = Callable[["Backend"], None]


class Backend(Protocol):
    index: int
    device: str
    state: str  # starting -> ready -> down (its process exited) | stopped; a restart: starting -> loaded -> ready
    model: ModelInfo | None
    stats: dict[str, Any]  # the engine's last pool statistics
    pid: int | None
    exitcode: int | None
    error: str | None
    threads: int  # CPU threads the engine was given (0: torch's own choice)

    def load(self) -> ModelInfo:
        """Load the weights and capture the graphs (blocking, on a loading thread); raise if it cannot."""
        ...

    def attach(self, loop: asyncio.AbstractEventLoop, on_reply: OnReply, on_exit: OnExit) -> None:
        """Deliver replies and the engine's exit on `loop` from now on (call on the loop's thread)."""
        ...

    def submit(self, job: BatchJob) -> None:
        ...

    def learn(self, budget: int) -> None:
        """Capture one more budget's graphs between batches; the engine replies ("learned", ...)."""
        ...

    def stop(self, timeout: float) -> None:
        ...


class LocalBackend:
    """The engine in this process: a dispatch and a completion thread (see `executor.serve_jobs`)."""

    def __init__(self, index: int, settings: ServeSettings, runner: Any = None) -> None:
        self.index, self.settings, self.runner = index, settings, runner
        self.threads = 0  # this process's own
        self.device = settings.device
        self.state = "starting"
        self.model: ModelInfo | None = None
        self.stats: dict[str, Any] = {}
        self.pid: int | None = os.getpid()
        self.exitcode: int | None = None
        self.error: str | None = None
        self._jobs: queue.Queue[BatchJob | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def load(self) -> ModelInfo:
        if self.runner is None:
            self.runner = build_runner(self.settings)
        self.model = ModelInfo.from_runner(self.runner)
        self.device = self.model.device
        self._executor = BatchExecutor(self.runner, self.settings.gpu_memory)
        self.stats = self._executor.stats()
        self.state = "ready"
        return self.model

    def attach(self, loop: asyncio.AbstractEventLoop, on_reply: OnReply, on_exit: OnExit) -> None:
        def reply(message: tuple) -> None:
            try:
                loop.call_soon_threadsafe(on_reply, self, message)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        def run() -> None:
            bind_device(self.runner.device)
            serve_jobs(self._executor, self._jobs.get, reply, name=f"vitserve-complete-{self.index}")

        self._thread = threading.Thread(target=run, name=f"vitserve-engine-{self.index}", daemon=True)
        self._thread.start()

    def submit(self, job: BatchJob) -> None:
        self._jobs.put(job)

    def learn(self, budget: int) -> None:
        self._jobs.put(LearnBudget(budget))

    def stop(self, timeout: float) -> None:
        self.state = "stopped"
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout)


class ProcessBackend:
    """One engine process on one device."""

    def __init__(self, index: int, settings: ServeSettings, threads: int = 0) -> None:
        self.index, self.settings, self.threads = index, settings, threads
        self.device = settings.device
        self.state = "starting"
        self.model: ModelInfo | None = None
        self.stats: dict[str, Any] = {}
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.error: str | None = None
        self._process: Any = None
        self._conn: Connection | None = None
        self._channel: Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    def load(self) -> ModelInfo:
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        ours, theirs = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=engine_main, name=f"vitserve-engine-{self.index}", daemon=True,
                                    args=(self.index, self.settings, theirs, os.getpid(), self.threads))
        self._process.start()
        theirs.close()  # the child holds its end: its exit closes the pipe
        self._conn, self.pid = ours, self._process.pid
        while True:  # until it reports, or exits
            ready = wait([ours, self._process.sentinel], timeout=1.0)
            if self._stopping:
                raise RuntimeError("stopped while the engine was loading")
            if ours in ready:
                try:
                    message = ours.recv()
                except (EOFError, OSError):
                    message = ("failed", None)
                if message[0] == "ready":
                    _, self.model, self.stats = message
                    self.device = self.model.device  # "auto" resolved, as /info and the bench report it
                    # Restarted: it takes batches once attached to the loop again, not before (a batch sent
                    # on the old channel meanwhile would be lost).
                    self.state = "ready" if self._loop is None else "loaded"
                    return self.model
                self.error = message[1]
            if self._process.sentinel in ready or ours in ready:
                self._process.join(5)
                self.exitcode = self._process.exitcode
                self.state = "down"
                raise RuntimeError(f"engine {self.index} ({self.device}) failed to start: "
                                   f"{self.error or f'its process exited with code {self.exitcode}'}")

    def attach(self, loop: asyncio.AbstractEventLoop, on_reply: OnReply, on_exit: OnExit) -> None:
        assert self._conn is not None
        self._loop = loop
        process = self._process

        def closed(reason: str) -> None:
            # Its exit closes the pipe, and `exited` follows; an engine still alive a second later has a
            # broken channel and can serve nobody: it is killed, and its exit handled as any other.
            def check() -> None:
                if process.is_alive() and not self._stopping:
                    log.error("engine %d: its channel failed (%s): killing it", self.index, reason)
                    process.kill()

            loop.call_later(1.0, check)

        channel = Channel(self._conn, loop, lambda message: on_reply(self, message), closed)
        self._channel = channel

        def exited() -> None:
            loop.remove_reader(process.sentinel)
            if not channel.closed:
                channel.read_now()  # replies sent just before the exit still count
                channel.close()
            process.join(5)
            self.exitcode = process.exitcode
            self.state = "stopped" if self._stopping else "down"
            on_exit(self)

        loop.add_reader(process.sentinel, exited)
        self.state = "ready"

    def submit(self, job: BatchJob) -> None:
        self._send(("run", job))

    def learn(self, budget: int) -> None:
        self._send(("learn", budget))

    def _send(self, message: tuple) -> None:
        assert self._channel is not None
        try:
            self._channel.send(message)
        except OSError:  # it just exited: its exit handler fails the job
            log.debug("engine %d: send failed", self.index)

    def stop(self, timeout: float) -> None:
        self._stopping = True
        process = self._process
        if process is None:
            return
        if self.state == "starting":  # still loading: it would read "stop" only once loaded (and ignores SIGTERM)
            process.kill()
        elif self._channel is not None:
            try:
                self._channel.send(("stop",))
                self._channel.flush_blocking(1.0)  # the loop may not run again to write it
            except OSError:
                pass
        elif self._conn is not None:
            try:
                self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
        process.join(timeout)
        if process.is_alive():
            log.warning("engine %d did not stop in time: killing it", self.index)
            process.kill()
            process.join(5)
        if self._loop is not None:
            try:
                self._loop.remove_reader(process.sentinel)
            except (OSError, ValueError, RuntimeError):
                pass
        if self._channel is not None:
            self._channel.close()
        if self._conn is not None:
            self._conn.close()
        self.exitcode = process.exitcode
        self.state = "stopped"


def make_backends(settings: ServeSettings, runner: Any = None) -> list[Backend]:
    """One engine per device: engine processes on GPUs, the in-process engine on the CPU (several CPU
    engines, for tests of the multi-engine path, run as processes too)."""
    devices = settings.engine_devices()
    if runner is not None:
        if len(devices) != 1:
            raise ValueError("a runner is given: it can only serve in this process, with one engine")
        return [LocalBackend(0, settings, runner)]
    if len(devices) == 1 and _on_cpu(devices[0]):
        return [LocalBackend(0, settings)]
    cpu = all(d == "cpu" for d in devices)
    threads = max(1, (os.cpu_count() or 1) // len(devices)) if cpu else 0
    base = settings.model_copy(update={"data_parallel": 1, "api_key": None})
    return [ProcessBackend(i, base.model_copy(update={"device": d}), threads) for i, d in enumerate(devices)]


def _on_cpu(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "auto":
        from service.settings import visible_gpus

        return visible_gpus() == 0
    return False


# ---- the engine process ---------------------------------------------------------------------------
def engine_main(index: int, settings: ServeSettings, conn: Connection, parent: int, threads: int) -> None:
    """Entry point of engine process `index`: load, report, then run jobs until told to stop."""
    # The server stops its engines once it has drained (or exits, and `exit_when_orphaned` follows): a
    # Ctrl-C or a SIGTERM sent to every process (systemd's stop, `pkill`) must not end one first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level = logging.DEBUG if settings.log_level == "trace" else getattr(logging, settings.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    threading.Thread(target=exit_when_orphaned, args=(parent,), name="vitserve-parent-watch", daemon=True).start()
    keep_freed_memory()
    import torch

    if threads:
        torch.set_num_threads(threads)  # CPU engines share the cores instead of each taking them all
    try:
        runner = build_runner(settings)
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ValueError):
            log.error("engine %d: start-up failed: %s", index, message)
        else:
            log.exception("engine %d: start-up failed: %s", index, message)
        conn.send(("failed", message))
        _exit(1)
    executor = BatchExecutor(runner, settings.gpu_memory)
    conn.send(("ready", ModelInfo.from_runner(runner), executor.stats()))

    def receive() -> BatchJob | LearnBudget | None:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return None
        if message[0] == "learn":
            return LearnBudget(message[1])
        return message[1] if message[0] == "run" else None

    serve_jobs(executor, receive, conn.send)
    _exit(0)


def _exit(code: int) -> NoReturn:
    # Skip the interpreter's teardown of torch and transformers (seconds): nothing here needs it, and
    # the server waits for this exit when it stops.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

