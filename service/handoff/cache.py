"""The encoder-output cache: recent items' outputs in host memory, keyed by content id, bounded in bytes.

A sidecar sees the same media again and again: in a chat every turn resends the images of the turns
before it. A hit skips decoding, preprocessing and the GPU and returns the very tensors the first request
produced. Entries are evicted least recently used first once their bytes pass the bound; an entry larger
than the whole bound is not kept. One lock guards the map: lookups come from the event loop and inserts
from the worker pool.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

# Per-entry bookkeeping beyond the tensor (the dict slot, the entry object, its small metadata).
ENTRY_OVERHEAD = 512


@dataclass(frozen=True)
class CachedOutput:
    """One item's encoder output in the served dtype: `joined` is [tokens, out_hidden * (1 + DeepStack
    layers)], the main embedding then each DeepStack layer along hidden (the layout vLLM's encoder cache
    holds)."""

    modality: str
    grid_thw: tuple[int, int, int]
    num_patches: int
    num_tokens: int
    meta: dict[str, Any]
    joined: torch.Tensor
    out_hidden_size: int
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", self.joined.numel() * self.joined.element_size() + ENTRY_OVERHEAD)

    @property
    def embeds(self) -> torch.Tensor:
        return self.joined[:, : self.out_hidden_size]

    @property
    def deepstack(self) -> list[torch.Tensor]:
        h = self.out_hidden_size
        return [self.joined[:, i : i + h] for i in range(h, self.joined.shape[1], h)]


def owned(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host in memory of its own: a view into a whole batch's output would keep that batch
    alive and make the byte count a lie."""
    t = t.detach().cpu().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


class EncoderCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, CachedOutput] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CachedOutput | None:
        """The entry, now the most recently used, or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: str, entry: CachedOutput) -> int:
        """Insert (or refresh) `entry`; returns how many entries were evicted to make room."""
        if entry.nbytes > self.max_bytes:
            return 0
        evicted = 0
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[key] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self.bytes -= gone.nbytes
                evicted += 1
            self.evictions += evicted
        return evicted

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"max_bytes": self.max_bytes, "bytes": self.bytes, "items": len(self._entries),
                    "evictions": self.evictions}
