"""Output rows beyond the merged tokens: learned tokens a family places between and around an item's merged
tokens (a newline token after each row of merge blocks, begin and end tokens around an image), laid out by
index.

The merged tokens of a batch come out of the merger back to back, frame by frame, each frame's merge blocks in
raster order. The family appends its learned tokens after them (row `merged + k` is extra token k), and one
gather by a CPU-built index puts every output row in place: an item's rows first, in item order, then padding
(index 0). Nothing loops over items on the device, and an item's rows are the same whatever its batch.

`NewlineGeometry` is the item rule of such a family (models/protocol.py): per frame, (h/m) rows of (w/m)
merged tokens each followed by a newline token, plus `extra` tokens per item (begin and end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from models.metadata import GRID_CACHE_SIZE, frozen
from models.protocol import Capacity, Geometry, Grid

# Extra tokens, as indices into the rows appended after the merged tokens.
NEWLINE, BEGIN, END = 0, 1, 2


def extra(k: int) -> int:
    """A layout entry naming extra token k (entries >= 0 are an item's own merged tokens)."""
    return -1 - k


@lru_cache(maxsize=GRID_CACHE_SIZE)
def newline_frame_layout(rows: int, cols: int) -> np.ndarray:
    """One frame of rows x cols merged tokens, each row followed by the newline token (read-only)."""
    out = np.full((rows, cols + 1), extra(NEWLINE), dtype=np.int64)
    out[:, :cols] = np.arange(rows * cols).reshape(rows, cols)
    return frozen(out.reshape(-1))


def gather_index(layouts: Sequence[np.ndarray], merged: Sequence[int], total_merged: int, rows: int) -> np.ndarray:
    """[rows] int64: where each output row comes from, for items whose layouts (entries >= 0: the item's own
    merged tokens; < 0: `extra(k)`) and merged-token counts are given in batch order. The table gathered from
    is the batch's `total_merged` merged tokens then the extra tokens; rows past the items read row 0."""
    out = np.zeros(rows, dtype=np.int64)
    start = offset = 0
    for layout, count in zip(layouts, merged):
        out[start:start + len(layout)] = np.where(layout >= 0, layout + offset, total_merged - 1 - layout)
        start += len(layout)
        offset += count
    return out


def lay_out(merged: torch.Tensor, extras: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The output rows: merged tokens [n, d] and extra tokens [k, d] gathered by `index` (`gather_index`)."""
    return torch.cat([merged, extras.to(merged.dtype)])[index]


@dataclass(frozen=True)
class NewlineGeometry(Geometry):
    """Items whose output is, per frame, (h/m) rows of (w/m) merged tokens each closed by a newline token,
    with `extra` more tokens per item (HunyuanOCR's begin and end: 2; Hy4: 0). Attention within each frame."""

    extra: int = 0

    def tokens(self, grid: Grid, modality: str = "image") -> int:
        t, h, w = grid
        return t * (h // self.merge) * (w // self.merge + 1) + self.extra

    def output_rows(self, cap: Capacity) -> int:
        """A frame's rows are at most twice its merged tokens (a row holds at least one); every item has at
        least one segment, so `extra` per segment bounds the items' extra tokens."""
        return 2 * (cap.patches // self.merge_unit) + self.extra * cap.segments

    @property
    def splits_over_time(self) -> bool:
        """Frames are laid out independently, but an item's begin and end tokens are once per item."""
        return not self.whole_clip and self.extra == 0

    def describe(self) -> str:
        m = self.merge
        return f"t*(h/{m})*(w/{m}+1)" + (f"+{self.extra}" if self.extra else "")

    def layout(self, grid: Grid) -> np.ndarray:
        """One item's output rows as layout entries (see `gather_index`)."""
        t, h, w = grid
        rows, cols = h // self.merge, w // self.merge
        frame = newline_frame_layout(rows, cols)
        body = np.concatenate([frame + np.where(frame >= 0, f * rows * cols, 0) for f in range(t)])
        if self.extra == 0:
            return body
        if self.extra != 2:
            raise ValueError(f"{self.extra} extra tokens per item: only begin and end (2) are laid out")
        return np.concatenate([[extra(BEGIN)], body, [extra(END)]])

    def gather_index(self, grids: Sequence[Grid], cap: Capacity) -> np.ndarray:
        """`out_index` [output_rows(cap)] of a batch into its merged tokens then the extra tokens."""
        merged = [t * h * w // self.merge_unit for t, h, w in grids]
        return gather_index([self.layout(g) for g in grids], merged, cap.patches // self.merge_unit,
                            self.output_rows(cap))
