"""CPU-side batch metadata shared by the Qwen-VL families, built with numpy from `grid_thw` alone.

Every array is laid out at a fixed `Capacity`; the unused tail is padding that the device forward
can read without effect: boundary arrays repeat their last value (zero-length segments), index
arrays point padding rows at themselves, weights are zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from models.protocol import Capacity, Geometry, Grid


def segment_lengths(grids: Sequence[Grid], geometry: Geometry = Geometry()) -> np.ndarray:
    """The attention segments of a batch, item after item (one per temporal patch in the Qwen-VL towers)."""
    return np.asarray([n for grid in grids for n in geometry.segment_lengths(grid)], dtype=np.int64)


def padded_cumsum(lengths: np.ndarray, slots: int) -> np.ndarray:
    """[slots + 1] int32 boundaries; slots beyond len(lengths) are zero-length."""
    if len(lengths) > slots:
        raise ValueError(f"{len(lengths)} segments exceed the capacity of {slots}")
    out = np.zeros(slots + 1, dtype=np.int32)
    out[1 : len(lengths) + 1] = np.cumsum(lengths)
    out[len(lengths) + 1 :] = out[len(lengths)]
    return out


# Per-frame metadata depends on the frame's shape alone, and traffic repeats shapes (a batch of
# same-sized images, every frame of a video): the builders below cache by frame shape (never by
# frame count, so a long video costs no more cache than one frame) and return read-only arrays, so
# a batch costs one lookup per item rather than one rebuild. The bound keeps the worst case (every
# request a new shape of the largest size) near 100 MB.
GRID_CACHE_SIZE = 128


def frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@lru_cache(maxsize=GRID_CACHE_SIZE)
def block_order_positions(h: int, w: int, merge: int) -> np.ndarray:
    """(row, col) of each patch of one frame, in the processor's merge-block order: [h*w, 2] (read-only)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return frozen(np.stack([rows, cols], axis=1))


def rotary_positions(grids: Sequence[Grid], merge: int, patches: int) -> np.ndarray:
    """[patches, 2] int32 (row, col) rotary positions; frames of a video repeat them."""
    out = np.zeros((patches, 2), dtype=np.int32)
    offset = 0
    for t, h, w in grids:
        out[offset : offset + t * h * w].reshape(t, h * w, 2)[:] = block_order_positions(h, w, merge)
        offset += t * h * w
    return out


# Rows of an eager forward are padded to a multiple of this many budget units (merge blocks of patches):
# matrix products of a few rows take other kernels than a graph's (split-K on the GPU; on the CPU, row
# counts 1-11 that are not a multiple of 4 came out differently), and an item's bytes must not depend
# on its batch. 32 units: the fewest rows a graph's budget has in practice (budgets start at 64).
EAGER_ROW_QUANTUM = 32


def base_capacity(grids: Sequence[Grid], geometry: Geometry = Geometry(), modality: str = "image") -> Capacity:
    """The exact capacity of a batch: its patches, segments and longest segment."""
    lengths = segment_lengths(grids, geometry)
    return Capacity(
        patches=int(sum(t * h * w for t, h, w in grids)),
        segments=len(lengths),
        max_seqlen=int(lengths.max()) if len(lengths) else 0,
        modality=modality,
    )
