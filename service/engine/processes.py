"""`--data-parallel N`: N engine processes, one per device, behind the one HTTP front.

Processes. The front (uvicorn, the app, and `Engine`'s admission, preprocessing and queues) starts N
workers with multiprocessing's spawn context (CUDA forbids fork once initialised). Each loads the
model on its device (`cuda:i`, or the CPU), captures its own graphs and reports ready with its
`ModelInfo`; the server turns ready once all have. Workers ignore SIGINT (Ctrl-C reaches the whole
process group: the front drains first, then stops them) and exit on their own if the front dies.

Dispatch. The engine thread waits until some engine is idle, takes the queue, packs it with the plan
the engines reported (packing needs no model) and hands each batch to the live engine with the fewest
outstanding tokens (ties: the one idle longest).

Shared memory. One segment per batch, created by the front: the items' uint8 pixel rows, then room
for every tensor their requests asked for, at offsets computed from the model's shapes and each
item's `OutputSpec`. Only that layout crosses the pipe. The worker writes its outputs in place and
replies; the front copies them out and unlinks the segment. The front creates and unlinks every
segment, so a worker that dies leaks none.

Failure. A thread per engine waits on its reply pipe and its process sentinel. When the process
exits, its outstanding batches fail with `EngineDied` (503 engine_failed), their segments are
unlinked, the engine is marked down (/info, `vitserve_engine_up`) and the others keep serving. With
none left the server fails (/ready 503) and exits, so that the orchestrator restarts it.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.shared_memory import SharedMemory
from typing import Any, NoReturn

import numpy as np
import torch

from graphs.packing import Batch
from graphs.runner import GraphRunner, pack_inputs
from models.config import VisualInput
from service.engine.loading import build_runner
from service.engine.types import (
    EngineDied,
    EngineFailure,
    ItemResult,
    ModelInfo,
    NotReady,
    Work,
    new_error_id,
)
from service.metrics import EngineSample
from service.settings import ServeSettings

log = logging.getLogger("vitserve.workers")

ALIGN = 64  # bytes: every tensor in a segment starts on a cache line
SEGMENT_PREFIX = "vsdp_"  # /dev/shm/vsdp_<front pid>_<random>_<job>


# ---- what crosses the pipe -----------------------------------------------------------------------
@dataclass(frozen=True)
class OutputSlot:
    """Where the worker writes one output tensor of one item."""

    name: str  # embeds | deepstack.<j> | joined | ec
    dtype: torch.dtype
    shape: tuple[int, int]
    offset: int


@dataclass(frozen=True)
class JobItem:
    modality: str
    grid_thw: tuple[int, int, int]
    offset: int  # of the pixel rows
    shape: tuple[int, int]
    pixel_dtype: str
    outputs: tuple[OutputSlot, ...]


@dataclass(frozen=True)
class Job:
    id: int
    segment: str
    batch: Batch
    items: tuple[JobItem, ...]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _view(buf: memoryview, slot: OutputSlot) -> torch.Tensor:
    count = slot.shape[0] * slot.shape[1]
    return torch.frombuffer(buf, dtype=slot.dtype, count=count, offset=slot.offset).view(slot.shape)


def _close(segment: SharedMemory) -> None:
    try:
        segment.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with the object instead
        log.debug("segment %s still has views; left to the garbage collector", segment.name)


# ---- the worker process --------------------------------------------------------------------------
def worker_main(index: int, settings: ServeSettings, requests: Connection, replies: Connection, parent: int,
                threads: int) -> None:
    """Entry point of engine process `index`: load, report, then run jobs until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the front drains, then stops us
    level = logging.DEBUG if settings.log_level == "trace" else getattr(logging, settings.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent,), name="vitserve-parent-watch", daemon=True).start()
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
        replies.send(("failed", message))
        _exit(1)
    replies.send(("ready", ModelInfo.from_runner(runner), os.getpid(), runner.stats.as_dict()))
    delay = settings.batch_delay_ms / 1000
    while True:
        try:
            message = requests.recv()
        except (EOFError, OSError):  # the front is gone
            break
        if message[0] == "stop":
            break
        if delay:
            time.sleep(delay)
        replies.send(run_job(runner, message[1]))
    _exit(0)


def _exit(code: int) -> NoReturn:
    # Skip the interpreter's teardown of torch and transformers (seconds): nothing here needs it, and
    # the front waits for this exit when it stops.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent(parent: int) -> None:
    # A front killed outright cannot stop us; a worker busy loading would not notice its pipe closing.
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def run_job(runner: GraphRunner, job: Job) -> tuple:
    """One batch from its segment back into it; the reply tuple for the front."""
    t0 = time.perf_counter()
    try:
        segment = SharedMemory(job.segment)
    except FileNotFoundError:
        error_id = new_error_id()
        log.error("batch %d: segment %s is gone, error id %s", job.id, job.segment, error_id)
        return ("error", job.id, error_id, f"internal error {error_id}: shared memory segment missing")
    try:
        _run_in(runner, job, segment.buf)
        return ("done", job.id, time.perf_counter() - t0, runner.stats.as_dict())
    except Exception as exc:
        error_id = new_error_id()
        log.exception("batch %s of %d item(s) failed, error id %s", job.batch.key, len(job.items), error_id)
        return ("error", job.id, error_id, f"internal error {error_id}: {type(exc).__name__}")
    finally:
        _close(segment)


def _run_in(runner: GraphRunner, job: Job, buf: memoryview) -> None:
    # Every view of `buf` dies with this frame, so the caller can close the segment.
    items = [VisualInput(it.modality, np.ndarray(it.shape, it.pixel_dtype, buffer=buf, offset=it.offset),
                         it.grid_thw) for it in job.items]  # type: ignore[arg-type]
    outs = runner.run_batch(job.batch, items)
    for it, out in zip(job.items, outs):
        joined: torch.Tensor | None = None
        for slot in it.outputs:
            if slot.name == "embeds":
                src = out.embeds
            elif slot.name.startswith("deepstack."):
                src = out.deepstack[int(slot.name.removeprefix("deepstack."))]
            else:  # joined / ec: the main embedding and DeepStack along hidden, as the in-process engine makes it
                if joined is None:
                    parts = [out.embeds, *out.deepstack]
                    joined = torch.cat(parts, dim=-1) if len(parts) > 1 else out.embeds
                src = joined
            _view(buf, slot).copy_(src.to(slot.dtype))


# ---- the front's side ----------------------------------------------------------------------------
@dataclass(eq=False)
class EngineProc:
    """One engine process as the front tracks it."""

    index: int
    device: str
    process: Any  # multiprocessing's SpawnProcess
    requests: Connection  # front -> worker
    replies: Connection  # worker -> front
    state: str = "starting"  # starting -> ready -> down (exited) | stopped
    pid: int | None = None
    exitcode: int | None = None
    error: str | None = None
    info: ModelInfo | None = None
    stats: dict[str, Any] = field(default_factory=dict)  # the worker's last PoolStats snapshot
    outstanding_tokens: int = 0
    outstanding_batches: int = 0
    batches: int = 0
    items: int = 0
    idle_since: float = 0.0
    watcher: threading.Thread | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"gpu": self.index, "device": self.device, "pid": self.pid, "state": self.state,
                "exitcode": self.exitcode, "error": self.error, "outstanding_tokens": self.outstanding_tokens,
                "outstanding_batches": self.outstanding_batches, "batches": self.batches, "items": self.items,
                "graph_hits": self.stats.get("graph_items", 0),
                "graph_misses": sum(self.stats.get("eager_items", {}).values())}


@dataclass(eq=False)
class _Pending:
    job: Job
    engine: EngineProc
    segment: SharedMemory
    members: list[Work]
    taken: float


class MergedStats:
    """`PoolStats.as_dict()` summed over the engines' last snapshots (a dead engine's counts stay)."""

    def __init__(self, engines: list[EngineProc]) -> None:
        self.engines = engines

    def as_dict(self) -> dict[str, Any]:
        snaps = [e.stats for e in self.engines if e.stats]
        total = {k: sum(s.get(k, 0) for s in snaps) for k in
                 ("graph_items", "eager_batches", "chunked_videos", "video_chunks", "captured_graphs", "pool_bytes")}
        eager: Counter = Counter()
        replays: Counter = Counter()
        failures: dict[str, str] = {}
        for e in self.engines:
            eager.update(e.stats.get("eager_items", {}))
            replays.update(e.stats.get("replays", {}))
            failures.update({f"{e.index}:{k}": v for k, v in e.stats.get("capture_failures", {}).items()})
        served = total["graph_items"] + sum(eager.values())
        return {**total, "eager_items": dict(eager), "replays": dict(replays), "capture_failures": failures,
                "hit_rate": round(total["graph_items"] / served, 4) if served else 0.0,
                "capture_seconds": max((s.get("capture_seconds", 0.0) for s in snaps), default=0.0)}


class ProcessPoolBackend:
    """The `Backend` of a multi-engine server: one spawned process per device (see the module doc)."""

    def __init__(self, engine: Any, devices: list[str]) -> None:
        self.engine = engine
        self.devices = devices
        self.engines: list[EngineProc] = []
        self.model: ModelInfo | None = None
        self._cond = threading.Condition()
        self._pending: dict[int, _Pending] = {}
        self._jobs = itertools.count()
        self._prefix = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(3)}_"
        self._stopping = False
        self._stopped = False
        self._merged = MergedStats(self.engines)

    # ---- start-up ---------------------------------------------------------------------------
    def load(self) -> ModelInfo:
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        cpu = all(d == "cpu" for d in self.devices)
        threads = max(1, torch.get_num_threads() // len(self.devices)) if cpu else 0
        base = self.engine.settings.model_copy(update={"data_parallel": 1, "api_key": None})
        log.info("starting %d engine processes on %s", len(self.devices), ", ".join(self.devices))
        for i, device in enumerate(self.devices):
            req_r, req_w = ctx.Pipe(duplex=False)
            rep_r, rep_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, name=f"vitserve-engine-{i}", daemon=True,
                               args=(i, base.model_copy(update={"device": device}), req_r, rep_w, os.getpid(),
                                     threads))
            with self._cond:
                if self._stopping:
                    raise RuntimeError("stopped while starting the engines")
                proc.start()
            req_r.close()  # the child holds its ends now: its exit closes the last writer of `replies`
            rep_w.close()
            eng = EngineProc(i, device, proc, req_w, rep_r, pid=proc.pid)
            eng.watcher = threading.Thread(target=self._watch, args=(eng,), name=f"vitserve-watch-{i}", daemon=True)
            self.engines.append(eng)
            eng.watcher.start()
        with self._cond:  # until all are ready, or one failed (no need to wait for the others then)
            while (any(e.state == "starting" for e in self.engines)
                   and not any(e.state in ("down", "stopped") for e in self.engines)):
                self._cond.wait(1.0)
        failed = sorted((e for e in self.engines if e.state != "ready"), key=lambda e: e.state == "starting")
        if failed:
            e = failed[0]  # one that exited, rather than one still loading
            raise RuntimeError(f"engine {e.index} ({e.device}) failed to start: "
                               f"{e.error or f'its process exited with code {e.exitcode}'}")
        infos = [e.info for e in self.engines]
        assert infos[0] is not None
        if any(i is None or i.plan != infos[0].plan for i in infos):
            raise RuntimeError("the engines made different graph plans from the same settings")
        self.model = infos[0]
        self.engine.metrics.attach_pool(self._merged)
        self.engine.metrics.attach_engines(self._samples)
        return self.model

    # ---- dispatch (the engine thread) ---------------------------------------------------------
    def wait_capacity(self, stopping: Callable[[], bool]) -> None:
        with self._cond:
            while not stopping() and not self._has_capacity():
                self._cond.wait(0.05)  # a timeout only to notice `stopping`; completions notify

    def _has_capacity(self) -> bool:
        live = [e for e in self.engines if e.state == "ready"]
        return not live or any(e.outstanding_batches == 0 for e in live)  # none live: let the work fail

    def process(self, work: list[Work]) -> None:
        assert self.model is not None
        metrics = self.engine.metrics
        live = [w for w in work if not w.cancelled]
        if len(live) < len(work):
            metrics.cancelled.inc(len(work) - len(live))
        if not live:
            return
        taken = time.monotonic()
        for w in live:
            metrics.queue_seconds.observe(taken - w.enqueued)
        for batch in pack_inputs([w.visual for w in live], self.model.plan, self.model.replay_overhead_tokens):
            members = [live[i] for i in batch.items]
            if all(w.cancelled for w in members):
                metrics.cancelled.inc(len(members))
                continue
            self._dispatch(batch, members, taken)

    def _dispatch(self, batch: Batch, members: list[Work], taken: float) -> None:
        job_id = next(self._jobs)
        try:
            job, segment = self._stage(job_id, batch, members)
        except OSError as exc:  # /dev/shm full or missing: this batch fails, the server goes on
            error_id = new_error_id()
            log.error("batch of %d item(s): no shared memory (%s), error id %s; give /dev/shm more room",
                      len(members), exc, error_id)
            self._fail(members, EngineFailure(f"internal error {error_id}: shared memory exhausted", error_id))
            return
        with self._cond:
            eng = self._pick()
            if eng is not None:
                self._pending[job_id] = _Pending(job, eng, segment, members, taken)
                eng.outstanding_tokens += batch.tokens
                eng.outstanding_batches += 1
        if eng is None:
            self._release(segment)
            self._fail(members, EngineDied("no engine process is left to run this request"))
            return
        try:
            eng.requests.send(("run", job))
        except (OSError, ValueError):  # the engine just exited: its watcher fails this batch
            log.debug("engine %d: send failed", eng.index)

    def _pick(self) -> EngineProc | None:
        live = [e for e in self.engines if e.state == "ready"]
        return min(live, key=lambda e: (e.outstanding_tokens, e.idle_since), default=None)

    def _stage(self, job_id: int, batch: Batch, members: list[Work]) -> tuple[Job, SharedMemory]:
        """Lay the batch out in a new segment and write its pixels there."""
        assert self.model is not None
        hidden, layers, served = self.model.out_hidden_size, self.model.num_deepstack, self.model.dtype
        offset, items, pixels = 0, [], []
        for w in members:
            px = np.ascontiguousarray(w.visual.pixels)
            pixels.append(px)
            px_offset, offset = offset, _align(offset + px.nbytes)
            slots = []
            for name, dtype, width in _outputs(w, hidden, layers, served):
                slots.append(OutputSlot(name, dtype, (w.tokens, width), offset))
                offset = _align(offset + w.tokens * width * dtype.itemsize)
            items.append(JobItem(w.visual.modality, tuple(int(x) for x in w.visual.grid_thw),  # type: ignore[arg-type]
                                 px_offset, px.shape, px.dtype.str, tuple(slots)))
        segment = SharedMemory(f"{self._prefix}{job_id}", create=True, size=max(offset, 1))
        try:
            fd = getattr(segment, "_fd", -1)
            if fd >= 0:  # tmpfs allocates on first touch: reserve now, or a full /dev/shm is a SIGBUS later
                os.posix_fallocate(fd, 0, max(offset, 1))
            for px, it in zip(pixels, items):
                dst = np.ndarray(it.shape, it.pixel_dtype, buffer=segment.buf, offset=it.offset)
                dst[...] = px
                del dst
        except BaseException:
            self._release(segment)
            raise
        return Job(job_id, segment.name, batch, tuple(items)), segment

    # ---- replies (one watcher thread per engine) ----------------------------------------------
    def _watch(self, eng: EngineProc) -> None:
        conn, sentinel = eng.replies, eng.process.sentinel
        while True:
            ready = wait([conn, sentinel])
            if conn in ready:
                try:
                    message = conn.recv()
                except (EOFError, OSError):  # every writer is gone: the process exited
                    break
                try:
                    self._handle(eng, message)
                except Exception:  # a bug here must not stop the watch, or a death would go unnoticed
                    log.exception("engine %d: reply %r could not be handled", eng.index, message[:2])
                continue
            break  # the process exited and nothing is left to read
        self._exited(eng)

    def _handle(self, eng: EngineProc, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            with self._cond:
                _, eng.info, eng.pid, eng.stats = message
                eng.state, eng.idle_since = "ready", time.monotonic()
                self._cond.notify_all()
            log.info("engine %d ready on %s (pid %d)", eng.index, eng.device, eng.pid)
        elif kind == "failed":
            eng.error = message[1]  # the exit follows; `_exited` wakes the loader
        elif kind in ("done", "error"):
            job_id = message[1]
            with self._cond:
                pending = self._pending.pop(job_id, None)
                if pending is None:
                    return
                eng.outstanding_tokens -= pending.job.batch.tokens
                eng.outstanding_batches -= 1
                if eng.outstanding_batches == 0:
                    eng.idle_since = time.monotonic()
                if kind == "done":
                    eng.batches += 1
                    eng.items += len(pending.members)
                    eng.stats = message[3]
                self._cond.notify_all()
            if kind == "done":
                self._complete(pending, message[2])
            else:
                self._release(pending.segment)
                self._fail(pending.members, EngineFailure(message[3], message[2]))

    def _complete(self, pending: _Pending, gpu_s: float) -> None:
        metrics = self.engine.metrics
        try:
            results = [None if w.cancelled else self._result(w, it, pending, gpu_s)
                       for w, it in zip(pending.members, pending.job.items)]
        finally:
            self._release(pending.segment)
        metrics.gpu_seconds.observe(gpu_s)
        metrics.batch_tokens.observe(pending.job.batch.tokens)
        metrics.batch_items.observe(len(pending.members))
        for w in pending.members:
            metrics.items.labels(w.visual.modality).inc()
            metrics.tokens.inc(w.tokens)
        done = [(w, res) for w, res in zip(pending.members, results) if res is not None]
        self.engine._deliver_all([w for w, _ in done], [res for _, res in done])

    def _result(self, w: Work, item: JobItem, pending: _Pending, gpu_s: float) -> ItemResult:
        buf = pending.segment.buf
        tensors = {slot.name: _view(buf, slot).clone() for slot in item.outputs}  # own memory: the segment goes
        v = w.visual
        return ItemResult(
            index=w.item.index,
            modality=v.modality,
            id=w.item.id,
            grid_thw=item.grid_thw,
            num_patches=v.num_patches,
            num_tokens=w.tokens,
            meta=dict(v.meta),
            embeds=tensors["embeds"],
            deepstack=[tensors[k] for k in sorted(tensors, key=_layer) if k.startswith("deepstack.")],
            joined=tensors.get("joined"),
            ec_cache=tensors.get("ec"),
            preprocess_s=w.preprocess_s,
            queue_s=pending.taken - w.enqueued,
            gpu_s=gpu_s,
        )

    def _exited(self, eng: EngineProc) -> None:
        eng.process.join(5)  # it has exited (or closed its pipe): reap it for the exit code
        with self._cond:
            was = eng.state
            eng.state = "stopped" if self._stopping else "down"
            eng.exitcode = eng.process.exitcode
            lost = [p for p in self._pending.values() if p.engine is eng]
            for p in lost:
                del self._pending[p.job.id]
            eng.outstanding_tokens = eng.outstanding_batches = 0
            left = sum(1 for e in self.engines if e.state == "ready")
            self._cond.notify_all()
        if was == "ready" and not self._stopping:
            log.error("engine %d (%s, pid %s) exited with code %s; %d batch(es) in flight fail, %d engine(s) left",
                      eng.index, eng.device, eng.pid, eng.exitcode, len(lost), left)
        for p in lost:
            self._release(p.segment)
            self._fail(p.members, EngineDied(f"engine {eng.index} ({eng.device}) exited (code {eng.exitcode}) "
                                             "while running this request; retry it"))
        if was == "ready" and left == 0 and not self._stopping:
            self.engine.engines_lost("every engine process exited")

    def _fail(self, members: list[Work], exc: Exception) -> None:
        for w in members:
            self.engine._deliver(w, exc=exc)

    def _release(self, segment: SharedMemory) -> None:
        _close(segment)
        try:
            segment.unlink()
        except FileNotFoundError:
            pass

    # ---- shutdown -----------------------------------------------------------------------------
    def stop(self, timeout: float) -> None:
        with self._cond:
            if self._stopped:
                return
            self._stopping = self._stopped = True
            self._cond.notify_all()
        for eng in self.engines:
            if eng.state == "starting":  # still loading: it would read "stop" only once loaded
                eng.process.terminate()
                continue
            try:
                eng.requests.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for eng in self.engines:
            eng.process.join(max(0.1, deadline - time.monotonic()))
            if eng.process.is_alive():
                log.warning("engine %d did not stop in time: terminating it", eng.index)
                eng.process.terminate()
                eng.process.join(5)
            if eng.process.is_alive():
                eng.process.kill()
                eng.process.join(5)
        for eng in self.engines:
            if eng.watcher is not None:
                eng.watcher.join(5)
            eng.requests.close()
            eng.replies.close()
        with self._cond:
            rest = list(self._pending.values())
            self._pending.clear()
        for p in rest:
            self._release(p.segment)
            self._fail(p.members, NotReady("the server stopped", "stopped"))
        log.info("engine processes stopped")

    # ---- reporting ----------------------------------------------------------------------------
    def stats(self) -> MergedStats:
        return self._merged

    def info(self) -> dict[str, Any]:
        with self._cond:
            engines = [e.as_dict() for e in self.engines]
        return {"data_parallel": len(self.devices), "device": ",".join(self.devices), "engines": engines,
                "capture_failures": self._merged.as_dict()["capture_failures"]}

    def readiness(self) -> dict[str, Any]:
        up = sum(1 for e in self.engines if e.state == "ready")
        return {"status": "ready", "engines": len(self.engines), "engines_up": up, "degraded": up < len(self.engines)}

    def _samples(self) -> list[EngineSample]:
        with self._cond:
            return [EngineSample(str(e.index), e.state == "ready", e.outstanding_tokens, e.batches, e.items,
                                 e.stats.get("graph_items", 0), sum(e.stats.get("eager_items", {}).values()))
                    for e in self.engines]


def _outputs(w: Work, hidden: int, layers: int, served: torch.dtype) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, width) of each tensor the item's request wants, as the in-process engine returns them."""
    spec = w.spec
    out = [("embeds", spec.dtype, hidden)]
    if spec.deepstack:
        out += [(f"deepstack.{j}", spec.dtype, hidden) for j in range(layers)]
    if spec.joined:
        out.append(("joined", spec.dtype, hidden * (1 + layers)))
    if w.want_ec:
        out.append(("ec", served, hidden * (1 + layers)))
    return out


def _layer(name: str) -> int:
    return int(name.rsplit(".", 1)[-1]) if name.startswith("deepstack.") else -1
