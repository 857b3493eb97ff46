"""Rotary kinds beyond Qwen-VL's 2D (row, column) one, and the positions they read.

`AxialRotary` gives each of `axes` coordinates an equal band of frequencies: two axes (row, column) is
the Qwen-VL rotary (models.layers.Rotary2D); three (time, row, column) is MiniMax-M3's. A band is
2 * ((head_dim // axes) // 2) dims wide, so three axes may leave a tail of each head unrotated (a partial
rotary: models.kernels.apply_rotary passes the dims beyond the cos/sin width through).

`clip_positions` are the (time, row, column) positions of patches whose attention spans a clip of
temporal patches: time counts the temporal patches within each attention segment, so a video cut into
segments of a few temporal patches restarts it at every segment.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from models.layers import Rotary2D
from models.metadata import block_order_positions
from models.protocol import Grid


class AxialRotary(Rotary2D):
    """Rotary positions over `axes` coordinates ([P, axes] integer positions), an equal frequency band each:
    cos and signed sin [P, 1, 1, rotated] with rotated = 2 * axes * (band // 2) <= head_dim."""

    def __init__(self, head_dim: int, theta: float, axes: int) -> None:
        self.axes = axes
        super().__init__(head_dim, theta)

    @property
    def band(self) -> int:
        """Rotated dims per axis (even)."""
        return 2 * ((self.head_dim // self.axes) // 2)

    @property
    def rotated_dims(self) -> int:
        return self.band * self.axes

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        band = self.band
        return 1.0 / (self.theta ** (torch.arange(0, band, 2, dtype=torch.float, device=device) / band))


def clip_positions(grids: Sequence[Grid], merge: int, patches: int, segment_frames: Sequence[Sequence[int]]
                   ) -> np.ndarray:
    """[patches, 3] int32 (time, row, column) of each patch, items back to back in the processor's order
    (temporal patches, then merge blocks); `segment_frames[i]`: item i's attention segments in temporal
    patches, time counting from 0 in each. Padding rows hold zeros."""
    out = np.zeros((patches, 3), dtype=np.int32)
    offset = 0
    for (t, h, w), frames in zip(grids, segment_frames):
        spatial = block_order_positions(h, w, merge)
        rows = out[offset : offset + t * h * w].reshape(t, h * w, 3)
        rows[:, :, 1:] = spatial
        rows[:, :, 0] = np.concatenate([np.arange(n) for n in frames])[:, None]
        offset += t * h * w
    return out
