"""Learned absolute positions resampled to each grid (Qwen3-VL, GLM-4.1V and the towers built like them).

A square table of `side` x `side` embeddings is resampled to each frame's patch grid: bilinearly with
align_corners=True (Qwen3-VL), or bicubically at the patch centres with align_corners=False and the
border clamped (GLM-4.1V: transformers' `grid_sample(mode="bicubic")`), bilinearly at the patch centres
(PaddleOCR-VL; HunyuanOCR and Hy4, whose tables follow a class row), or with F.interpolate's antialiased
bilinear (Cosmos3-Edge, SigLIP2). The resampling is metadata: table indices and weights per patch (4, or 16
for bicubic), or for the antialiased kind dense row and column weights, built on the CPU in float32 in the
rows' order (merge blocks, or row-major with a merge of 1), so the device does one weighted gather (or one
product) and a graph replays it from static buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from models.kernels import Taps, weighted_rows
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


def tap_metadata(grids: Sequence[Grid], cap: Capacity, taps: int,
                 frame_taps_of: Callable[[int, int], tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """interp_idx / interp_w [patches, taps] from each frame's taps (`frame_taps_of(h, w)`), repeated over
    its temporal patches; padding rows read entry 0 with weight 0."""
    idx = np.zeros((cap.patches, taps), dtype=np.int64)
    wts = np.zeros((cap.patches, taps), dtype=np.float32)
    offset = 0
    for t, h, w in grids:
        frame_idx, frame_w = frame_taps_of(h, w)
        idx[offset : offset + t * h * w].reshape(t, h * w, taps)[:] = frame_idx
        wts[offset : offset + t * h * w].reshape(t, h * w, taps)[:] = frame_w
        offset += t * h * w
    return {"interp_idx": idx, "interp_w": wts}


def bilinear_metadata(grids: Sequence[Grid], cap: Capacity, merge: int, side: int) -> dict[str, np.ndarray]:
    """interp_idx / interp_w [patches, 4]."""
    return tap_metadata(grids, cap, 4, lambda h, w: frame_taps(h, w, merge, side))


def resample(table: torch.Tensor, meta: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each patch's position embedding: the weighted sum of its four table rows (float32)."""
    return weighted_rows(table, meta["interp_idx"], meta["interp_w"])


def resampled(table: torch.Tensor, meta: dict[str, torch.Tensor]) -> Taps:
    """`resample`'s rows rounded to the stream's dtype, as a delta the first block's add and norm make in their
    own pass (models.kernels.add_norm)."""
    return Taps(table, meta["interp_idx"], meta["interp_w"])


# ---- bicubic (GLM-4.1V) ---------------------------------------------------------------------------

CUBIC_A = -0.75  # PyTorch's bicubic convolution (grid_sample, interpolate)


def cubic_weights(t: np.ndarray) -> np.ndarray:
    """[n, 4] float32 weights of the taps at floor-1 .. floor+2 for fractions t, as PyTorch's
    `get_cubic_upsample_coefficients` computes them."""
    a, one = np.float32(CUBIC_A), np.float32(1)

    def near(x: np.ndarray) -> np.ndarray:  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + one

    def far(x: np.ndarray) -> np.ndarray:  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return np.stack([far(t + one), near(t), near(one - t), far(2 - t)], axis=1).astype(np.float32)


def _cubic_axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Four table indices and weights per position along one axis: the patch centre mapped to [-1, 1]
    as the reference does, then onto `side` cells (align_corners=False); taps clamped to the border."""
    norm = (index.astype(np.float32) + np.float32(0.5)) / np.float32(size) * np.float32(2) - np.float32(1)
    src = (norm + np.float32(1)) * np.float32(side / 2) - np.float32(0.5)
    floor = np.floor(src)
    taps = floor.astype(np.int64)[:, None] + np.arange(-1, 3)
    return np.clip(taps, 0, side - 1), cubic_weights((src - floor).astype(np.float32))


# Four times the bilinear taps per patch: a quarter of the frame shapes cached, for the same memory bound.
@lru_cache(maxsize=GRID_CACHE_SIZE // 4)
def bicubic_frame_taps(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Table indices and weights [h*w, 16] of one frame's patches, in merge-block order (read-only)."""
    pos = block_order_positions(h, w, merge)
    row_taps, row_w = _cubic_axis_taps(pos[:, 0], h, side)
    col_taps, col_w = _cubic_axis_taps(pos[:, 1], w, side)
    idx = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 16)
    wts = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 16)
    return frozen(idx), frozen(wts)


def bicubic_metadata(grids: Sequence[Grid], cap: Capacity, merge: int, side: int) -> dict[str, np.ndarray]:
    """interp_idx / interp_w [patches, 16]."""
    return tap_metadata(grids, cap, 16, lambda h, w: bicubic_frame_taps(h, w, merge, side))


def resample_float32(table: torch.Tensor, meta: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each patch's position embedding in float32 (the reference resamples a float32 copy of the table):
    a weighted sum of its table rows in one kernel, without a [patches, taps, dim] intermediate."""
    return F.embedding_bag(meta["interp_idx"], table.float(), per_sample_weights=meta["interp_w"], mode="sum")


# ---- bilinear at patch centres, align_corners=False (PaddleOCR-VL, HunyuanOCR, Hy4) ----------------
#
# Two references compute the same half-pixel taps in their own float32 arithmetic, and each is reproduced
# exactly: transformers' packed helper `get_vision_interpolation_indices_and_weights` (PaddleOCR-VL), and
# F.interpolate(mode="bilinear", align_corners=False) itself (HunyuanOCR, Hy4), which can also sample by a
# scale factor. A table may have leading rows the grid does not use (`first`: a class token's).


def _helper_axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Two table indices and weights per position along one axis: the patch centre (index + 0.5) * side / size
    - 0.5 in float32, in that order as transformers' `get_vision_interpolation_indices_and_weights` computes
    it, taps clamped to the border (a centre before the first cell reads the first cell twice)."""
    src = (index.astype(np.float32) + np.float32(0.5)) * np.float32(side) / np.float32(size) - np.float32(0.5)
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = floor.astype(np.int64)[:, None] + np.arange(2)
    weights = np.clip(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets), 0, None)
    return np.clip(taps, 0, side - 1), weights.astype(np.float32)


def _interpolate_axis_taps(index: np.ndarray, size: int, side: int, offset: float | None = None
                           ) -> tuple[np.ndarray, np.ndarray]:
    """The same as PyTorch's bilinear upsampling computes it in float32 (`area_pixel_compute_source_index`:
    src = step * (i + 0.5) - 0.5, negative values clamped to 0; the second tap stays at the border), the step
    side / size (`interpolate(size=...)`) or, with `offset`, the reciprocal of the scale factor
    (size + offset) / side (`interpolate(scale_factor=...)`, Hy4). An axis as long as the table's is copied as
    it is, whatever the scale factor (PyTorch's kernel does so)."""
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
def half_pixel_frame_taps(h: int, w: int, merge: int, side: int, first: int = 0, offset: float | None = None,
                          kernel: str = "helper") -> tuple[np.ndarray, np.ndarray]:
    """Table indices and weights [h*w, 4] of one frame's patches for bilinear resampling with
    align_corners=False, in merge-block order (merge 1: row-major) (read-only). `kernel`: "helper" or
    "interpolate", whose arithmetic is reproduced (above); `offset` is the latter's."""
    pos = block_order_positions(h, w, merge)
    if kernel == "helper":
        if offset is not None:
            raise ValueError("transformers' helper samples by size only: no offset")
        row_taps, row_w = _helper_axis_taps(pos[:, 0], h, side)
        col_taps, col_w = _helper_axis_taps(pos[:, 1], w, side)
    else:
        row_taps, row_w = _interpolate_axis_taps(pos[:, 0], h, side, offset)
        col_taps, col_w = _interpolate_axis_taps(pos[:, 1], w, side, offset)
    idx = first + (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    wts = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
    return frozen(idx), frozen(wts)


def half_pixel_metadata(grids: Sequence[Grid], cap: Capacity, merge: int, side: int, first: int = 0,
                        offset: float | None = None, kernel: str = "helper") -> dict[str, np.ndarray]:
    """interp_idx / interp_w [patches, 4] (read by `resample` and `resample_float32`; frames of a video repeat
    their frame's positions, padding rows read row 0 with weight 0)."""
    return tap_metadata(grids, cap, 4, lambda h, w: half_pixel_frame_taps(h, w, merge, side, first, offset, kernel))


# ---- antialiased bilinear (Cosmos3-Edge, SigLIP2) --------------------------------------------------
#
# F.interpolate(mode="bilinear", align_corners=False, antialias=True) widens its triangle filter by the
# downsampling ratio, so a patch reads more table cells the smaller its frame: every cell of an axis for a
# frame two patches wide. Its weights are separable; each patch carries a dense row of weights per axis
# ([patches, side] twice, the same shape for any frame), and the device forms the outer product and
# multiplies it with the table: sync-free at a fixed capacity whatever the ratio.


@lru_cache(maxsize=GRID_CACHE_SIZE)
def antialias_axis_weights(size: int, side: int) -> np.ndarray:
    """[size, side] float32: the weight of each of `side` table cells in each of `size` outputs along one axis,
    exactly as torch's CPU kernel computes them in float32: it resamples a one-hot table along its rows, and
    the weights themselves come out. (Two rows kept as they are: torch 2.13's antialiased kernel gives wrong
    values for a dimension of one.)"""
    with torch.no_grad():
        eye = torch.eye(side, dtype=torch.float32).view(1, side, 1, side).expand(1, side, 2, side).contiguous()
        out = F.interpolate(eye, size=(2, size), mode="bilinear", align_corners=False, antialias=True)
    return frozen(out[0, :, 0, :].T.contiguous().numpy())


@lru_cache(maxsize=GRID_CACHE_SIZE // 4)
def antialias_frame_weights(h: int, w: int, merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column weights [h*w, side] of one frame's patches, in merge-block order (merge 1: row-major)."""
    pos = block_order_positions(h, w, merge)
    return frozen(antialias_axis_weights(h, side)[pos[:, 0]]), frozen(antialias_axis_weights(w, side)[pos[:, 1]])


def antialias_metadata(grids: Sequence[Grid], cap: Capacity, merge: int, side: int) -> dict[str, np.ndarray]:
    """pos_rows / pos_cols [patches, side], repeated over each item's temporal patches; padding rows weigh 0."""
    rows = np.zeros((cap.patches, side), dtype=np.float32)
    cols = np.zeros((cap.patches, side), dtype=np.float32)
    offset = 0
    for t, h, w in grids:
        frame_rows, frame_cols = antialias_frame_weights(h, w, merge, side)
        rows[offset : offset + t * h * w].reshape(t, h * w, side)[:] = frame_rows
        cols[offset : offset + t * h * w].reshape(t, h * w, side)[:] = frame_cols
        offset += t * h * w
    return {"pos_rows": rows, "pos_cols": cols}


def resample_separable(table: torch.Tensor, meta: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each patch's position embedding in float32 from a square table [side * side, dim]: the outer product
    of its row and column weights times the table, one matrix product for the whole batch."""
    rows, cols = meta["pos_rows"], meta["pos_cols"]
    weights = (rows[:, :, None] * cols[:, None, :]).view(rows.shape[0], -1)
    return weights @ table.float()
