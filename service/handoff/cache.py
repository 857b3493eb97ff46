"""The encoder-output cache: recent items' outputs, keyed by content id, bounded in bytes.

A sidecar sees the same media again and again: in a chat every turn resends the images of the turns
before it. A hit skips decoding, preprocessing and the GPU and returns the very rows the first request
produced. An entry is the engine's own output segment in shared memory (the served dtype, the main
embedding and DeepStack levels side by side), kept instead of unlinked, so a hit costs no copy: the
worker processes encode the response straight from it. Entries are evicted least recently used first
once their bytes pass the bound; an entry in use by a response being encoded is unlinked only once that
response is done. Everything here runs on the event loop.

An entry answered by reference (`vllm_ref` without a shared folder: the LLM server fetches the tensor from
`GET /v1/encoder_cache/{id}` later) is held: eviction passes it over for `hold_s` seconds after its last
answer, so that the fetch that follows finds it. Held entries may take the cache past its bound, up to
`HELD_FACTOR` times it; past that even held entries go, oldest first, and the fetch that misses is counted.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from service import shm
from service.engine.types import OutputRef

# Per-entry bookkeeping beyond the rows (the dict slot, the entry object, its small metadata).
ENTRY_OVERHEAD = 512
# Held entries (answered by reference, not fetched yet) may take the cache up to this many times its bound.
HELD_FACTOR = 2


@dataclass(frozen=True)
class CachedOutput:
    modality: str
    grid_thw: tuple[int, int, int]
    num_patches: int
    num_tokens: int
    meta: dict[str, Any]
    output: OutputRef
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", self.output.nbytes + ENTRY_OVERHEAD)


class EncoderCache:
    def __init__(self, max_bytes: int, hold_s: float = 0.0) -> None:
        self.max_bytes = max_bytes
        self.hold_s = hold_s
        self._entries: OrderedDict[str, CachedOutput] = OrderedDict()
        self._held: dict[str, float] = {}  # key -> monotonic time its hold ends
        self._pins: Counter[str] = Counter()  # segment -> responses reading it now
        self._doomed: set[str] = set()  # evicted while pinned: unlinked when the last reader is done
        self.bytes = 0
        self.evictions = 0
        self.held_evictions = 0  # held entries evicted all the same (the cache at HELD_FACTOR x its bound)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CachedOutput | None:
        """The entry, now the most recently used and pinned (see `unpin`), or None."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self._pins[entry.output.segment] += 1
        return entry

    def peek(self, key: str) -> CachedOutput | None:
        """The entry, unpinned and without refreshing it (a lookup that reads nothing)."""
        return self._entries.get(key)

    def put(self, key: str, entry: CachedOutput) -> bool:
        """Keep `entry` (its segment now belongs to the cache, pinned once for the response that made it);
        False when it cannot be kept (larger than the bound, or the key is taken): the caller keeps it."""
        if entry.nbytes > self.max_bytes or key in self._entries:
            return False
        self._entries[key] = entry
        self.bytes += entry.nbytes
        self._pins[entry.output.segment] += 1
        self._evict(keep=key)
        return True

    def hold(self, key: str) -> None:
        """`key` was answered by reference: spare it from eviction for `hold_s` seconds from now."""
        if key in self._entries and self.hold_s > 0:
            self._held[key] = time.monotonic() + self.hold_s

    def _evict(self, keep: str) -> None:
        """Least recently used first down to the bound, passing over held entries (and `keep`, the entry
        just put) unless the cache is past HELD_FACTOR times its bound."""
        if self.bytes <= self.max_bytes:
            return
        now = time.monotonic()
        for key in [k for k, until in self._held.items() if until <= now]:
            del self._held[key]
        for key in list(self._entries):
            if self.bytes <= self.max_bytes:
                return
            if key == keep or key in self._held:
                continue
            self._remove(key)
        for key in list(self._entries):  # only held entries are left over the bound
            if self.bytes <= self.max_bytes * HELD_FACTOR:
                return
            if key != keep:
                self.held_evictions += 1
                self._remove(key)

    def _remove(self, key: str) -> None:
        gone = self._entries.pop(key)
        self._held.pop(key, None)
        self.bytes -= gone.nbytes
        self.evictions += 1
        self._drop(gone.output.segment)

    def pin(self, segment: str) -> None:
        """One more response reads `segment` (an item repeated within a request)."""
        self._pins[segment] += 1

    def owns(self, segment: str) -> bool:
        return segment in self._pins or segment in self._doomed

    def unpin(self, segment: str) -> None:
        """A response that read `segment` is done."""
        self._pins[segment] -= 1
        if self._pins[segment] <= 0:
            del self._pins[segment]
            if segment in self._doomed:
                self._doomed.discard(segment)
                shm.unlink(segment)

    def _drop(self, segment: str) -> None:
        if self._pins.get(segment, 0) > 0:
            self._doomed.add(segment)
        else:
            shm.unlink(segment)

    def clear(self) -> None:
        for entry in list(self._entries.values()):
            self._drop(entry.output.segment)
        self._entries.clear()
        self._held.clear()
        self.bytes = 0

    def close(self) -> None:
        """The server stops: every segment of the cache goes, pinned ones too (nothing reads them any more).
        /dev/shm outlives the process, and a server restarted under the same pid (a container's) would
        not sweep them as a dead server's."""
        self.clear()
        for segment in self._doomed:
            shm.unlink(segment)
        self._doomed.clear()
        self._pins.clear()

    def stats(self) -> dict[str, int]:
        return {"max_bytes": self.max_bytes, "bytes": self.bytes, "items": len(self._entries),
                "evictions": self.evictions, "held": len(self._held), "held_evictions": self.held_evictions}
