"""The batcher: the one home of the batching policy, on the event loop.

Items arrive with their pixels ready in shared memory. Whenever an engine has room (at most
`MAX_INFLIGHT` batches each on its device: one running, the next staged behind it; a batch whose
outputs are still being written does not count) the batcher takes the queue, packs it
(`graphs.packing.pack`: token budgets, splits over smaller budgets, replay or eager by the engine's
measured costs) and hands the batches to the engines with the fewest outstanding tokens; what finds
no room goes back to the queue and is packed again, with whatever arrived meanwhile, at the next
chance. A batch may wait to fill for at most `--max-wait-ms`, and only while other admitted requests
are still preparing their media: nothing else could join it in time, so a lone request goes at once.

Items of one request may land in different batches and engines; each has its own future. Items whose
request went away are dropped before packing; a batch already running finishes, and its results are
discarded. One dispatch path whether there is one engine or several.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graphs.packing import PackItem, pack
from service import shm
from service.engine.backends import Backend
from service.engine.padding import PaddingLedger
from service.engine.types import (
    BatchJob,
    EngineDied,
    EngineFailure,
    ItemResult,
    JobItem,
    ModelInfo,
    OutputRef,
    StorageFull,
)
from service.metrics import Metrics

log = logging.getLogger("vitserve.engine")

# Batches per engine on its device: one running, two staged behind it. With one staged, two GPUs behind
# 256 clients sat idle between small batches while the next was packed, sent and read in (two GPUs at
# 1.81x one with one staged, 1.88x with two, measured on two H200s).
MAX_INFLIGHT = 3


@dataclass(eq=False)
class Work:
    """One item ready for the device."""

    request: Any  # whose item it is: `.cancelled` tells whether anyone still waits
    index: int
    modality: str
    id: str | None
    grid_thw: tuple[int, int, int]
    num_patches: int
    tokens: int  # budget units (patches / merge_unit): what it costs the queue and the device
    rows: int  # output rows: the merged tokens the language model sees (models.protocol.Geometry.tokens)
    meta: dict[str, Any]
    pixels: str  # segment with its uint8 rows
    future: asyncio.Future
    preprocess_s: float = 0.0
    enqueued: float = field(default_factory=time.monotonic)


class Throughput:
    """An engine's measured rate in merged tokens per second, over its recent batches.

    A batch's service time runs to its completion from the later of the engine's previous completion and
    the moment the batch's first item was ready in the queue: what the engine spends on it (staging, the
    device, writing its outputs) and the front's time between batches while work waited (dispatching, which
    a loaded host stretches), but nothing of the time the engine sat idle with no work. The rate is decayed
    sums of tokens over decayed sums of those times, so large batches weigh as much as their tokens (a lone
    small batch, slower per token, does not drag down the estimate of a loaded engine). Nor the time before
    the engine took work (`since`): an engine back from a restart, its first batch queued while it was
    down, would otherwise be charged for its restart, and its rate, a tenth of the true one for a dozen
    batches, would refuse work with 429 that it could do in time. None until `MIN_BATCHES` batches are
    measured: the first ones pay for warm-up."""

    DECAY = 0.8  # per batch
    MIN_BATCHES = 3

    def __init__(self, since: float = 0.0) -> None:
        self.tokens = 0.0
        self.seconds = 0.0
        self.batches = 0
        self.last_done = since  # `time.monotonic()` when the engine began to take batches

    def add(self, tokens: int, ready: float, done: float) -> None:
        """A batch of `tokens`, its first item queued at `ready`, came back at `done` (`time.monotonic()`)."""
        busy = done - max(ready, self.last_done)
        self.last_done = done
        if busy <= 0:
            return
        self.tokens = self.tokens * self.DECAY + tokens
        self.seconds = self.seconds * self.DECAY + busy
        self.batches += 1

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.batches >= self.MIN_BATCHES and self.seconds > 0 else None


@dataclass(eq=False)
class _InFlight:
    engine: Backend
    job: BatchJob
    works: list[Work]
    dispatched: float
    on_device: bool = True  # until the engine says "free"


class Batcher:
    def __init__(self, settings: Any, metrics: Metrics, names: shm.SegmentNames,
                 on_dispatched: Callable[[list[Work]], None], on_engine_down: Callable[[Backend], None]) -> None:
        self.settings = settings
        self.metrics = metrics
        self.names = names
        self.on_dispatched = on_dispatched  # the works left the queue (admission releases their tokens)
        self.on_engine_down = on_engine_down  # an engine exited on its own: the engine restarts it
        self.engines: list[Backend] = []
        self.model: ModelInfo | None = None
        self.queue: list[Work] = []
        self.preparing = 0  # admitted requests still decoding: a batch may wait for them
        self.loop: asyncio.AbstractEventLoop | None = None
        self._inflight: dict[int, _InFlight] = {}
        self._outstanding: dict[int, int] = {}  # engine index -> tokens handed over, not yet returned
        self._jobs = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._scheduled = False
        self.batches: dict[int, int] = {}  # engine index -> batches completed
        self.items: dict[int, int] = {}
        self.throughput: dict[int, Throughput] = {}
        self.padding = PaddingLedger()
        # Budgets learned from the ledger (`--learn-budgets`): taught to one engine at a time (each pauses its
        # batches for the capture), added to the plan once every live engine has them.
        self.learned: list[int] = []
        self.refused: dict[int, str] = {}  # budget -> why an engine could not take it
        self._wanted: list[int] = []  # being taught
        self._lessons: collections.deque[tuple[int, int]] = collections.deque()  # (budget, engine index) to teach
        self._teaching: tuple[int, int] | None = None
        self._learned_cost: dict[int, float] = {}  # budget -> seconds of a replay, as the first engine measured
        self._learners: dict[int, set[int]] = collections.defaultdict(set)  # budget -> engines that have it

    def start(self, loop: asyncio.AbstractEventLoop, engines: list[Backend], model: ModelInfo) -> None:
        self.loop, self.engines, self.model = loop, engines, model
        for e in engines:
            self.batches[e.index] = self.items[e.index] = 0
            self.attach(e)

    def attach(self, engine: Backend) -> None:
        """Take batches to `engine` from now on: at start, and when it is back from a restart (measured
        afresh, from now)."""
        assert self.loop is not None
        self._outstanding[engine.index] = 0
        self.throughput[engine.index] = Throughput(since=time.monotonic())
        engine.attach(self.loop, self._on_reply, self._on_exit)
        for budget in [*self.learned, *self._wanted]:  # back from a restart: it lost what it had learned
            self._lessons.append((budget, engine.index))
        self._teach()
        self.kick()

    # ---- the queue ----------------------------------------------------------------------------
    def add(self, works: list[Work]) -> None:
        now = time.monotonic()
        for w in works:
            w.enqueued = now
        self.queue.extend(works)
        self._publish()
        self.kick()

    def kick(self) -> None:
        """Look at the queue soon (once per loop iteration, however many events asked)."""
        if not self._scheduled and self.loop is not None:
            self._scheduled = True
            self.loop.call_soon(self._tick)

    @property
    def queued_tokens(self) -> int:
        return sum(w.tokens for w in self.queue)

    @property
    def outstanding_tokens(self) -> int:
        """Tokens handed to the engines and not yet returned."""
        return sum(self._outstanding.values())

    def rate(self) -> float | None:
        """Merged tokens per second the live engines get through together, as measured; None until every
        live engine has been measured (an engine not yet measured could be far slower or faster)."""
        rates = [self.throughput[e.index].rate for e in self.engines if e.state == "ready"]
        if not rates or None in rates:
            return None
        return sum(r for r in rates if r is not None)

    def _publish(self) -> None:
        self.metrics.queue_items.set(len(self.queue))

    def _on_device(self, engine: Backend) -> int:
        return sum(f.engine is engine and f.on_device for f in self._inflight.values())

    def _free(self) -> list[Backend]:
        return [e for e in self.engines if e.state == "ready" and self._on_device(e) < MAX_INFLIGHT]

    def _tick(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        dropped = [w for w in self.queue if w.request.cancelled]
        if dropped:
            self.queue = [w for w in self.queue if not w.request.cancelled]
            self._discard(dropped)
        if not self.queue or self.model is None:
            self._publish()
            return
        free = self._free()
        if not free:
            return  # a completion kicks again
        oldest = min(w.enqueued for w in self.queue)
        wait = oldest + self.settings.max_wait_ms / 1000 - time.monotonic()
        if self.preparing and self.queued_tokens < self.model.plan.max_budget and wait > 0:
            assert self.loop is not None
            self._timer = self.loop.call_later(wait, self.kick)
            return
        self._dispatch(free)

    def _dispatch(self, free: list[Backend]) -> None:
        assert self.model is not None
        works, self.queue = self.queue, []
        works.sort(key=lambda w: w.enqueued)
        plan = self.model.plan
        items = [PackItem.of(w.grid_thw, w.modality, self.model.geometry) for w in works]
        left: list[Work] = []
        for batch in pack(items, plan, self.model.cost):
            members = [works[i] for i in batch.items]
            engine = self._pick(free)
            if engine is None:
                left += members
                continue
            if batch.reason is None and batch.key is not None and str(batch.key) in engine.model.capture_failures:
                batch.reason = "capture_failed"
            self._send(engine, batch, members)
        self.queue = sorted(left, key=lambda w: w.enqueued)
        self._publish()

    def _pick(self, free: list[Backend]) -> Backend | None:
        room = [e for e in free if self._on_device(e) < MAX_INFLIGHT]
        return min(room, key=lambda e: (self._outstanding[e.index], e.index), default=None)

    def _send(self, engine: Backend, batch: Any, members: list[Work]) -> None:
        job_id = next(self._jobs)
        batch.items = list(range(len(members)))
        job = BatchJob(job_id, batch, tuple(
            JobItem(w.modality, w.grid_thw, w.pixels, self.names.next("out")) for w in members))
        now = time.monotonic()
        for w in members:
            self.metrics.queue_seconds.observe(now - w.enqueued)
        self._inflight[job_id] = _InFlight(engine, job, members, now)
        self._outstanding[engine.index] += batch.tokens
        self.on_dispatched(members)
        engine.submit(job)

    # ---- results ------------------------------------------------------------------------------
    def _on_reply(self, engine: Backend, message: tuple) -> None:
        kind = message[0]
        if kind == "learned":
            self._learned(engine, message[1], message[2])
            return
        if kind == "free":  # the batch left the device: another may be staged while its outputs are written
            freed = self._inflight.get(message[1])
            if freed is not None:
                freed.on_device = False
                self.kick()
            return
        flight = self._inflight.pop(message[1], None) if kind in ("done", "error") else None
        if flight is None:
            return
        self._outstanding[engine.index] -= flight.job.batch.tokens
        if kind == "done":  # the engine has retired the job's pixels, as it does on "error" too
            ready = min((w.enqueued for w in flight.works), default=flight.dispatched)
            self.throughput[engine.index].add(flight.job.batch.tokens, ready, time.monotonic())
            self.metrics.engine_rate.set(self.rate() or 0)
            _, _, seconds, device_s, stats, steps = message
            engine.stats = stats
            self.metrics.device_seconds.observe(device_s)
            for step, step_s in steps.items():
                self.metrics.engine_step_seconds.labels(step).observe(step_s)
            self._complete(flight, seconds)
        else:
            _, _, error_id, text, code = message
            exc = StorageFull(text) if code == "insufficient_storage" else EngineFailure(text, error_id)
            self._fail(flight, exc)
        self.kick()

    def _complete(self, flight: _InFlight, seconds: float) -> None:
        assert self.model is not None
        m, batch = self.model, flight.job.batch
        self.metrics.gpu_seconds.observe(seconds)
        self.metrics.batch_tokens.observe(batch.tokens)
        self.metrics.batch_items.observe(len(flight.works))
        if batch.replays and not self.settings.eager:  # a replay pays its whole budget (eager: its own tokens)
            self.padding.add(batch.key.modality, batch.tokens, batch.key.budget)
            if (sizes := self.padding.new_suggestion(m.plan.budgets)) is not None:
                log.info("%.0f%% of the graph replays' budgets is padding; batches of %s tokens recur: %s",
                         100 * self.padding.share, ", ".join(map(str, sizes)),
                         "learning them as budgets" if self.settings.learn_budgets else
                         f"adding them to --budgets (--budgets auto,{','.join(map(str, sizes))}) gives them graphs "
                         "of their own (/info padding)")
                self._learn(sizes)
            self.metrics.replay_tokens.labels("items").inc(batch.tokens)
            self.metrics.replay_tokens.labels("padding").inc(batch.key.budget - batch.tokens)
        self.batches[flight.engine.index] += 1
        self.items[flight.engine.index] += len(flight.works)
        for w, it in zip(flight.works, flight.job.items):
            self.metrics.items.labels(w.modality).inc()
            self.metrics.tokens.inc(w.tokens)
            if w.future.done() or w.request.cancelled:  # it ran for nobody: its request went away meanwhile
                self.metrics.cancelled.inc()
                shm.unlink(it.output)
                continue
            w.future.set_result(ItemResult(
                index=w.index, modality=w.modality, id=w.id, grid_thw=w.grid_thw,  # type: ignore[arg-type]
                num_patches=w.num_patches, num_tokens=w.rows, meta=w.meta,
                output=OutputRef(it.output, w.rows, m.width, m.dtype_name),
                preprocess_s=w.preprocess_s, queue_s=flight.dispatched - w.enqueued, gpu_s=seconds))

    # ---- learned budgets --------------------------------------------------------------------------
    def _learn(self, sizes: list[int]) -> None:
        """Teach the engines these batch sizes as budgets, within `--learn-budgets`."""
        assert self.model is not None
        for budget in sizes:
            room = len(self.learned) + len(self._wanted) < self.settings.learn_budgets
            known = budget in self.model.plan.budgets or budget in self._wanted or budget in self.refused
            if room and not known and budget < self.model.plan.max_budget:
                self._wanted.append(budget)
                self._lessons.extend((budget, e.index) for e in self.engines if e.state == "ready")
        self._teach()

    def _teach(self) -> None:
        """Send the next lesson, unless one is under way: one engine pauses at a time, the others serve."""
        while self._teaching is None and self._lessons:
            budget, index = self._lessons.popleft()
            engine = next((e for e in self.engines if e.index == index), None)
            if engine is not None and engine.state == "ready":  # one that is down learns it once back
                self._teaching = (budget, index)
                engine.learn(budget)
        self._plan_learned()

    def _learned(self, engine: Backend, result: Any, stats: dict) -> None:
        engine.stats = stats
        if self._teaching == (result.budget, engine.index):
            self._teaching = None
        budget = result.budget
        if result.ok:
            cost = dict(result.cost.replays).get(budget) if result.cost is not None else None
            if cost is not None:
                self._learned_cost.setdefault(budget, cost)
            self._learners[budget].add(engine.index)
            log.info("engine %d learned budget %d in %.2fs", engine.index, budget, result.seconds)
        elif budget in self._wanted:
            self._wanted.remove(budget)
            self.refused[budget] = result.reason
            self._lessons = collections.deque(lesson for lesson in self._lessons if lesson[0] != budget)
            log.warning("budget %d not learned: engine %d refused it (%s)", budget, engine.index, result.reason)
        self._teach()

    def _plan_learned(self) -> None:
        """Budgets every live engine has now go into the plan (with the measured cost of a replay)."""
        if self.model is None:
            return
        for budget in list(self._wanted):
            pending = any(lesson[0] == budget for lesson in [*self._lessons, *filter(None, [self._teaching])])
            if pending or not self._learners[budget]:  # none has it (all down meanwhile): wait for them
                continue
            self._wanted.remove(budget)
            self.learned.append(budget)
            m = self.model
            cost = m.cost
            if cost is not None and budget in self._learned_cost:
                cost = dataclasses.replace(cost, replays=tuple(sorted(
                    {**dict(cost.replays), budget: self._learned_cost[budget]}.items())))
            self.model = dataclasses.replace(m, plan=m.plan.with_budget(budget), cost=cost)
            log.info("budget %d is in the plan (budgets %s; --budgets auto,%s keeps it across restarts)", budget,
                     ",".join(map(str, self.model.plan.budgets)), ",".join(map(str, sorted(self.learned))))

    def learning_report(self) -> dict[str, Any]:
        """For /info: budgets learned while serving, being taught, and refused (with why)."""
        return {"limit": self.settings.learn_budgets, "learned": sorted(self.learned), "learning": list(self._wanted),
                "refused": {str(b): why for b, why in self.refused.items()}}

    def _fail(self, flight: _InFlight, exc: Exception) -> None:
        for w, it in zip(flight.works, flight.job.items):
            shm.unlink(it.output)
            if not w.future.done():
                w.future.set_exception(exc)

    def _discard(self, works: list[Work]) -> None:
        """Queued items nobody waits for any more: their pixels go, they never reach a device."""
        self.metrics.cancelled.inc(len(works))
        for w in works:
            shm.unlink(w.pixels)
        self.on_dispatched(works)

    def _on_exit(self, engine: Backend) -> None:
        lost = [f for f in self._inflight.values() if f.engine is engine]
        for f in lost:
            del self._inflight[f.job.id]
            for it in f.job.items:
                shm.unlink(it.pixels)
            self._fail(f, EngineDied(f"engine {engine.index} ({engine.device}) exited (code {engine.exitcode}) "
                                     "while running this request; retry it"))
        self._outstanding[engine.index] = 0
        for learners in self._learners.values():  # a new process learns them again
            learners.discard(engine.index)
        if self._teaching is not None and self._teaching[1] == engine.index:
            self._teaching = None  # its lessons are taught again when it is back
            self._teach()
        if engine.state == "stopped":
            return
        left = sum(e.state == "ready" for e in self.engines)
        log.error("engine %d (%s, pid %s) exited with code %s; %d batch(es) in flight fail, %d engine(s) left",
                  engine.index, engine.device, engine.pid, engine.exitcode, len(lost), left)
        if left == 0:  # nothing would run the queue until the restart: its requests are told to come back
            self.fail_queue(EngineDied("no engine is running: one is restarting; retry"))
        self.on_engine_down(engine)
        self.kick()

    def fail_queue(self, exc: Exception) -> None:
        works, self.queue = self.queue, []
        for w in works:
            shm.unlink(w.pixels)
            if not w.future.done():
                w.future.set_exception(exc)
        self.on_dispatched(works)
        self._publish()

    def fail_inflight(self, exc: Exception) -> None:
        for f in list(self._inflight.values()):
            for it in f.job.items:
                shm.unlink(it.pixels)
            self._fail(f, exc)
        self._inflight.clear()

    # ---- reporting ----------------------------------------------------------------------------
    def engine_rows(self) -> list[dict[str, Any]]:
        rows = []
        for e in self.engines:
            stats = e.stats or {}
            rows.append({"gpu": e.index, "device": e.device, "pid": e.pid, "state": e.state, "exitcode": e.exitcode,
                         "error": e.error, "threads": e.threads or None,
                         "outstanding_tokens": self._outstanding.get(e.index, 0),
                         "outstanding_batches": sum(f.engine is e for f in self._inflight.values()),
                         "batches": self.batches.get(e.index, 0), "items": self.items.get(e.index, 0),
                         "learned_budgets": sorted(b for b, has in self._learners.items() if e.index in has),
                         "graph_hits": stats.get("graph_items", 0),
                         "graph_misses": sum(stats.get("eager_items", {}).values())})
        return rows
