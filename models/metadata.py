"""CPU-side batch metadata shared by the Qwen-VL families, built with numpy from `grid_thw` alone.

Every array is laid out at a fixed `Capacity`; the unused tail is padding that the device forward
can read without effect: boundary arrays repeat their last value (zero-length segments), index
arrays point padding rows at themselves, weights are zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from models.protocol import Capacity, Grid


def segment_lengths(grids: Sequence[Grid]) -> np.ndarray:
    """One attention segment per temporal patch: attention never crosses frames in these towers."""
    return np.asarray([h * w for t, h, w in grids for _ in range(t)], dtype=np.int64)


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


def base_capacity(grids: Sequence[Grid]) -> Capacity:
    lengths = segment_lengths(grids)
    return Capacity(
        patches=int(sum(t * h * w for t, h, w in grids)),
        segments=len(lengths),
        max_seqlen=int(lengths.max()) if len(lengths) else 0,
    )
