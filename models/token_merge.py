"""Ways a tower folds merge blocks of patches into tokens, beyond models.layers.Merger's concatenation.

Rows travel in merge-block order (a block's `unit` patches contiguous, models/metadata.py), so a block is
a group of `unit` consecutive rows.

* `pixel_shuffle`: a block's patches side by side channel-major (d * unit + k), as a pixel-unshuffle of the
  frame does (Muse).
* `temporal_mean`: each output token is the mean over the frames of a clip (or of a chunk of a video) of the
  same block, as `[tokens, unit, dim]` in float32 (Kimi-K2.x pools frames before its projector). The frames
  are a fixed number of slots per token gathered from precomputed group indices and summed over that
  fixed axis, so a token's bytes never depend on its batch (no atomics, one order of additions); unused
  slots read the token's first frame with weight zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from models.protocol import Grid


def pixel_shuffle(x: torch.Tensor, unit: int) -> torch.Tensor:
    """[blocks * unit, dim] -> [blocks, dim * unit], column d * unit + k holding patch k's channel d."""
    return x.view(-1, unit, x.shape[-1]).transpose(1, 2).reshape(-1, unit * x.shape[-1])


def temporal_mean_metadata(grids: Sequence[Grid], rows: int, unit: int, chunk: int) -> dict[str, np.ndarray]:
    """pool_groups [rows, chunk] int64 (merge groups, i.e. row // unit), pool_w [rows, chunk] float32.

    Each item's frames are pooled in chunks of `chunk` (the last one may be shorter): a chunk of n frames
    gives one output row per merge block of a frame, the mean of that block over its n frames. Output rows
    follow the items, then their chunks, then the blocks of a frame; rows beyond the items read group 0
    with weight zero."""
    groups = np.zeros((rows, chunk), dtype=np.int64)
    weights = np.zeros((rows, chunk), dtype=np.float32)
    row = group = 0
    for t, h, w in grids:
        per_frame = h * w // unit
        block = np.arange(per_frame)
        for start in range(0, t, chunk):
            n = min(chunk, t - start)
            frames = start + np.minimum(np.arange(chunk), n - 1) * (np.arange(chunk) < n)  # unused: the first
            out = slice(row, row + per_frame)
            groups[out] = group + frames[None, :] * per_frame + block[:, None]
            weights[out, :n] = np.float32(1) / np.float32(n)
            row += per_frame
        group += t * per_frame
    return {"pool_groups": groups, "pool_w": weights}


def temporal_mean(x: torch.Tensor, meta: dict[str, torch.Tensor], unit: int) -> torch.Tensor:
    """[rows, unit, dim] float32: each output row's blocks weighted and summed over its frame slots."""
    blocks = x.float().view(-1, unit, x.shape[-1])[meta["pool_groups"]]  # [rows, chunk, unit, dim]
    return (blocks * meta["pool_w"][:, :, None, None]).sum(1)
