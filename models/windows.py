"""Window attention (Qwen2.5-VL and the towers built like it): the CPU half.

Patches are reordered once after the patch embedding so that each window of `window` x `window`
merged tokens is contiguous; all layers but the full-attention ones attend within windows, the rest
within whole frames (frames stay contiguous under the reorder). The merged tokens are put back in
the original order at the end. Both permutations and the window boundaries are metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from models.metadata import GRID_CACHE_SIZE, frozen, padded_cumsum
from models.protocol import Capacity, Grid


@lru_cache(maxsize=GRID_CACHE_SIZE)
def window_layout(h: int, w: int, merge: int, ws: int) -> tuple[np.ndarray, np.ndarray]:
    """One frame's merge-group order putting each window of ws x ws groups together (from 0), and the
    window lengths in patches (read-only). Windows never cross frames."""
    gh, gw = h // merge, w // merge
    nh, nw = -(-gh // ws), -(-gw // ws)
    grid = np.full((nh * ws, nw * ws), -1, dtype=np.int64)
    grid[:gh, :gw] = np.arange(gh * gw).reshape(gh, gw)
    tiles = grid.reshape(nh, ws, nw, ws).transpose(0, 2, 1, 3).reshape(nh * nw, ws * ws)
    counts = (tiles >= 0).sum(1)
    flat = tiles.reshape(-1)
    return frozen(flat[flat >= 0]), frozen(counts[counts > 0] * merge * merge)


@dataclass(frozen=True)
class Windows:
    """The window layout of one tower: `window` merged tokens a side, `merge` patches a token side."""

    window: int
    merge: int

    @property
    def unit(self) -> int:
        return self.merge * self.merge

    @property
    def patches(self) -> int:
        """Patches in one full window: the bound every window call is captured with."""
        return self.window * self.window * self.unit

    def layout(self, grids: Sequence[Grid]) -> tuple[np.ndarray, np.ndarray]:
        """Merge-group permutation putting each window together, and the window lengths in patches."""
        order, lengths, offset = [], [], 0
        for t, h, w in grids:
            frame_order, frame_lengths = window_layout(h, w, self.merge, self.window)
            groups = len(frame_order)  # merge groups per frame; frames follow one another
            order.append((frame_order + offset + groups * np.arange(t)[:, None]).reshape(-1))
            lengths.append(np.tile(frame_lengths, t))
            offset += t * groups
        if not order:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(order), np.concatenate(lengths)

    def required(self, base: Capacity, grids: Sequence[Grid]) -> Capacity:
        _, lengths = self.layout(grids)
        return replace(base, windows=len(lengths), max_window_seqlen=int(lengths.max()) if len(lengths) else 0)

    def class_capacity(self, base: Capacity) -> Capacity:
        """Windows a graph class holds. A frame of n patches has at most n/16 + 1 windows
        (ceil(a/4)*ceil(b/4) <= ab/4 + 1 in merged tokens, for 4-token windows), but squarish frames
        have about n/64. Every empty slot still costs the kernel a block per head, so the class holds
        twice the square case plus 4 per frame, never more than the hard bound; a batch of extreme
        aspect ratios beyond it runs eagerly."""
        patches, segments = base.patches, base.segments
        windows = min(patches // 16 + segments, patches // 32 + 4 * segments)
        return replace(base, windows=windows, max_window_seqlen=self.patches)

    def metadata(self, grids: Sequence[Grid], cap: Capacity, pos_ids: np.ndarray) -> dict[str, np.ndarray]:
        """window_index / reverse_index (merge groups; padding groups stay put), cu_window_seqlens, and the
        rotary positions in window order."""
        order, lengths = self.layout(grids)
        groups = cap.patches // self.unit
        window_index = np.arange(groups, dtype=np.int64)
        window_index[: len(order)] = order
        reverse_index = np.empty_like(window_index)
        reverse_index[window_index] = np.arange(groups)
        pos = pos_ids.reshape(groups, self.unit, 2)[window_index].reshape(-1, 2)
        return {
            "pos_ids": np.ascontiguousarray(pos),
            "window_index": window_index,
            "reverse_index": reverse_index,
            "cu_window_seqlens": padded_cumsum(lengths, cap.windows),
        }
