"""What the engine reports about itself: the `/info` document, the per-engine rows of the metrics, and
the engines' pool statistics summed over them. Read-only views over the engine's state, kept apart from
the request path.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Protocol

from service.engine.backends import Backend
from service.engine.batcher import Batcher
from service.engine.types import ModelInfo
from service.metrics import EngineSample
from service.settings import ServeSettings
from service.workers.pool import WorkerPool


class Reported(Protocol):
    """What the report reads of the engine (`Engine` is one): a view, so this module needs not import it."""

    settings: ServeSettings
    backends: list[Backend]
    batcher: Batcher
    workers: WorkerPool
    state: str
    model: ModelInfo | None
    load_error: str | None
    engine_restarts: int


def engine_info(engine: Reported) -> dict[str, Any]:
    """`Engine.info()`: state, limits and workers, and once loaded the model, graphs, pool and memory."""
    s = engine.settings
    memory = device_memory(engine.backends)
    out: dict[str, Any] = {
        "state": engine.state,
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
        "workers": engine.workers.stats(),
        "engine_restarts": engine.engine_restarts,
        "ec_shared_storage": str(s.ec_shared_storage) if s.ec_shared_storage else None,
    }
    if engine.load_error:
        out["error"] = engine.load_error
    m = engine.model
    if m is None:
        return out
    proc = m.processor
    out.update({
        "family": m.family,
        "dtype": m.dtype_name,
        "quantization": m.quantization or {"mode": "none"},
        "device": ",".join(b.device for b in engine.backends),
        "out_hidden_size": m.out_hidden_size,
        "num_deepstack": m.num_deepstack,
        "merge_unit": m.merge_unit,
        # how an item's grid becomes output rows (num_tokens): the model's own rule
        "geometry": {"tokens": m.geometry.describe(), "rule": type(m.geometry).__name__,
                     **dataclasses.asdict(m.geometry)},
        "budgets": list(m.plan.budgets),
        # this front's replays: how much of their budgets was padding, and the budgets that would save it
        "padding": engine.batcher.padding.report(m.plan.budgets),
        # budgets added while serving (--learn-budgets): in `budgets` once every live engine has them
        "learned_budgets": engine.batcher.learning_report(),
        "max_batch_items": m.plan.max_items,
        "t_capture": m.plan.t_capture,
        "captured": list(m.captured),
        "graphs": graph_modes(engine.backends),
        "capture_failures": MergedStats(engine.backends).as_dict()["capture_failures"],
        "self_check": MergedStats(engine.backends).as_dict()["self_check"],
        "processor": {
            "patch_size": proc.patch_size,
            "merge_size": proc.merge_size,
            "video_merge_size": proc.video_merge_size,
            "temporal_patch_size": proc.temporal_patch_size,
            "min_pixels": proc.min_pixels,
            "max_pixels": proc.max_pixels,
            "video": {"fps": proc.video.fps, "min_frames": proc.video.min_frames,
                      "max_frames": proc.video.max_frames, "min_pixels": proc.video.min_pixels,
                      "max_pixels": proc.video.max_pixels, "total_pixels": proc.video.total_pixels},
        },
        "pool": MergedStats(engine.backends).as_dict(),
        "memory": memory[0] if len(engine.backends) == 1 else memory,
    })
    if len(engine.backends) > 1:
        out.update(data_parallel=len(engine.backends), engines=engine.batcher.engine_rows())
    return out


def engine_samples(batcher: Batcher) -> list[EngineSample]:
    return [EngineSample(str(r["gpu"]), r["state"] == "ready", r["outstanding_tokens"], r["batches"],
                         r["items"], r["graph_hits"], r["graph_misses"]) for r in batcher.engine_rows()]


def device_memory(backends: list[Backend]) -> list[dict[str, Any] | None]:
    """Each engine's device memory, as it last reported (None on the CPU)."""
    return [(b.stats or {}).get("memory") for b in backends]


def graph_modes(backends: list[Backend]) -> dict[str, Any]:
    """How the keys run: CUDA graphs (how many per engine), or fixed-shape eager forwards and why."""
    stats = backends[0].stats or {}
    return {"mode": stats.get("graph_mode", "off"), "captured": stats.get("captured_graphs", 0),
            "keys": stats.get("graph_keys", 0), "reason": stats.get("no_graphs_reason")}


class MergedStats:
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
        checks: dict[str, str] = {}
        for b in self.backends:
            eager.update(b.stats.get("eager_items", {}))
            replays.update(b.stats.get("replays", {}))
            prefix = f"{b.index}:" if len(self.backends) > 1 else ""
            failures.update({f"{prefix}{k}": v for k, v in b.stats.get("capture_failures", {}).items()})
            checks.update({f"{prefix}{k}": v for k, v in b.stats.get("self_check", {}).items()})
        served = total["graph_items"] + sum(eager.values())
        return {**total, "eager_items": dict(eager), "replays": dict(replays), "capture_failures": failures,
                "self_check": checks,
                "hit_rate": round(total["graph_items"] / served, 4) if served else 0.0,
                "capture_seconds": max((s.get("capture_seconds", 0.0) for s in snaps), default=0.0)}
