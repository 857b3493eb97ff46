"""Prometheus metrics of one server: a registry per app, so several apps can live in one process."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = tuple(float(2**k) for k in range(4, 18))
ITEM_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LAG_PERIOD_S = 0.1

# No `*_created` series: they double the exposition and dashboards never use them.
disable_created_metrics()


class StatsSource(Protocol):
    """The runner's `PoolStats`, or the sum over the engines of a multi-engine server."""

    def as_dict(self) -> dict[str, Any]: ...


@dataclass
class EngineSample:
    """One engine of a multi-engine server (`--data-parallel`), as the metrics show it."""

    gpu: str
    up: bool
    outstanding_tokens: int
    batches: int
    items: int
    graph_hits: int
    graph_misses: int


class PoolCollector(Collector):
    """Graph hits/misses and eager items by reason, read from the runner's counters at scrape time."""

    def __init__(self, stats: Callable[[], StatsSource | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterable:
        stats = self._stats()
        hits = CounterMetricFamily("vitserve_graph_hits", "Items served by a captured graph replay")
        misses = CounterMetricFamily("vitserve_graph_misses", "Items run eagerly (no graph held them)")
        eager = CounterMetricFamily("vitserve_eager_items", "Items run eagerly, by reason", labels=["reason"])
        captured = GaugeMetricFamily("vitserve_graphs_captured", "Graphs in the pool")
        failed = GaugeMetricFamily("vitserve_graph_capture_failures", "Graph keys whose capture failed")
        checks = GaugeMetricFamily("vitserve_self_check_failed", "1 where a path (eager or graphs, per modality) "
                                   "failed its start-up encode and is not served, else 0", labels=["path"])
        if stats is not None:
            data = stats.as_dict()
            hits.add_metric([], data["graph_items"])
            misses.add_metric([], sum(data["eager_items"].values()))
            for reason, n in sorted(data["eager_items"].items()):
                eager.add_metric([reason], n)
            captured.add_metric([], data["captured_graphs"])
            failed.add_metric([], len(data["capture_failures"]))
            for path, result in sorted(data.get("self_check", {}).items()):
                checks.add_metric([path], 0 if result == "ok" else 1)
        yield from (hits, misses, eager, captured, failed, checks)


class EngineCollector(Collector):
    """Per-engine series with a `gpu` label, read from the process pool at scrape time."""

    def __init__(self, engines: Callable[[], list[EngineSample]]) -> None:
        self._engines = engines

    def collect(self) -> Iterable:
        up = GaugeMetricFamily("vitserve_engine_up", "1 while the engine process serves, 0 once it exited",
                               labels=["gpu"])
        outstanding = GaugeMetricFamily("vitserve_engine_outstanding_tokens",
                                        "Merged tokens handed to the engine and not yet returned", labels=["gpu"])
        batches = CounterMetricFamily("vitserve_engine_batches", "Batches the engine ran", labels=["gpu"])
        items = CounterMetricFamily("vitserve_engine_items", "Items the engine encoded", labels=["gpu"])
        hits = CounterMetricFamily("vitserve_engine_graph_hits", "Items the engine served by a graph replay",
                                   labels=["gpu"])
        misses = CounterMetricFamily("vitserve_engine_graph_misses", "Items the engine ran eagerly", labels=["gpu"])
        for e in self._engines():
            up.add_metric([e.gpu], 1 if e.up else 0)
            outstanding.add_metric([e.gpu], e.outstanding_tokens)
            batches.add_metric([e.gpu], e.batches)
            items.add_metric([e.gpu], e.items)
            hits.add_metric([e.gpu], e.graph_hits)
            misses.add_metric([e.gpu], e.graph_misses)
        yield from (up, outstanding, batches, items, hits, misses)


class WorkerCollector(Collector):
    """The media workers by state, why they were replaced, and the jobs run again (`WorkerPool.stats`)."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable:
        stats = self._stats()
        workers = GaugeMetricFamily("vitserve_workers", "Media worker processes by state: idle and busy ones "
                                    "serve, starting and dying ones are being replaced", labels=["state"])
        for state, n in stats["states"].items():
            workers.add_metric([state], n)
        restarts = CounterMetricFamily("vitserve_worker_restarts", "Media workers replaced, by cause: crash (it "
                                       "exited, or was killed from outside), memory, cancelled, deadline, channel, "
                                       "unresponsive", labels=["cause"])
        for cause, n in stats["restarts_by_cause"].items():
            restarts.add_metric([cause], n)
        retries = CounterMetricFamily("vitserve_worker_retries", "Jobs run again because their worker died of "
                                      "something other than the job itself")
        retries.add_metric([], stats["retries"])
        yield from (workers, restarts, retries)


class MemoryCollector(Collector):
    """Device memory of each engine by kind (weights, graph pool, ...), as the engines last reported it."""

    KINDS = ("limit", "weights", "graph_pool", "other_allocated", "outside_allocator", "peak_reserved", "free")

    def __init__(self, memory: Callable[[], list[dict[str, Any] | None]]) -> None:
        self._memory = memory

    def collect(self) -> Iterable:
        family = GaugeMetricFamily("vitserve_gpu_memory_bytes", "Device memory by kind, per engine: the budget "
                                   "(--gpu-memory), weights, graph pool and buffers, other allocator blocks, outside "
                                   "the allocator (CUDA context, libraries), the allocator's peak, free on the device",
                                   labels=["gpu", "kind"])
        for i, report in enumerate(self._memory()):
            for kind in self.KINDS:
                value = (report or {}).get(kind)
                if value is not None:
                    family.add_metric([str(i), kind], value)
        yield family

class CacheCollector(Collector):
    """The encoder-output cache and the shared encoder-cache folder (service.handoff), read at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable:
        data = self._stats()
        hits = CounterMetricFamily("vitserve_cache_hits", "Items answered without the engine, by where the output "
                                   "was found (memory: the host cache or a repeat in the request; storage: a "
                                   "valid file in --ec-shared-storage)", labels=["source"])
        for source, n in sorted(data["hits"].items()):
            hits.add_metric([source], n)
        misses = CounterMetricFamily("vitserve_cache_misses", "Items the engine encoded because no cache held them")
        misses.add_metric([], data["misses"])
        evictions = CounterMetricFamily("vitserve_cache_evictions", "Entries evicted to stay within the bound",
                                        labels=["store"])
        size = GaugeMetricFamily("vitserve_cache_bytes", "Bytes held", labels=["store"])
        items = GaugeMetricFamily("vitserve_cache_items", "Entries held", labels=["store"])
        for store in ("memory", "storage"):
            part = data.get(store)
            if part is None:
                continue
            evictions.add_metric([store], part["evictions"])
            size.add_metric([store], part["bytes"])
            items.add_metric([store], part["items"])
        writes = CounterMetricFamily("vitserve_ec_storage_writes", "Files written to --ec-shared-storage")
        errors = CounterMetricFamily("vitserve_ec_storage_write_errors", "Failed writes to --ec-shared-storage")
        if data.get("storage") is not None:
            writes.add_metric([], data["storage"]["writes"])
            errors.add_metric([], data["storage"]["write_errors"])
        fetches = CounterMetricFamily("vitserve_encoder_cache_fetches", "GET /v1/encoder_cache/{id} by result (miss: "
                                      "the id is unknown or its output was evicted before the LLM server asked)",
                                      labels=["result"])
        for result, n in sorted(data.get("fetches", {}).items()):
            fetches.add_metric([result], n)
        coalesced = CounterMetricFamily("vitserve_cache_coalesced", "Items that waited for an identical item "
                                        "being encoded for another request instead of encoding it again")
        coalesced.add_metric([], data.get("coalesced", 0))
        yield from (hits, misses, evictions, size, items, writes, errors, fetches, coalesced)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # process_cpu_seconds_total, resident memory, open fds (Linux /proc; absent elsewhere): whether
        # the server is bound by its own CPU, e.g. one core's worth under the GIL.
        ProcessCollector(registry=r)
        self.requests = Counter("vitserve_requests", "Requests to /encode by HTTP status", ["status"], registry=r)
        self.request_seconds = Histogram("vitserve_request_duration_seconds", "Total /encode latency",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("vitserve_queue_duration_seconds", "Time an item waited in the queue",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.preprocess_seconds = Histogram("vitserve_preprocess_duration_seconds",
                                            "Decoding and preprocessing time of one item",
                                            buckets=LATENCY_BUCKETS, registry=r)
        self.render_seconds = Histogram("vitserve_render_duration_seconds",
                                        "Time to encode one response's body in the worker processes (or in the server, "
                                        "for a request alone in flight)",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.phase_seconds = Histogram("vitserve_request_phase_duration_seconds",
                                       "Where one /encode request's time went, in order: body (reading it), parse "
                                       "(validating it, fetching its URLs), prepare (until its last item is decoded "
                                       "and queued: waiting for workers included), engine (until its last result is "
                                       "back: queue, device and replies); render has its own histogram",
                                       ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.worker_wait_seconds = Histogram("vitserve_worker_wait_duration_seconds",
                                             "Time a job waited for a free worker process, by job (prepare_media: "
                                             "an item's media; encode_item, encode_safetensors: a response)",
                                             ["job"], buckets=LATENCY_BUCKETS, registry=r)
        self.gpu_seconds = Histogram("vitserve_gpu_duration_seconds",
                                     "Time of one batch in its engine: from staging its pixels (while the "
                                     "batch before it may still run) to its outputs written",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.device_seconds = Histogram("vitserve_device_duration_seconds",
                                        "Device time of one batch alone: from its start on the device (or the "
                                        "previous batch's end) to its results on the host. Its sum's rate is "
                                        "how busy the engines are (1 per engine at most)",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.engine_step_seconds = Histogram("vitserve_engine_step_duration_seconds",
                                             "Host time of one batch's steps in its engine: stage (its pixels "
                                             "read into one page-locked buffer), launch (its copies and replay "
                                             "or forward enqueued; on the CPU, the forward itself), write (its "
                                             "outputs into their segments)",
                                             ["step"], buckets=LATENCY_BUCKETS, registry=r)
        self.loop_lag_seconds = Histogram("vitserve_event_loop_lag_seconds",
                                          f"How late the event loop ran a callback due now (sampled every "
                                          f"{LAG_PERIOD_S:g} s): what every request's next step waits for while "
                                          "the loop, or the GIL, is held by other work",
                                          buckets=LAG_BUCKETS, registry=r)
        self.queue_items = Gauge("vitserve_queue_items", "Items ready and waiting for an engine", registry=r)
        self.queue_tokens = Gauge("vitserve_queue_tokens", "Merged tokens admitted and not yet on an engine "
                                  "(estimated before decoding; the bound of --max-queued-tokens)", registry=r)
        self.inflight = Gauge("vitserve_requests_in_flight", "Requests being served", registry=r)
        self.batch_tokens = Histogram("vitserve_batch_tokens", "Merged tokens per batch",
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.batch_items = Histogram("vitserve_batch_items", "Items per batch", buckets=ITEM_BUCKETS, registry=r)
        self.replay_tokens = Counter("vitserve_replay_tokens", "Tokens of the budgets graph replays ran: the items' "
                                     "own, and the padding that filled the rest", ["kind"], registry=r)
        self.items = Counter("vitserve_items", "Items encoded, by modality", ["modality"], registry=r)
        self.tokens = Counter("vitserve_tokens", "Merged tokens encoded", registry=r)
        self.cancelled = Counter("vitserve_cancelled_items", "Items whose request went away (client gone or timed "
                                 "out): dropped from the queue, or their result discarded", registry=r)
        self.ready = Gauge("vitserve_ready", "1 when the server accepts work", registry=r)
        self.engine_rate = Gauge("vitserve_engine_rate_tokens_per_second",
                                 "Merged tokens per second the engines get through together, measured over their "
                                 "recent batches (0 until measured): what admission divides the work ahead by",
                                 registry=r)
        self.connections_dropped = Counter(
            "vitserve_connections_dropped", "Connections closed without an answer to a request, by reason: "
            "idle_timeout (kept-alive, idle past --keep-alive-timeout-s), no_request (nothing sent within "
            "--header-timeout-s), client_closed (the client closed or reset it with a request unanswered), "
            "aborted (the server gave up on it mid-request or mid-response)", ["reason"], registry=r)
        self.engine_restarts = Counter("vitserve_engine_restarts", "Engine processes started again after they "
                                       "exited (killed, crashed)", registry=r)
        self._pool_stats: StatsSource | None = None
        r.register(PoolCollector(lambda: self._pool_stats))

    def attach_pool(self, stats: StatsSource) -> None:
        self._pool_stats = stats

    def attach_workers(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(WorkerCollector(stats))

    def attach_memory(self, memory: Callable[[], list[dict[str, Any] | None]]) -> None:
        self.registry.register(MemoryCollector(memory))

    def attach_cache(self, stats: Callable[[], dict[str, Any]]) -> None:
        """The hand-off's cache series (`Handoff.stats`): hits, misses, evictions, bytes."""
        self.registry.register(CacheCollector(stats))

    def attach_engines(self, engines: Callable[[], list[EngineSample]]) -> None:
        """Per-engine series, only for a multi-engine server (the single engine has no `gpu` label)."""
        self.registry.register(EngineCollector(engines))

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def watch_event_loop(lag: Histogram, period_s: float = LAG_PERIOD_S) -> None:
    """Until cancelled: sleep `period_s`, observe how much later than due the loop woke this task."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period_s
        await asyncio.sleep(period_s)
        lag.observe(max(0.0, loop.time() - due))
