"""The engine as the HTTP layer sees it: the queue (admission, deadlines), the worker processes that
prepare media, the batcher and the backends that run batches.

One request's path: each item's bytes go to a worker process (`service.workers`), which reads the
header or container metadata and reports the item's cost before decoding anything; admission counts
that cost against `--max-queued-tokens` (429 above) and lets the worker go on; the worker decodes and
preprocesses into a shared-memory segment; the item joins the batcher's queue; an engine runs its batch
and writes the item's embedding to another segment; the request gets `ItemResult`s that point there.
The event loop owns all of it: no locks, and nothing on it waits for a decoder or a device.

A request that goes away (deadline, client gone, another item refused) is cancelled as a whole: its
queued media jobs are dropped and the worker processes running them killed, its queued items never
reach a device, and whatever it held in shared memory is unlinked.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from models.config import ProcessorConfig
from service import shm
from service.engine.backends import Backend, make_backends
from service.engine.batcher import Batcher, Work
from service.engine.types import (
    IMAGE_OPTIONS,
    VIDEO_OPTIONS,
    EngineFailure,
    ItemError,
    ItemResult,
    MediaItem,
    ModelInfo,
    NotReady,
    Overloaded,
    RequestRejected,
    WorkerLost,
    new_error_id,
)
from service.media.errors import MediaError
from service.media.estimate import Estimate  # imported here, not by the first worker's question on the loop
from service.media.limits import MediaLimits
from service.metrics import EngineSample, Metrics
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


# The share of a request's time left that the work ahead of it may take at the measured rate: the rest
# is for decoding it, encoding its response, and the rate's error (the batches ahead may run slower
# than the last ones did). A request admitted closer to its deadline ends, more often than not, in a 504
# after the whole wait, where a 429 at once would have told its client to come back.
DEADLINE_SHARE = 0.8
PREPARE_WARM_UP = 2  # items prepared before their time is trusted
PREPARE_DECAY = 0.8  # per item
ITEM_TOKENS_DECAY = 0.9  # per item


class Engine:
    def __init__(self, settings: ServeSettings, metrics: Metrics | None = None, runner: Any = None,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.on_fatal = on_fatal
        self.state = "starting"  # starting -> ready -> draining -> stopped, or failed
        self.load_error: str | None = None
        self.model: ModelInfo | None = None
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
        self._inflight = 0  # requests holding a slot
        self._reserved = 0  # tokens admitted and not yet handed to an engine
        self._prepared = 0  # items prepared by the workers
        self._unestimated = 0  # items on their way to a worker, their tokens not known yet
        self._item_tokens: float | None = None  # tokens of one item, decayed mean of the estimates
        self._prepare_s: float | None = None  # seconds a worker spends on one item, decayed mean
        self.metrics.attach_pool(_MergedStats(self.backends))
        self.metrics.attach_workers(self.workers.stats)
        self.metrics.attach_memory(self.memory)
        if len(self.backends) > 1:
            self.metrics.attach_engines(self._samples)

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
        self.workers.start()
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
            loop.call_soon_threadsafe(self._ready, infos[0])
        except Exception as exc:  # any start-up failure is fatal: say why and let the server exit
            loop.call_soon_threadsafe(self._load_failed, exc)

    def _ready(self, model: ModelInfo) -> None:
        if self.state != "starting":
            return
        self.model = model
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
            log.info("draining: %d request(s) in flight, %d item(s) queued", self._inflight, len(self.batcher.queue))
        self.metrics.ready.set(0)

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight (False if `timeout` passed first)."""
        deadline = time.monotonic() + timeout
        while self._inflight > 0:
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

    @contextmanager
    def request_slot(self) -> Iterator[None]:
        """One of `--max-concurrent-requests` slots for the request's whole life, else 429."""
        if self._inflight >= self.settings.max_concurrent_requests:
            raise Overloaded(f"{self._inflight} requests in flight, the limit is "
                             f"{self.settings.max_concurrent_requests}")
        self._inflight += 1
        self.metrics.inflight.set(self._inflight)
        try:
            yield
        finally:
            self._inflight -= 1
            self.metrics.inflight.set(self._inflight)

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def processor(self) -> ProcessorConfig:
        if self.model is None:
            raise NotReady("the server is starting", "starting")
        return self.model.processor

    @property
    def family(self) -> str:
        return str(self.model.family or "") if self.model else ""

    def _admit(self, tokens: int, request_tokens: int, deadline: float | None = None) -> None:
        """Count an item's estimated tokens against the queue bound (before any decoding), and refuse it
        if the work ahead of it cannot be done by its request's `deadline` (`time.monotonic()`)."""
        limit = self.settings.queue_tokens_limit
        if request_tokens > limit:
            raise RequestRejected(f"the request needs {request_tokens} tokens, above the queue limit of {limit} "
                                  "(--max-queued-tokens): send fewer or smaller items", "too_many_tokens")
        if self._reserved + tokens > limit:
            raise Overloaded(f"the queue holds {self._reserved} tokens; {tokens} more would pass the limit of "
                             f"{limit}")
        self._check_deadline(tokens, deadline)
        self._reserved += tokens
        self.metrics.queue_tokens.set(self._reserved)

    def _check_deadline(self, tokens: int, deadline: float | None, before_workers: bool = False) -> None:
        """429 now for work that would end in a 504: what is ahead of it takes longer than the time left
        until `deadline` (`time.monotonic()`).

        Ahead of an item: the tokens decoded and queued before it and those on the engines (the queue is
        served in order of arrival), at the engines' measured rate. Items still being decoded are not
        counted: a slow one (a long video) does not hold up the small items decoded after it. Ahead of
        a request that has not reached a worker yet (`before_workers`), also the items waiting for a
        worker, at the usual item's tokens, and the media jobs queued or running, at the measured time
        of one over the workers. Decoding and encoding proceed side by side, so the longer of the two is
        the least the request must wait. Nothing is refused on a guess: a measure not taken yet counts
        for nothing (the token bound still holds). Retry-After is when a request with a fresh deadline
        would fit, were nothing added.
        """
        if deadline is None:
            return
        waits: list[tuple[float, str]] = []
        rate = self.batcher.rate()
        if rate:
            ahead = self.batcher.queued_tokens + self.batcher.outstanding_tokens
            if before_workers and self._item_tokens is not None:  # items ahead, not yet read: the usual size
                ahead += round(self._unestimated * self._item_tokens)
            waits.append(((ahead + tokens) / rate, f"{ahead + tokens} tokens to encode at the measured "
                                                   f"{rate:.0f} tokens/s"))
        if before_workers and self._prepare_s is not None:
            stats = self.workers.stats()
            jobs, workers = stats["busy"] + stats["queued"], max(1, stats["workers"])
            waits.append((jobs / workers * self._prepare_s, f"{jobs} media jobs ahead for {workers} workers at "
                                                             f"the measured {self._prepare_s * 1000:.0f} ms each"))
        if not waits:
            return
        needed, why = max(waits)
        left = deadline - time.monotonic()
        if needed <= left * DEADLINE_SHARE:
            return
        wait = max(1, math.ceil(needed - self.settings.request_timeout_s * DEADLINE_SHARE))
        raise Overloaded(f"the server is behind: {why} take about {needed:.1f}s, and the request has "
                         f"{max(left, 0):.1f}s left (--request-timeout-s); retry later", wait, "deadline_unreachable")

    def _release(self, tokens: int) -> None:
        self._reserved -= tokens
        self.metrics.queue_tokens.set(self._reserved)

    def _dispatched(self, works: list[Work]) -> None:
        self._release(sum(w.tokens for w in works))

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
        self._check_deadline(0, deadline, before_workers=True)
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
                    self._release(job.result().tokens)
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
                self._release(reserved)
                reserved = 0
            if not estimated:
                estimated = True
                self._unestimated -= 1
                self._item_tokens = cost.tokens if self._item_tokens is None else \
                    ITEM_TOKENS_DECAY * self._item_tokens + (1 - ITEM_TOKENS_DECAY) * cost.tokens
            tally["tokens"] += cost.tokens
            self._admit(cost.tokens, tally["tokens"], tally["deadline"])
            reserved = cost.tokens
            return True

        self._unestimated += 1
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
            self._release(reserved)
            raise
        finally:
            if not estimated:
                self._unestimated -= 1
            if isinstance(source, str):
                shm.unlink(source)
        self.metrics.preprocess_seconds.observe(prepared.seconds)
        self._prepared += 1
        if self._prepared > PREPARE_WARM_UP:  # a worker's first items pay for its warm-up
            self._prepare_s = prepared.seconds if self._prepare_s is None else \
                PREPARE_DECAY * self._prepare_s + (1 - PREPARE_DECAY) * prepared.seconds
        tokens = prepared.num_patches // model.merge_unit
        self._release(reserved - tokens)  # the queue counts the exact tokens from here on
        assert self.loop is not None
        return Work(request, item.index, item.modality, item.id, prepared.grid_thw, prepared.num_patches, tokens,
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
    def _samples(self) -> list[EngineSample]:
        return [EngineSample(str(r["gpu"]), r["state"] == "ready", r["outstanding_tokens"], r["batches"],
                             r["items"], r["graph_hits"], r["graph_misses"]) for r in self.batcher.engine_rows()]

    def info(self) -> dict[str, Any]:
        s = self.settings
        out: dict[str, Any] = {
            "state": self.state,
            "model": s.model_name,
            "model_source": s.model,
            "eager": s.eager,
            "limits": {
                "max_batch_tokens": s.max_batch_tokens,
                "max_wait_ms": s.max_wait_ms,
                "max_queued_tokens": s.queue_tokens_limit,
                "max_concurrent_requests": s.max_concurrent_requests,
                "max_payload_bytes": s.max_payload_bytes,
                "max_items_per_request": s.max_items_per_request,
                "request_timeout_s": s.request_timeout_s,
                "allow_url": s.allow_url,
                "allowed_hosts": s.allowed_hosts,
            },
            "workers": self.workers.stats(),
            "engine_restarts": self.engine_restarts,
            "ec_shared_storage": str(s.ec_shared_storage) if s.ec_shared_storage else None,
        }
        if self.load_error:
            out["error"] = self.load_error
        m = self.model
        if m is None:
            return out
        proc = m.processor
        out.update({
            "family": m.family,
            "dtype": m.dtype_name,
            "device": ",".join(b.device for b in self.backends),
            "out_hidden_size": m.out_hidden_size,
            "num_deepstack": m.num_deepstack,
            "merge_unit": m.merge_unit,
            "budgets": list(m.plan.budgets),
            "max_batch_items": m.plan.max_items,
            "t_capture": m.plan.t_capture,
            "captured": list(m.captured),
            "graphs": self._graphs(),
            "capture_failures": _MergedStats(self.backends).as_dict()["capture_failures"],
            "processor": {
                "patch_size": proc.patch_size,
                "merge_size": proc.merge_size,
                "temporal_patch_size": proc.temporal_patch_size,
                "min_pixels": proc.min_pixels,
                "max_pixels": proc.max_pixels,
                "video": {"fps": proc.video.fps, "min_frames": proc.video.min_frames,
                          "max_frames": proc.video.max_frames, "min_pixels": proc.video.min_pixels,
                          "max_pixels": proc.video.max_pixels, "total_pixels": proc.video.total_pixels},
            },
            "pool": _MergedStats(self.backends).as_dict(),
            "memory": self.memory()[0] if len(self.backends) == 1 else self.memory(),
        })
        if len(self.backends) > 1:
            out.update(data_parallel=len(self.backends), engines=self.batcher.engine_rows())
        return out


    def memory(self) -> list[dict[str, Any] | None]:
        """Each engine's device memory, as it last reported (None on the CPU)."""
        return [(b.stats or {}).get("memory") for b in self.backends]

    def _graphs(self) -> dict[str, Any]:
        """How the keys run: CUDA graphs (how many per engine), or fixed-shape eager forwards and why."""
        stats = self.backends[0].stats or {}
        return {"mode": stats.get("graph_mode", "off"), "captured": stats.get("captured_graphs", 0),
                "keys": stats.get("graph_keys", 0), "reason": stats.get("no_graphs_reason")}


class _MergedStats:
    """The engines' pool statistics (`PoolStats.as_dict()`), summed; a dead engine's counts stay."""

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends

    def as_dict(self) -> dict[str, Any]:
        snaps = [b.stats for b in self.backends if b.stats]
        total = {k: sum(s.get(k, 0) for s in snaps) for k in
                 ("graph_items", "eager_batches", "chunked_videos", "video_chunks", "captured_graphs", "pool_bytes")}
        eager: Counter = Counter()
        replays: Counter = Counter()
        failures: dict[str, str] = {}
        for b in self.backends:
            eager.update(b.stats.get("eager_items", {}))
            replays.update(b.stats.get("replays", {}))
            prefix = f"{b.index}:" if len(self.backends) > 1 else ""
            failures.update({f"{prefix}{k}": v for k, v in b.stats.get("capture_failures", {}).items()})
        served = total["graph_items"] + sum(eager.values())
        return {**total, "eager_items": dict(eager), "replays": dict(replays), "capture_failures": failures,
                "hit_rate": round(total["graph_items"] / served, 4) if served else 0.0,
                "capture_seconds": max((s.get("capture_seconds", 0.0) for s in snaps), default=0.0)}


def _as_array(data: bytes) -> Any:
    import numpy as np

    return np.frombuffer(data, dtype=np.uint8)


def _storage_error(exc: OSError) -> Exception:
    from service.engine.types import StorageFull

    if exc.errno == 28:
        return StorageFull("shared memory (/dev/shm) is full: the server needs more room there")
    return exc
