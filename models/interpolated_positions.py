"""Learned position tables resampled the way `F.interpolate(mode="bilinear", align_corners=False)` does:
half-pixel centres, the source index clamped at 0 and the upper tap at the border (HunyuanOCR, Hy4 and the
towers built like them; models/positions.py has the align_corners=True and bicubic variants).

A square table of `side` x `side` rows (after `first` leading rows the grid does not use, such as a class
token's) is resampled to each frame's h x w patches, either to that size (`offset=None`: the source step
is side / h, as `interpolate(size=(h, w))` computes it) or by the scale factor (h + offset) / side
(`interpolate(scale_factor=...)`, whose source step is the reciprocal of that factor: Hy4 shifts its
sampling grid with offset 0.1). The result is metadata like models/positions.py's: four table indices and
weights per patch, in float32, laid out in the tower's row order, so the device does one weighted gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from models.metadata import GRID_CACHE_SIZE, block_order_positions, frozen
from models.positions import tap_metadata
from models.protocol import Capacity, Grid


def half_pixel_axis_taps(index: np.ndarray, size: int, side: int, offset: float | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Two table indices and weights per output position along one axis of `size` positions, from `side`
    table cells, as PyTorch's bilinear upsampling computes them in float32 (`area_pixel_compute_source_index`:
    src = step * (i + 0.5) - 0.5, negative values clamped to 0; the second tap stays at the border). An axis
    as long as the table's is copied as it is, whatever the scale factor (PyTorch's kernel does so)."""
    if size == side:
        copy = index.astype(np.int64)
        ones = np.ones(len(index), np.float32)
        return np.stack([copy, copy], axis=1), np.stack([ones, 0 * ones], axis=1)
    if offset is None:
        step = np.float32(side) / np.float32(size)
    else:
        step = np.float32(1.0 / ((size + offset) / side))  # the scale factor's reciprocal, in double, then float
    src = np.maximum(step * (index.astype(np.float32) + np.float32(0.5)) - np.float32(0.5), np.float32(0))
    low = np.minimum(np.floor(src).astype(np.int64), side - 1)
    frac = np.clip(src - low.astype(np.float32), np.float32(0), np.float32(1))
    high = np.minimum(low + 1, side - 1)
    return np.stack([low, high], axis=1), np.stack([np.float32(1) - frac, frac], axis=1).astype(np.float32)


@lru_cache(maxsize=GRID_CACHE_SIZE)
def half_pixel_frame_taps(h: int, w: int, merge: int, side: int, first: int = 0, offset: float | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Table indices and weights [h*w, 4] of one frame's patches in merge-block order (`merge` 1: raster
    order), read-only."""
    pos = block_order_positions(h, w, merge)
    row_taps, row_w = half_pixel_axis_taps(pos[:, 0], h, side, offset)
    col_taps, col_w = half_pixel_axis_taps(pos[:, 1], w, side, offset)
    idx = first + (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    wts = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
    return frozen(idx), frozen(wts)


def half_pixel_metadata(grids: Sequence[Grid], cap: Capacity, merge: int, side: int, first: int = 0,
                        offset: float | None = None) -> dict[str, np.ndarray]:
    """interp_idx / interp_w [patches, 4] for `models.positions.resample_float32` (frames of a video repeat
    their frame's positions; padding rows read row 0 with weight 0)."""
    return tap_metadata(grids, cap, 4, lambda h, w: half_pixel_frame_taps(h, w, merge, side, first, offset))
