"""The engine as the HTTP layer sees it: the queue (admission, deadlines), the worker processes that
prepare media, the batcher and the backends that run batches.

One request's path: each item's bytes go to a worker process (`service.workers`), which reads the
header or container metadata and reports the item's cost before decoding anything; admission counts
that cost against `--max-queued-tokens` (429 above) and lets the worker go on; the worker decodes and
preprocesses into a shared-memory segment; the item joins the batcher's queue; an engine runs its batch
and writes the item's embedding to another segment; the request gets `ItemResult`s that point there.
The event loop owns all of it: no locks, and nothing on it waits for a decoder or a device.
Admission (slots, the token bound, deadlines) is `service.engine.admission`; what the engine reports
about itself, `service.engine.report`.

A request that goes away (deadline, client gone, another item refused) is cancelled as a whole: its
queued media jobs are dropped and the worker processes running them killed, its queued items never
reach a device, and whatever it held in shared memory is unlinked.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from models.config import ProcessorConfig
from service import shm
from service.engine.admission import Admission
from service.engine.backends import Backend, make_backends
from service.engine.batcher import Batcher, Work
from service.engine.report import MergedStats, device_memory, engine_info, engine_samples
from service.engine.types import (
    IMAGE_OPTIONS,
    VIDEO_OPTIONS,
    EngineFailure,
    ItemError,
    ItemResult,
    MediaItem,
    ModelInfo,
    NotReady,
    WorkerLost,
    new_error_id,
)
from service.media.errors import MediaError
from service.media.estimate import Estimate  # imported here, not by the first worker's question on the loop
from service.media.limits import MediaLimits
from service.metrics import Metrics
from service.settings import ServeSettings
from service.workers.pool import JobFailed, Owner, WorkerDied, WorkerPool

log = logging.getLogger("vitserve.engine")
ENGINE_RESTART_ATTEMPTS = 3  # an engine that cannot start three times in a row fails the server
# Media up to this size travel inside the job's message; larger ones through a shared-memory segment of
# their own. The channel carries a message of any size whole (`service.channel`), so this is a matter of
# cost only: a segment costs the front five system calls (create, size, write, close, unlink), and a
# message this small goes to the socket in one write, while a larger one would wait in the front's buffer
# until the worker reads it.
INLINE_MEDIA_BYTES = 64 * 1024



class Engine:
    def __init__(self, settings: ServeSettings, metrics: Metrics | None = None, runner: Any = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.on_fatal = on_fatal
        self.state = "starting"  # starting -> ready -> draining -> stopped, or failed
        self.load_error: str | None = None
        self.names = shm.SegmentNames()
        self.backends: list[Backend] = make_backends(settings, runner)
        waits = self.metrics.worker_wait_seconds
        # A job still running past its request's deadline (and a margin) lost its kill: its worker goes.
        self.workers = WorkerPool(settings.worker_processes(), memory_limit=settings.worker_max_rss_mib * 2**20,
                                  on_wait=lambda job, seconds: waits.labels(job).observe(seconds),
                                  warm_up="service.workers.jobs:warm_up",
                                  job_timeout_s=settings.request_timeout_s + 10)
        self.limits = MediaLimits(max_tokens=settings.max_item_tokens, max_decoded_frames=settings.max_decoded_frames)
        self.batcher = Batcher(settings, self.metrics, self.names, self._dispatched, self._engine_down)
        self.engine_restarts = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.admission = Admission(settings, self.metrics, self.batcher, self.workers)
        self.metrics.attach_pool(MergedStats(self.backends))
        self.metrics.attach_workers(self.workers.stats)
        self.metrics.attach_memory(self.memory)
        if len(self.backends) > 1:
            self.metrics.attach_engines(lambda: engine_samples(self.batcher))

    @property
    def model(self) -> ModelInfo | None:
        """The served model as the front packs for it (its plan grows with learned budgets); None until ready."""
        return self.batcher.model

    @property
    def runner(self) -> Any:
        """The in-process engine's runner (CPU servers and tests), else None."""
        return getattr(self.backends[0], "runner", None) if len(self.backends) == 1 else None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker processes and load the engines (in a thread: health answers meanwhile).
        Call on the event loop that will serve."""
        self.loop = asyncio.get_running_loop()
        removed = shm.sweep_stale()
        if removed:
            log.info("removed %d shared-memory segment(s) left by servers that were killed", removed)
        self.names.open_pool()
        self.workers.start()  # returns at once: the workers fork while the model loads
        threading.Thread(target=self._load, name="vitserve-load", daemon=True).start()

    def _load(self) -> None:
        loop = self.loop
        assert loop is not None
        try:
            threads = [threading.Thread(target=b.load, daemon=True) for b in self.backends[1:]]
            for t in threads:  # several engines load side by side
                t.start()
            infos = [self.backends[0].load()]
            for t in threads:
                t.join()
            failed = [b for b in self.backends if b.state != "ready"]
            if failed:
                b = failed[0]
                raise RuntimeError(f"engine {b.index} ({b.device}) failed to start: "
                                   f"{b.error or f'its process exited with code {b.exitcode}'}")
            infos += [b.model for b in self.backends[1:]]
            if any(i is None or i.plan != infos[0].plan for i in infos):
                raise RuntimeError("the engines made different graph plans from the same settings")
            self.workers.forked.wait()  # ready means media work starts at once, not after the first forks
            if self.workers.start_error:
                raise RuntimeError(self.workers.start_error)
            loop.call_soon_threadsafe(self._ready, infos[0])
        except Exception as exc:  # any start-up failure is fatal: say why and let the server exit
            loop.call_soon_threadsafe(self._load_failed, exc)

    def _ready(self, model: ModelInfo) -> None:
        if self.state != "starting":
            return
        assert self.loop is not None
        self.batcher.start(self.loop, self.backends, model)
        self.state = "ready"
        self.metrics.ready.set(1)
        log.info("ready: %s", self.describe())

    def _load_failed(self, exc: Exception) -> None:
        if self.state != "starting":  # shut down while loading: nothing failed
            log.info("start-up abandoned: the server is stopping (%s)", exc)
            return
        self.state = "failed"
        self.load_error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ValueError) or "failed to start" in str(exc):  # the message says it all
            log.error("start-up failed: %s", self.load_error)
        else:
            log.error("start-up failed: %s", self.load_error, exc_info=(type(exc), exc, exc.__traceback__))
        if self.on_fatal:
            self.on_fatal(self.load_error)

    def describe(self) -> str:
        m = self.model
        if m is None:
            return self.state
        where = ",".join(b.device for b in self.backends)
        graphs = f"graphs={len(m.captured)}{' per engine' if len(self.backends) > 1 else ''}" if m.uses_graphs \
            else "no CUDA graphs (fixed-shape eager runs)"
        return (f"{self.settings.model_name} {m.family or '?'} dtype={m.dtype_name} device={where} {graphs}, "
                f"{self.workers.size} worker processes")

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def unavailable(self) -> str | None:
        """Why a ready server cannot serve right now (None: it can): `/ready` says it with a 503."""
        if not any(b.state == "ready" for b in self.backends):
            return "no engine is running: restarting (weights loading, graphs capturing)"
        if self.workers.live == 0:
            return "no media worker is running: being replaced"
        return None

    # ---- engines that exit --------------------------------------------------------------------
    def _engine_down(self, backend: Backend) -> None:
        """An engine process exited on its own (killed, crashed): start it again, in a thread (weights
        load, graphs are captured anew) while the other engines serve, if any. With none left, new
        requests get 503 and `Retry-After` meanwhile, and `/ready` says why."""
        if self.state not in ("ready", "draining"):
            return
        self.engine_restarts += 1
        self.metrics.engine_restarts.inc()
        if not any(b.state == "ready" for b in self.backends):
            self.metrics.ready.set(0)
        threading.Thread(target=self._restart, args=(backend,), name=f"vitserve-restart-{backend.index}",
                         daemon=True).start()

    def _restart(self, backend: Backend) -> None:
        loop = self.loop
        assert loop is not None
        started = time.monotonic()
        error = ""
        for attempt in range(ENGINE_RESTART_ATTEMPTS):
            if self.state not in ("ready", "draining"):
                return
            log.warning("engine %d: restarting (attempt %d of %d)", backend.index, attempt + 1,
                        ENGINE_RESTART_ATTEMPTS)
            backend.state, backend.error, backend.exitcode = "starting", None, None
            try:
                backend.load()
            except Exception as exc:  # noqa: BLE001 - said, then tried again
                error = str(exc)
                log.error("engine %d: restart failed: %s", backend.index, error)
                time.sleep(min(10.0, 2.0 ** attempt))
                continue
            try:
                loop.call_soon_threadsafe(self._engine_back, backend, time.monotonic() - started)
            except RuntimeError:  # the loop is closed: the server stopped meanwhile
                backend.stop(5)
            return
        try:
            loop.call_soon_threadsafe(self._engines_lost, f"engine {backend.index} could not be restarted: {error}")
        except RuntimeError:
            pass

    def _engine_back(self, backend: Backend, seconds: float) -> None:
        if self.state not in ("ready", "draining"):
            backend.stop(5)
            return
        self.batcher.attach(backend)
        if self.state == "ready":
            self.metrics.ready.set(1)
        log.warning("engine %d (%s, pid %s) is back after %.1fs", backend.index, backend.device, backend.pid, seconds)

    def readiness(self) -> dict[str, Any]:
        if len(self.backends) == 1:
            return {"status": "ready"}
        up = sum(b.state == "ready" for b in self.backends)
        return {"status": "ready", "engines": len(self.backends), "engines_up": up,
                "degraded": up < len(self.backends)}

    def _engines_lost(self, message: str) -> None:
        if self.state in ("stopped", "failed"):
            return
        self.state = "failed"
        self.load_error = message
        self.metrics.ready.set(0)
        log.error("%s: the server cannot serve any more", message)
        if self.on_fatal:
            self.on_fatal(message)

    def begin_drain(self) -> None:
        """Refuse new work from now on; work already admitted runs to completion."""
        if self.state in ("starting", "ready"):
            self.state = "draining"
            log.info("draining: %d request(s) in flight, %d item(s) queued", self.admission.inflight,
                     len(self.batcher.queue))
        self.metrics.ready.set(0)

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight (False if `timeout` passed first)."""
        deadline = time.monotonic() + timeout
        while self.admission.inflight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        if self.state != "failed":
            self.state = "stopped"
        self.metrics.ready.set(0)
        stopped = NotReady("the server stopped", "stopped")
        self.batcher.fail_queue(stopped)
        for b in self.backends:
            b.stop(timeout)
        self.batcher.fail_inflight(stopped)
        self.workers.stop()
        self.names.close_pool()  # the engines and workers, which retire and take its files, are gone
        log.info("stopped: %d engine(s) and %d worker process(es)", len(self.backends), self.workers.size)

    # ---- admission ---------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.state == "ready":
            if not any(b.state == "ready" for b in self.backends):
                raise NotReady("no engine is running: one is restarting; retry", "restarting")
            return
        if self.state == "starting":
            raise NotReady("the server is starting: weights loading or graphs capturing", "starting")
        if self.state == "draining":
            raise NotReady("the server is shutting down", "draining")
        raise NotReady(f"the server is not serving ({self.state})", self.state)

    def _check_admitted(self) -> None:
        if self.state not in ("ready", "draining"):
            self.check_accepting()

    def request_slot(self) -> AbstractContextManager[None]:
        """One of `--max-concurrent-requests` slots for the request's whole life, else 429."""
        return self.admission.request_slot()

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    @property
    def processor(self) -> ProcessorConfig:
        if self.model is None:
            raise NotReady("the server is starting", "starting")
        return self.model.processor

    @property
    def family(self) -> str:
        return str(self.model.family or "") if self.model else ""

    def _dispatched(self, works: list[Work]) -> None:
        self.admission.release(sum(w.tokens for w in works))

    # ---- the request path --------------------------------------------------------------------
    def new_request(self) -> Owner:
        return Owner(new_error_id().removeprefix("err-"))

    async def encode(self, items: Sequence[MediaItem], request: Owner | None = None,
                     deadline: float | None = None) -> list[ItemResult]:
        """Prepare, admit, batch and run `items`; their results, in order. Called by requests that hold
        a slot, so a drain that began meanwhile does not refuse them: it waits for them. The first item
        that fails fails the request; cancelling the call (deadline, client gone) or a failure cancels
        all of the request's work. `deadline` (`time.monotonic()`): refused at once with 429 if the work
        ahead cannot be done by then (before any decoding), and each item again with its own tokens."""
        self._check_admitted()
        self.admission.check_deadline(0, deadline, before_workers=True)
        request = request or self.new_request()
        started = time.monotonic()
        tally: dict[str, Any] = {"tokens": 0, "deadline": deadline}
        jobs = [asyncio.ensure_future(self._prepare(request, it, tally)) for it in items]
        for job in jobs:  # failures after the first are not news
            job.add_done_callback(lambda j: j.cancelled() or j.exception())
        works: list[Work] = []
        self.batcher.preparing += 1
        try:
            try:
                for ready in asyncio.as_completed(jobs):
                    work = await ready
                    works.append(work)
                    self.batcher.add([work])  # it may run while its siblings still decode
            finally:
                self.batcher.preparing -= 1
                self.batcher.kick()
            prepared = time.monotonic()
            works.sort(key=lambda w: w.index)
            results = list(await asyncio.gather(*(w.future for w in works)))
            self.metrics.phase_seconds.labels("prepare").observe(prepared - started)
            self.metrics.phase_seconds.labels("engine").observe(time.monotonic() - prepared)
            return results
        except BaseException:
            self.cancel(request)
            for job in jobs:
                job.cancel()
            for w in works:  # results that came back before the failure
                if w.future.done() and not w.future.cancelled() and w.future.exception() is None:
                    shm.unlink(w.future.result().output.segment)
            queued = {id(w) for w in works}
            for job in jobs:  # prepared as the failure came, never queued: its pixels and tokens are ours
                if job.done() and not job.cancelled() and job.exception() is None and id(job.result()) not in queued:
                    shm.unlink(job.result().pixels)
                    self.admission.release(job.result().tokens)
            raise

    def cancel(self, request: Owner) -> None:
        """Stop all of the request's work: media jobs, queued items (pixels unlinked by the batcher)."""
        if not request.cancelled:
            self.workers.cancel(request)
            self.batcher.kick()

    async def _prepare(self, request: Owner, item: MediaItem, tally: dict[str, Any]) -> Work:
        model = self.model
        assert model is not None
        options = self._options(item, model.processor)
        source = bytes(item.data) if len(item.data) <= INLINE_MEDIA_BYTES else self.names.next("in")
        pixels = self.names.next("px")
        reserved = 0
        estimated = False

        def admit(cost: Estimate) -> bool:
            nonlocal reserved, estimated
            if reserved:  # asked again: the job runs once more on another worker (its first one died)
                tally["tokens"] -= reserved
                self.admission.release(reserved)
                reserved = 0
            units = model.geometry.units(cost.grid_thw)  # what the queue counts, as `Work.tokens` does
            if not estimated:
                estimated = True
                self.admission.estimated(units)
            tally["tokens"] += units
            self.admission.admit(units, tally["tokens"], tally["deadline"])
            reserved = units
            return True

        self.admission.unestimated += 1
        try:
            if isinstance(source, str):
                try:
                    shm.write_array(source, _as_array(item.data))
                except OSError as exc:
                    raise _storage_error(exc) from None
            try:
                prepared = await self.workers.call(request, "service.workers.jobs:prepare_media", source,
                                                   len(item.data), item.modality, model.processor, options,
                                                   self.limits, pixels, on_ask=admit, leaves=(pixels,))
            except MediaError as exc:
                raise ItemError(item.index, exc.reason, exc.code, exc.status) from None
            except WorkerDied as exc:
                if exc.reason == "memory":
                    raise ItemError(item.index, str(exc), "too_much_memory", 413) from None
                if exc.reason == "stopped":
                    raise NotReady("the server is stopping", "stopped") from None
                if exc.reason == "deadline":
                    raise asyncio.TimeoutError(str(exc)) from None
                if exc.reason != "crash":  # killed from outside, its channel failed...: not the item's doing
                    raise WorkerLost(f"item {item.index}: {exc}") from None
                raise ItemError(item.index, f"{exc}: the media is probably malformed", "decoder_crashed") from None
            except JobFailed as exc:
                error_id = new_error_id()
                log.error("item %d: preparing it failed, error id %s: %s", item.index, error_id, exc)
                raise EngineFailure(f"internal error {error_id}: {exc}", error_id) from None
        except BaseException:
            shm.unlink(pixels)
            self.admission.release(reserved)
            raise
        finally:
            if not estimated:
                self.admission.unestimated -= 1
            if isinstance(source, str):
                shm.unlink(source)
        self.metrics.preprocess_seconds.observe(prepared.seconds)
        self.admission.prepared(prepared.seconds)
        tokens = model.geometry.units(prepared.grid_thw)
        self.admission.release(reserved - tokens)  # the queue counts the exact tokens from here on
        assert self.loop is not None
        rows = model.geometry.tokens(prepared.grid_thw, item.modality)
        return Work(request, item.index, item.modality, item.id, prepared.grid_thw, prepared.num_patches, tokens, rows,
                    prepared.meta, pixels, self.loop.create_future(), prepared.seconds)

    def _options(self, item: MediaItem, cfg: ProcessorConfig) -> dict[str, Any]:
        allowed = IMAGE_OPTIONS if item.modality == "image" else VIDEO_OPTIONS
        extra = sorted(set(item.options) - set(allowed))
        if extra:
            raise ItemError(item.index, f"option(s) {', '.join(extra)} do not apply to {item.modality} items",
                            "invalid_option")
        opts = {k: v for k, v in item.options.items() if v is not None}
        if item.modality == "image":
            caps = {"max_pixels": cfg.max_pixels}
        else:
            v = cfg.video
            caps = {"max_pixels": v.max_pixels, "total_pixels": v.total_pixels, "max_frames": v.max_frames,
                    "nframes": v.max_frames}
        for name, cap in caps.items():
            if name in opts and opts[name] > cap:
                raise ItemError(item.index, f"{name} {opts[name]} is above this server's limit of {cap}",
                                "invalid_option")
        # Bounds that contradict each other are refused only when the client sent both. One sent bound
        # past the processor's other one is taken as transformers' processors take it: both go to
        # smart_resize, where max_pixels shrinks a large image and min_pixels grows a small one.
        if opts.get("min_pixels", 0) > opts.get("max_pixels", float("inf")):
            raise ItemError(item.index, f"min_pixels {opts['min_pixels']} is above max_pixels {opts['max_pixels']}",
                            "invalid_option")
        return opts

    def release(self, results: Sequence[ItemResult]) -> None:
        """The response is sent: the results' segments go."""
        for r in results:
            if not r.cached:
                shm.unlink(r.output.segment)

    # ---- reporting ---------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """What `/info` says about the engine: its state, limits and workers, and once loaded its model,
        graphs, pool and device memory."""
        return engine_info(self)

    def memory(self) -> list[dict[str, Any] | None]:
        """Each engine's device memory, as it last reported (None on the CPU)."""
        return device_memory(self.backends)


def _as_array(data: bytes) -> Any:
    import numpy as np

    return np.frombuffer(data, dtype=np.uint8)


def _storage_error(exc: OSError) -> Exception:
    from service.engine.types import StorageFull

    if exc.errno == 28:
        return StorageFull("shared memory (/dev/shm) is full: the server needs more room there")
    return exc
