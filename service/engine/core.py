"""The engine: admission, the queues and continuous batching into the graph runner.

One dedicated thread owns the device and is the only caller of `GraphRunner.run_batch`. Whenever it
is free it takes everything queued (images and videos alike: packing groups by modality itself),
waiting at most `max_wait_ms` after the oldest item arrived for a batch to fill, packs it and runs
the batches, converting each item's output to the requested dtype on the host before handing it
back. The asyncio side only enqueues under a short lock and awaits futures: it never waits on the
device. Decoding and preprocessing run in a thread pool (PIL, numpy and PyAV release the GIL).
Items of one request may land in different batches; each has its own future, so the request
reassembles them in order. Items whose request went away (timeout, disconnect) are skipped.

What the engine thread does with the work it takes is a `Backend`'s job: `InProcessBackend` (one
engine, the default) runs it here through the `GraphRunner`; `service.engine.processes.ProcessPoolBackend`
(`--data-parallel N`) packs it and hands each batch to the least-loaded of N engine processes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from graphs.runner import GraphRunner, ItemOutput
from models.config import ProcessorConfig, VisualInput
from service.engine.loading import bind_device, build_runner
from service.engine.types import (
    IMAGE_OPTIONS,
    VIDEO_OPTIONS,
    EngineDied,
    EngineError,
    EngineFailure,
    ItemError,
    ItemResult,
    MediaItem,
    ModelInfo,
    NotReady,
    OutputSpec,
    Overloaded,
    RequestRejected,
    Work,
    new_error_id,
)
from service.media.errors import MediaError
from service.metrics import Metrics
from service.settings import ServeSettings

log = logging.getLogger("vitserve.engine")
class Backend(Protocol):
    """Where the engine thread's work runs. `load` runs on the loading thread, `wait_capacity` and
    `process` on the engine thread (`process` settles every item it is given: a result or an
    exception), `stop` after the engine thread ended; the reporting methods on any thread."""

    def load(self) -> ModelInfo:
        """Load weights and capture graphs (blocking); raise if the model cannot be served."""
        ...

    def wait_capacity(self, stopping: Callable[[], bool]) -> None:
        """Block the engine thread until a batch can be handed over (or `stopping()`)."""
        ...

    def process(self, work: list[Work]) -> None:
        """Run (or hand over) the work taken from the queues."""
        ...

    def stop(self, timeout: float) -> None:
        """Release the devices; work still outstanding fails."""
        ...

    def stats(self) -> Any:
        """Pool statistics (`as_dict()`), summed over the engines."""
        ...

    def info(self) -> dict[str, Any]:
        """Backend-specific fields of /info (none for the in-process engine)."""
        ...

    def readiness(self) -> dict[str, Any]:
        """The body of a 200 from /ready."""
        ...


class InProcessBackend:
    """One engine: the engine thread runs every batch through the engine's own `GraphRunner`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def load(self) -> ModelInfo:
        e = self.engine
        if e.runner is None:
            e.runner = e._build_runner()
        e.metrics.attach_pool(e.runner.stats)
        return ModelInfo.from_runner(e.runner)

    def wait_capacity(self, stopping: Callable[[], bool]) -> None:
        return  # the engine thread itself runs the work: it is free whenever it asks

    def process(self, work: list[Work]) -> None:
        self.engine._process(work)

    def stop(self, timeout: float) -> None:
        return

    def stats(self) -> Any:
        return self.engine.runner.stats if self.engine.runner else None

    def info(self) -> dict[str, Any]:
        return {}

    def readiness(self) -> dict[str, Any]:
        return {"status": "ready"}


class Engine:
    def __init__(self, settings: ServeSettings, metrics: Metrics | None = None,
                 runner: GraphRunner | None = None, on_fatal: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.runner: GraphRunner | None = runner
        self.on_fatal = on_fatal
        self.state = "starting"  # starting -> ready -> draining -> stopped, or failed
        self.load_error: str | None = None
        self.model: ModelInfo | None = None  # set once loaded
        self.backend: Backend = self._make_backend()
        self.started_at = time.time()
        self.pool = ThreadPoolExecutor(settings.preprocess_workers, thread_name_prefix="vitserve-pre")
        self._cond = threading.Condition()
        self._preparing = 0  # requests admitted and preprocessing, not yet queued
        self._queues: dict[str, deque[Work]] = {"image": deque(), "video": deque()}
        self._queued_items = 0
        self._queued_tokens = 0
        self._inflight = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        """Load weights and capture graphs (in a thread, so health and readiness answer meanwhile)."""
        if background:
            threading.Thread(target=self._load, name="vitserve-load", daemon=True).start()
        else:
            self._load()

    def _make_backend(self) -> Backend:
        devices = self.settings.engine_devices()
        if len(devices) == 1:
            return InProcessBackend(self)
        if self.runner is not None:
            raise ValueError("a runner is given: --data-parallel must be 1")
        from service.engine.processes import ProcessPoolBackend  # spawns processes: only imported when asked for

        return ProcessPoolBackend(self, devices)

    def _load(self) -> None:
        try:
            self.model = self.backend.load()
            self._thread = threading.Thread(target=self._run, name="vitserve-engine", daemon=True)
            self._thread.start()
            with self._cond:
                if self.state == "starting":
                    self.state = "ready"
            self.metrics.ready.set(1 if self.state == "ready" else 0)
            log.info("ready: %s", self.describe())
        except Exception as exc:  # any start-up failure is fatal: say why and let the server exit
            if self._stopping:  # shut down while loading: nothing failed
                log.info("start-up abandoned: the server is stopping (%s)", exc)
                return
            self.state = "failed"
            self.load_error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ValueError):  # bad checkpoint or settings: the message says it all
                log.error("start-up failed: %s", self.load_error)
            else:
                log.exception("start-up failed: %s", self.load_error)
            if self.on_fatal:
                self.on_fatal(self.load_error)

    def _build_runner(self) -> GraphRunner:
        return build_runner(self.settings)

    def describe(self) -> str:
        m = self.model
        if m is None:
            return self.state
        engines = self.backend.info().get("engines", [])
        where = f"device={m.device}" if not engines else f"devices={','.join(e['device'] for e in engines)}"
        return (f"{self.settings.model_name} {m.family or '?'} dtype={m.dtype} {where} "
                f"graphs={len(m.captured)}{' per engine' if engines else ''}")

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def readiness(self) -> dict[str, Any]:
        return self.backend.readiness()

    def engines_lost(self, message: str) -> None:
        """Every engine process exited (called by the process pool): fail what waits, then exit."""
        with self._cond:
            if self.state in ("stopped", "failed"):
                return
            self.state = "failed"
            self.load_error = message
        self.metrics.ready.set(0)
        log.error("%s: the server cannot serve any more", message)
        self._fail_queued(EngineDied(message))
        if self.on_fatal:
            self.on_fatal(message)

    def begin_drain(self) -> None:
        """Refuse new work from now on; work already admitted runs to completion."""
        with self._cond:
            changed = self.state in ("starting", "ready")
            if changed:
                self.state = "draining"
        self.metrics.ready.set(0)
        if changed:
            log.info("draining: %d request(s) in flight, %d item(s) queued", self._inflight, self._queued_items)

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight (False if `timeout` passed first)."""
        deadline = time.monotonic() + timeout
        while self._inflight > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            if self.state != "failed":
                self.state = "stopped"
            self._cond.notify_all()
        self.metrics.ready.set(0)
        if self._thread is not None:
            self._thread.join(timeout)
        self.backend.stop(timeout)
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- admission ---------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.state == "ready":
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
    def served_dtype(self) -> torch.dtype | None:
        return self.model.dtype if self.model else None

    @property
    def family(self) -> str:
        return str(self.model.family or "") if self.model else ""

    # ---- the request path (event loop) -------------------------------------------------------
    async def encode(self, items: Sequence[MediaItem], spec: OutputSpec) -> list[ItemResult]:
        """Preprocess, admit, queue and await `items`. Called by requests that already hold a slot, so
        a drain that began meanwhile does not refuse them: it waits for them."""
        self._check_admitted()
        model = self.model
        assert model is not None
        loop = asyncio.get_running_loop()
        with self._cond:
            self._preparing += 1  # the engine may hold a batch open for this request (see _take)
        try:
            prepared = await self._preprocess_all(items, loop)
            merge_unit = model.merge_unit
            tokens = [v.num_patches // merge_unit for v, _ in prepared]
            total = sum(tokens)
            limit = self.settings.queue_tokens_limit
            if total > limit:
                raise RequestRejected(f"the request needs {total} tokens, above the queue limit of {limit} "
                                      "(--max-queued-tokens): send fewer or smaller items", "too_many_tokens")
            works = [
                Work(it, v, n, spec, spec.ec_cache, loop.create_future(), loop, dt)
                for it, (v, dt), n in zip(items, prepared, tokens)
            ]
        except BaseException:
            with self._cond:
                self._preparing -= 1
                self._cond.notify()  # a batch held open for this request need not wait for it
            raise
        with self._cond:
            self._preparing -= 1  # with the enqueue, atomically: no batch leaves between the two
            self._check_admitted()
            if self._queued_tokens + total > limit:
                raise Overloaded(f"the queue holds {self._queued_tokens} tokens; {total} more would pass "
                                 f"the limit of {limit}")
            now = time.monotonic()
            for w in works:
                w.enqueued = now
                self._queues[w.visual.modality].append(w)
            self._queued_items += len(works)
            self._queued_tokens += total
            self._publish_queue()
            self._cond.notify()
        try:
            return list(await asyncio.gather(*(w.future for w in works)))
        except BaseException:
            for w in works:  # the engine skips these; their futures are dropped
                w.cancelled = True
                if not w.future.done():
                    w.future.cancel()
            raise

    async def _preprocess_all(self, items: Sequence[MediaItem],
                              loop: asyncio.AbstractEventLoop) -> list[tuple[VisualInput, float]]:
        cfg = self.processor
        jobs = [loop.run_in_executor(self.pool, self._preprocess, it, cfg) for it in items]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for res in results:  # report the first bad item by index
            if isinstance(res, BaseException):
                raise res
        return results  # type: ignore[return-value]

    def _preprocess(self, item: MediaItem, cfg: ProcessorConfig) -> tuple[VisualInput, float]:
        t0 = time.perf_counter()
        try:
            if item.modality == "image":
                visual = self._preprocess_image(item, cfg)
            else:
                visual = self._preprocess_video(item, cfg)
        except MediaError as exc:
            raise ItemError(item.index, exc.reason, exc.code) from None
        dt = time.perf_counter() - t0
        self.metrics.preprocess_seconds.observe(dt)
        return visual, dt

    def _preprocess_image(self, item: MediaItem, cfg: ProcessorConfig) -> VisualInput:
        from service.media.image_preprocess import preprocess_image_bytes

        opts = _options(item, IMAGE_OPTIONS)
        lo = opts.get("min_pixels", cfg.min_pixels)
        hi = opts.get("max_pixels", cfg.max_pixels)
        if hi > cfg.max_pixels:
            raise ItemError(item.index, f"max_pixels {hi} is above this server's limit of {cfg.max_pixels}",
                            "invalid_option")
        if lo > hi:
            raise ItemError(item.index, f"min_pixels {lo} is above max_pixels {hi}", "invalid_option")
        return preprocess_image_bytes(item.data, cfg, min_pixels=lo, max_pixels=hi)

    def _preprocess_video(self, item: MediaItem, cfg: ProcessorConfig) -> VisualInput:
        try:
            from service.media.video_preprocess import preprocess_video_bytes
        except ImportError:
            raise ItemError(item.index, "video input is not available in this build", "unsupported_type") from None
        opts = _options(item, VIDEO_OPTIONS)
        v = cfg.video
        caps = {"max_pixels": v.max_pixels, "total_pixels": v.total_pixels, "max_frames": v.max_frames,
                "nframes": v.max_frames}
        for name, cap in caps.items():
            if name in opts and opts[name] > cap:
                raise ItemError(item.index, f"{name} {opts[name]} is above this server's limit of {cap}",
                                "invalid_option")
        return preprocess_video_bytes(item.data, cfg, **opts)

    # ---- the engine thread -------------------------------------------------------------------
    def _publish_queue(self) -> None:
        self.metrics.queue_items.set(self._queued_items)
        self.metrics.queue_tokens.set(self._queued_tokens)

    def _take(self) -> list[Work] | None:
        """Block until work is queued, let a batch fill for at most max_wait_ms, take it all."""
        max_wait = self.settings.max_wait_ms / 1000
        full = self.model.plan.max_budget if self.model else self.settings.max_batch_tokens
        with self._cond:
            while not self._queued_items and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            oldest = min(q[0].enqueued for q in self._queues.values() if q)
            # Hold the batch open only while another request is still being preprocessed: nothing
            # else could join it in time, so a lone request goes at once.
            while self._queued_tokens < full and self._preparing and not self._stopping:
                remaining = oldest + max_wait - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            work = [w for q in self._queues.values() for w in q]
            work.sort(key=lambda w: w.enqueued)
            for q in self._queues.values():
                q.clear()
            self._queued_items = 0
            self._queued_tokens = 0
            self._publish_queue()
            return work

    def _run(self) -> None:
        if self.runner is not None:
            bind_device(self.runner.device)
        while True:
            self.backend.wait_capacity(lambda: self._stopping)
            work = self._take()
            if work is None:
                break
            try:
                self.backend.process(work)
            except Exception as exc:  # never let the loop die: fail what was taken, keep serving
                error_id = new_error_id()
                log.exception("engine error %s", error_id)
                for w in work:
                    self._deliver(w, exc=EngineFailure(f"internal error {error_id}: {type(exc).__name__}", error_id))
        self._fail_queued(NotReady("the server stopped", "stopped"))

    def _fail_queued(self, exc: EngineError) -> None:
        with self._cond:
            work = [w for q in self._queues.values() for w in q]
            for q in self._queues.values():
                q.clear()
            self._queued_items = self._queued_tokens = 0
            self._publish_queue()
        for w in work:
            self._deliver(w, exc=exc)

    def _process(self, work: list[Work]) -> None:
        runner = self.runner
        assert runner is not None
        live = [w for w in work if not w.cancelled]
        if len(live) < len(work):
            self.metrics.cancelled.inc(len(work) - len(live))
        if not live:
            return
        taken = time.monotonic()
        for w in live:
            self.metrics.queue_seconds.observe(taken - w.enqueued)
        delay = self.settings.batch_delay_ms / 1000
        for batch in runner.pack_items([w.visual for w in live]):
            members = [live[i] for i in batch.items]
            if all(w.cancelled for w in members):
                self.metrics.cancelled.inc(len(members))
                continue
            if delay:
                time.sleep(delay)
            t0 = time.perf_counter()
            try:
                outs = runner.run_batch(batch, [w.visual for w in members])
                results = self._to_host_batch(members, outs, taken)
            except Exception as exc:
                error_id = new_error_id()
                log.exception("batch %s of %d item(s) failed, error id %s", batch.key, len(members), error_id)
                failure = EngineFailure(f"internal error {error_id}: {type(exc).__name__}", error_id)
                for w in members:
                    self._deliver(w, exc=failure)
                continue
            gpu_s = time.perf_counter() - t0
            self.metrics.gpu_seconds.observe(gpu_s)
            self.metrics.batch_tokens.observe(batch.tokens)
            self.metrics.batch_items.observe(len(members))
            for w, res in zip(members, results):
                res.gpu_s = gpu_s
                self.metrics.items.labels(w.visual.modality).inc()
                self.metrics.tokens.inc(w.tokens)
            self._deliver_all(members, results)

    def _to_host_batch(self, members: list[Work], outs: list[ItemOutput], taken: float) -> list[ItemResult]:
        """Every item's result on the host. The rows of all items that want the same dtype cross in one
        copy per output (embeddings, each DeepStack level) rather than one per item: fewer device
        syncs and fewer GIL handovers on the engine thread."""
        embeds: list[torch.Tensor | None] = [None] * len(members)
        deepstack: list[list[torch.Tensor]] = [[] for _ in members]
        groups: dict[torch.dtype, list[int]] = {}
        for i, w in enumerate(members):
            groups.setdefault(w.spec.dtype, []).append(i)
        for dtype, idx in groups.items():
            for i, host in zip(idx, _host_rows([outs[i].embeds for i in idx], dtype)):
                embeds[i] = host
            ds_idx = [i for i in idx if members[i].spec.deepstack]
            for level in range(len(outs[0].deepstack) if ds_idx else 0):
                for i, host in zip(ds_idx, _host_rows([outs[i].deepstack[level] for i in ds_idx], dtype)):
                    deepstack[i].append(host)
        device = outs[0].embeds.device
        if device.type == "cuda":  # the copies above are asynchronous: one wait for all of them
            torch.cuda.current_stream(device).synchronize()
        return [self._to_host(w, out, taken, e, d)  # type: ignore[arg-type]
                for w, out, e, d in zip(members, outs, embeds, deepstack)]

    def _to_host(self, w: Work, out: ItemOutput, taken: float, embeds: torch.Tensor,
                 deepstack: list[torch.Tensor]) -> ItemResult:
        """Requested dtype and layout on the host, so the event loop never syncs (`embeds` and
        `deepstack` are there already, from _to_host_batch)."""
        spec = w.spec
        parts = [out.embeds, *out.deepstack]
        # Only the vLLM format and the encoder cache want DeepStack beside the embedding: concatenate lazily.
        joined = torch.cat(parts, dim=-1) if len(parts) > 1 and (spec.joined or w.want_ec) else out.embeds
        v = w.visual
        return ItemResult(
            index=w.item.index,
            modality=v.modality,
            id=w.item.id,
            grid_thw=tuple(int(x) for x in v.grid_thw),  # type: ignore[arg-type]
            num_patches=v.num_patches,
            num_tokens=w.tokens,
            meta=dict(v.meta),
            embeds=embeds,
            deepstack=deepstack,
            joined=_host(joined, spec.dtype) if spec.joined else None,
            ec_cache=_host(joined, joined.dtype) if w.want_ec else None,
            preprocess_s=w.preprocess_s,
            queue_s=taken - w.enqueued,
        )

    def _deliver_all(self, members: list[Work], results: list[ItemResult]) -> None:
        """A batch's results, one wake-up of each event loop for all of them: every wake-up is a
        write to the loop's pipe, which releases and retakes the GIL on the engine thread."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, ItemResult]]] = {}
        for w, res in zip(members, results):
            by_loop.setdefault(w.loop, []).append((w.future, res))
        for loop, settled in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle_all, settled)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def _deliver(self, w: Work, result: ItemResult | None = None, exc: BaseException | None = None) -> None:
        try:
            w.loop.call_soon_threadsafe(_settle, w.future, result, exc)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    # ---- reporting ---------------------------------------------------------------------------
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
            "ec_shared_storage": str(s.ec_shared_storage) if s.ec_shared_storage else None,
        }
        if self.load_error:
            out["error"] = self.load_error
        m = self.model
        if m is None:
            return out
        proc = m.processor
        stats = self.backend.stats()
        out.update({
            "family": m.family,
            "dtype": str(m.dtype).removeprefix("torch."),
            "device": m.device,
            "out_hidden_size": m.out_hidden_size,
            "num_deepstack": m.num_deepstack,
            "merge_unit": m.merge_unit,
            "budgets": list(m.plan.budgets),
            "max_batch_items": m.plan.max_items,
            "t_capture": m.plan.t_capture,
            "captured": list(m.captured),
            "capture_failures": dict(m.capture_failures),
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
            "pool": stats.as_dict() if stats is not None else {},
            **self.backend.info(),
        })
        return out


def _options(item: MediaItem, allowed: tuple[str, ...]) -> dict[str, Any]:
    extra = sorted(set(item.options) - set(allowed))
    if extra:
        raise ItemError(item.index, f"option(s) {', '.join(extra)} do not apply to {item.modality} items",
                        "invalid_option")
    return {k: v for k, v in item.options.items() if v is not None}


def _host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).contiguous().cpu()


def _host_rows(parts: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Several [rows, D] tensors on the host in one copy; returns views of it, one per part. From a
    GPU the copy goes into page-locked memory and is asynchronous: the caller waits on the stream."""
    joined = parts[0] if len(parts) == 1 else torch.cat(parts)
    if joined.dtype != dtype:
        joined = joined.to(dtype)
    if joined.device.type == "cuda":
        host = torch.empty(joined.shape, dtype=dtype, pin_memory=True)
        host.copy_(joined, non_blocking=True)
    else:
        host = joined.contiguous()
    return list(host.split([p.shape[0] for p in parts]))


def _settle_all(settled: list[tuple[asyncio.Future, Any]]) -> None:
    for future, result in settled:
        _settle(future, result, None)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


