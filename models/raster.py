"""Positions read in raster order (row, then column) of each frame, whatever order the patch rows travel in:
the learned-table resampling and the axial rotary of the towers whose reference works on raster-order
patches (Kimi-K2.x, Muse), as host metadata.

vitserve keeps every family's pixel rows in the merge-block order (models/metadata.py), so a frame's row k
is the patch at `block_order_positions(h, w, merge)[k]`; what the reference computes for the patch at
raster index i = row * w + col is looked up for that patch here.

* Learned tables (`raster_taps`): resampled to each frame by separable interpolation at the patch centres
  (align_corners=False), bicubic with clamped borders (Kimi: `F.interpolate(mode="bicubic")`) or bilinear
  with zero padding (Muse: `F.grid_sample(padding_mode="zeros")`). `transposed` reproduces a reference that
  reads the table as a (w, h) grid (Muse passes its grid as (t, w, h)): raster index i is then read at
  (i // h, i % h) of a w x h resampling.
* Rotary (`raster_rotary_positions`, `InterleavedRotary2D`): axial angles of (column, row) with an
  offset, laid out as the reference rotates them: column frequencies then row frequencies
  (models.layers.Rotary2D), or the two interleaved pair by pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from models.layers import Rotary2D
from models.metadata import GRID_CACHE_SIZE, block_order_positions, frozen
from models.positions import cubic_weights
from models.protocol import Grid


def _axis_taps(index: np.ndarray, size: int, side: int, mode: str, zero_pad: bool) -> tuple[np.ndarray, np.ndarray]:
    """Taps into a `side`-long table axis and their float32 weights for positions `index` of an axis of
    `size`, at pixel centres (align_corners=False), in the reference's float32 arithmetic."""
    src = (index.astype(np.float32) + np.float32(0.5)) * np.float32(side) / np.float32(size) - np.float32(0.5)
    floor = np.floor(src)
    offsets = np.arange(-1, 3) if mode == "bicubic" else np.arange(2)
    raw = floor.astype(np.int64)[:, None] + offsets
    if mode == "bicubic":
        weights = cubic_weights((src - floor).astype(np.float32))
    else:
        weights = np.clip(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets.astype(np.float32)), 0, None)
    if zero_pad:  # taps beyond the table read nothing (grid_sample's zero padding)
        weights = weights * ((raw >= 0) & (raw < side))
    return np.clip(raw, 0, side - 1), weights.astype(np.float32)


@lru_cache(maxsize=GRID_CACHE_SIZE // 4)
def raster_taps(h: int, w: int, merge: int, side: int, mode: str = "bicubic", zero_pad: bool = False,
                transposed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Table indices and weights [h*w, taps] of one frame's patches in merge-block order (read-only):
    4 taps for "bilinear", 16 for "bicubic", into a `side` x `side` table flattened row-major."""
    pos = block_order_positions(h, w, merge)
    if transposed:
        raster = pos[:, 0] * w + pos[:, 1]
        rows, cols, rows_size, cols_size = raster // h, raster % h, w, h
    else:
        rows, cols, rows_size, cols_size = pos[:, 0], pos[:, 1], h, w
    row_taps, row_w = _axis_taps(rows, rows_size, side, mode, zero_pad)
    col_taps, col_w = _axis_taps(cols, cols_size, side, mode, zero_pad)
    n = row_taps.shape[1]
    idx = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, n * n)
    wts = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, n * n)
    return frozen(idx), frozen(wts.astype(np.float32))


def raster_rotary_positions(grids: Sequence[Grid], merge: int, patches: int, offset: int = 0) -> np.ndarray:
    """[patches, 2] int32 (column, row) + offset of each patch row; frames of a video repeat them, padding rows
    hold zeros."""
    out = np.zeros((patches, 2), dtype=np.int32)
    start = 0
    for t, h, w in grids:
        frame = block_order_positions(h, w, merge)[:, ::-1] + offset
        out[start : start + t * h * w].reshape(t, h * w, 2)[:] = frame
        start += t * h * w
    return out


class InterleavedRotary2D(Rotary2D):
    """Axial rotary whose angles alternate between the two axes pair by pair (a0, b0, a1, b1, ...), each
    frequency used for both, and the whole vector repeated for rotate_half (Kimi-K2.x)."""

    def angle_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Frequency-major: (a, b) at the first frequency, then at the second, ..."""
        band, axes = self.inv_freq.shape[0], self.axes
        return torch.arange(axes * band, device=self.inv_freq.device) % axes, self.inv_freq.repeat_interleave(axes)
