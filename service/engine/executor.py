"""The device side of the engine: runs batch jobs on one device and writes each item's embedding to its
own shared-memory segment.

`serve_jobs` drives a `BatchExecutor` with two threads, so that host work overlaps the device's:
- the dispatch thread takes the next job, reads its items' pixels from their segments into one
  page-locked buffer (and unlinks the segments), builds its metadata and enqueues the upload, the
  replay (or eager forward) and ONE copy of the batch's joined output rows back to page-locked
  memory, then goes on to the next job without waiting: while batch k runs on the device, batch k+1
  is staged behind it on the same stream;
- the completion thread waits for each batch's copy (an event, not a device-wide sync), says the
  batch has left the device ("free": the front may stage another behind the one now running), then
  writes every item's rows into its output segment and replies ("done").
The front keeps at most `batcher.MAX_INFLIGHT` batches per engine on the device, so the next is staged
while one runs; writing a batch's outputs (a segment per item: a file of the pool's, retired or written
ahead by `shm.Stocker`, else a fresh one) does not hold a slot.
The same loop runs in an engine process (the GPU; `backends.ProcessBackend`) and in a thread of the
server (the CPU; `backends.LocalBackend`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graphs.learning import LearnedBudget, learn_budget
from graphs.runner import GraphRunner
from models.config import VisualInput
from service import shm
from service.engine.types import BatchJob, LearnBudget, new_error_id

log = logging.getLogger("vitserve.engine")


@dataclass
class Running:
    job: BatchJob
    rows: torch.Tensor  # the joined output rows on the host (page-locked on CUDA), filled by `event`
    event: torch.cuda.Event | None
    started: float
    begun: torch.cuda.Event | None = None  # recorded before the batch's upload
    device_s: float = 0.0  # the CPU's compute time (CUDA: measured by the events in `wait`)
    # Host seconds of the batch's steps here: "stage" (pixels read into one buffer), "launch" (copies and
    # replay or forward enqueued; on the CPU the forward itself), "write" (outputs into their segments).
    steps: dict[str, float] = field(default_factory=dict)


class BatchExecutor:
    def __init__(self, runner: GraphRunner, gpu_memory: str | None = None) -> None:
        self.runner = runner
        self.device = runner.device
        self.cuda = runner.device.type == "cuda"
        self.patch_dim = runner.tower.processor.patch_dim
        self.gpu_memory = gpu_memory
        self._memory: tuple[float, dict | None] = (0.0, None)
        self._last_done: torch.cuda.Event | None = None  # the previous batch's end on the device
        self._stock = shm.Stocker()

    def stats(self) -> dict:
        """The pool's counters, and the device memory (read at most once a second: NVML is not free)."""
        from service.engine.memory import report

        at, memory = self._memory
        if self.cuda and time.monotonic() - at > 1.0:
            memory = report(self.runner, self.gpu_memory)
            self._memory = (time.monotonic(), memory)
        return {**self.runner.stats.as_dict(), "memory": memory}

    def start(self, job: BatchJob) -> Running:
        """Stage the job and enqueue its device work; returns without waiting for the device."""
        t0 = time.perf_counter()
        # Every item's pixels read straight into one page-locked buffer, back to back: one kernel copy
        # each, no mapping (a mapping's population and teardown cost more than the copy).
        counts = [t * h * w for t, h, w in (it.grid_thw for it in job.items)]
        staged = torch.empty((sum(counts), self.patch_dim), dtype=torch.uint8, pin_memory=self.cuda)
        host = staged.numpy()
        begun = None
        try:
            items = []
            offset = 0
            for it, n in zip(job.items, counts):
                shm.read_into(it.pixels, host[offset:offset + n])
                items.append(VisualInput(it.modality, host[offset:offset + n], it.grid_thw))  # type: ignore[arg-type]
                offset += n
            with torch.inference_mode():
                if self.cuda:
                    begun = torch.cuda.Event(enable_timing=True)
                    begun.record()
                run_at = time.perf_counter()
                rows = self.runner.run(job.batch, items, staged=staged)
                if self.cuda:
                    out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                    out.copy_(rows, non_blocking=True)
                    event = torch.cuda.Event(enable_timing=True)
                    event.record()
                    steps = {"stage": run_at - t0, "launch": time.perf_counter() - run_at}
                    return Running(job, out, event, t0, begun, steps=steps)
            # The next job reuses the static output.
            done = time.perf_counter()
            return Running(job, rows.clone(), None, t0, device_s=done - run_at,
                           steps={"stage": run_at - t0, "launch": done - run_at})
        finally:
            # A sent job's pixels are the engine's: read or not, they are retired here (for the next
            # write to reuse), not on the front's event loop, and after the device work is enqueued.
            for it in job.items:
                shm.retire(it.pixels)

    def learn(self, budget: int) -> LearnedBudget:
        """`learn_budget`, on the dispatch thread with nothing in flight; never raises (a budget it
        cannot take is refused with the reason)."""
        try:
            return learn_budget(self.runner, budget)
        except Exception as exc:  # noqa: BLE001 - e.g. a budget past the largest: refused, not fatal
            log.error("budget %d not learned: %s: %s", budget, type(exc).__name__, exc)
            return LearnedBudget(budget, False, f"{type(exc).__name__}: {exc}", self.runner.plan, self.runner.cost)

    def wait(self, running: Running) -> float:
        """Wait until the job has left the device (its rows are on the host); its device seconds: from
        its start there, or the previous job's end if it queued behind it, to its rows' arrival."""
        if running.event is None or running.begun is None:
            return running.device_s
        running.event.synchronize()
        ms = running.begun.elapsed_time(running.event)
        if self._last_done is not None:
            ms = min(ms, self._last_done.elapsed_time(running.event))
        self._last_done = running.event
        return ms / 1000

    def finish(self, running: Running) -> float:
        """Write each item's rows to its segment (after `wait`); the job's seconds since it was staged."""
        started = time.perf_counter()
        raw = running.rows.view(torch.uint8).numpy() if running.rows.numel() else None
        offset = 0
        written: list[str] = []
        try:
            for it in running.job.items:
                tokens = self.runner.tower.geometry.tokens(it.grid_thw, it.modality)
                part = raw[offset:offset + tokens].reshape(-1).data if tokens and raw is not None else b""
                shm.write(it.output, part)
                written.append(it.output)
                offset += tokens
        except BaseException:
            for name in written:  # nothing half-written stays behind
                shm.unlink(name)
            raise
        done = time.perf_counter()
        running.steps["write"] = done - started
        if len(running.job.items) == 1 and written:
            # A batch of one: light load, where the next output of this size may find no retired file
            # (the cache keeps them) and would pay for a fresh one's pages. Under load, batches are
            # larger and retirements feed the pool.
            self._stock.want(written[0], len(part))
        return done - running.started


def serve_jobs(executor: BatchExecutor, receive: Callable[[], BatchJob | LearnBudget | None],
               reply: Callable[[tuple], None], name: str = "vitserve-complete") -> None:
    """Run jobs from `receive` (None: stop) until it stops; replies ("free", job id) once a job has left
    the device, then ("done", job id, seconds, device seconds, pool stats, host seconds by step) or
    ("error", job id, error id, message, code), through `reply`, which may be called from two threads.
    A `LearnBudget` waits until every job before it is done (a capture needs the device idle and no other
    thread of the process touching it), then replies ("learned", `LearnedBudget`, pool stats)."""
    lock = threading.Lock()
    pending: queue.Queue[Running | threading.Event | None] = queue.Queue()

    def send(message: tuple) -> None:
        with lock:
            reply(message)

    def complete() -> None:
        while (running := pending.get()) is not None:
            if isinstance(running, threading.Event):  # everything before it is done: the dispatcher may go on
                running.set()
                continue
            try:
                device_s = executor.wait(running)
                send(("free", running.job.id))
                seconds = executor.finish(running)
                send(("done", running.job.id, seconds, device_s, executor.stats(), running.steps))
            except Exception as exc:
                send(_failure(running.job, exc))

    completer = threading.Thread(target=complete, name=name, daemon=True)
    completer.start()
    try:
        while (job := receive()) is not None:
            if isinstance(job, LearnBudget):
                drained = threading.Event()
                pending.put(drained)
                drained.wait()
                send(("learned", executor.learn(job.budget), executor.stats()))
                continue
            try:
                pending.put(executor.start(job))
            except Exception as exc:
                send(_failure(job, exc))
    finally:
        pending.put(None)
        completer.join()


def _failure(job: BatchJob, exc: BaseException) -> tuple:
    error_id = new_error_id()
    if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC: /dev/shm is full
        log.error("batch %d: no room in /dev/shm for its outputs (%s), error id %s", job.id, exc, error_id)
        return ("error", job.id, error_id, "shared memory (/dev/shm) is full: the server needs more room there",
                "insufficient_storage")
    log.error("batch %s of %d item(s) failed, error id %s", job.batch.key, len(job.items), error_id,
              exc_info=(type(exc), exc, exc.__traceback__))
    return ("error", job.id, error_id, f"internal error {error_id}: {type(exc).__name__}", "engine_failure")
