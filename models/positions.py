"""Learned absolute positions resampled to each grid (Qwen3-VL and the towers built like it).

A square table of `side` x `side` embeddings is resampled bilinearly (align_corners=True) to each
frame's patch grid. The resampling is metadata: four table indices and four weights per patch,
built on the CPU in merge-block order, so the device does one gather and a weighted sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from models.metadata import GRID_CACHE_SIZE, block_order_positions, frozen
from models.protocol import Capacity, Grid


@lru_cache(maxsize=GRID_CACHE_SIZE)
def frame_taps(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Table indices and weights [h*w, 4] of one frame's patches, in merge-block order (read-only)."""
    pos = block_order_positions(h, w, merge)
    row_taps, row_w = _axis_taps(pos[:, 0], h, side)
    col_taps, col_w = _axis_taps(pos[:, 1], w, side)
    idx = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    wts = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
    return frozen(idx), frozen(wts)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Two taps and weights per position for align_corners bilinear resampling (float32 as the reference)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    taps = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
    return np.clip(taps, 0, side - 1), weights.astype(np.float32)


def bilinear_metadata(grids: Sequence[Grid], cap: Capacity, merge: int, side: int) -> dict[str, np.ndarray]:
    """interp_idx / interp_w [patches, 4]; padding rows read entry 0 with weight 0."""
    idx = np.zeros((cap.patches, 4), dtype=np.int64)
    wts = np.zeros((cap.patches, 4), dtype=np.float32)
    offset = 0
    for t, h, w in grids:
        frame_idx, frame_w = frame_taps(h, w, merge, side)
        idx[offset : offset + t * h * w].reshape(t, h * w, 4)[:] = frame_idx
        wts[offset : offset + t * h * w].reshape(t, h * w, 4)[:] = frame_w
        offset += t * h * w
    return {"interp_idx": idx, "interp_w": wts}


def resample(table: torch.Tensor, meta: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each patch's position embedding: the weighted sum of its four table rows."""
    return (table[meta["interp_idx"]] * meta["interp_w"][..., None]).sum(1)
