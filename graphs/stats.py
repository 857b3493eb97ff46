"""Counters the pool keeps for the service's metrics and `vitserve encode --stats`."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class PoolStats:
    graph_items: int = 0  # items served by a replay
    eager_items: Counter = field(default_factory=Counter)  # by reason
    replays: Counter = field(default_factory=Counter)  # by graph key
    eager_batches: int = 0
    chunked_videos: int = 0  # long videos served as t_capture chunks through graphs
    video_chunks: int = 0
    captured: int = 0  # CUDA graphs captured: 0 on the CPU, which has none
    graph_mode: str = "off"  # "cuda_graphs", "cpu_fixed_shape" (CPU: one fixed-shape eager run per key) or "off"
    graph_keys: int = 0  # keys served at a fixed shape: by a CUDA graph, or on the CPU by an eager run
    no_graphs_reason: str | None = None  # why `captured` is 0, in words
    capture_failures: dict = field(default_factory=dict)  # key -> error
    capture_seconds: float = 0.0
    pool_bytes: int = 0
    self_check: dict = field(default_factory=dict)  # path ("eager/image", "graphs/video") -> "ok" or the reason
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_replay(self, key: str, items: int) -> None:
        with self._lock:
            self.replays[key] += 1
            self.graph_items += items

    def record_eager(self, reason: str, items: int) -> None:
        with self._lock:
            self.eager_items[reason] += items
            self.eager_batches += 1

    def record_chunked(self, chunks: int) -> None:
        with self._lock:
            self.chunked_videos += 1
            self.video_chunks += chunks

    def reset_to(self, snapshot: dict) -> None:
        """Restore the traffic counters of an `as_dict()` snapshot (after internal calibration runs)."""
        with self._lock:
            self.graph_items = snapshot["graph_items"]
            self.eager_items = Counter(snapshot["eager_items"])
            self.eager_batches = snapshot["eager_batches"]
            self.replays = Counter(snapshot["replays"])
            self.chunked_videos, self.video_chunks = snapshot["chunked_videos"], snapshot["video_chunks"]

    @property
    def hit_rate(self) -> float:
        total = self.graph_items + sum(self.eager_items.values())
        return self.graph_items / total if total else 0.0

    def as_dict(self) -> dict:
        with self._lock:
            return {
                "graph_items": self.graph_items,
                "eager_items": dict(self.eager_items),
                "eager_batches": self.eager_batches,
                "chunked_videos": self.chunked_videos,
                "video_chunks": self.video_chunks,
                "hit_rate": round(self.hit_rate, 4),
                "replays": dict(self.replays),
                "captured_graphs": self.captured,
                "graph_mode": self.graph_mode,
                "graph_keys": self.graph_keys,
                "no_graphs_reason": self.no_graphs_reason,
                "capture_failures": dict(self.capture_failures),
                "capture_seconds": round(self.capture_seconds, 3),
                "pool_bytes": self.pool_bytes,
                "self_check": dict(self.self_check),
            }
