"""Mergers that are more than one MLP over each merge block (models.layers.Merger): the tower's last step,
from patch features to the language model's tokens.

* `TemporalPairResampler` (ERNIE-4.5-VL's `resampler_model`): an MLP over each merge block, then one over
  each pair of temporal patches' blocks side by side (an image's frame paired with itself), a Linear to the
  text width and an RMSNorm. Which blocks pair up is metadata (`temporal_pair_metadata`), so the device
  does two gathers at fixed shapes.
* `GeluMlp`: linear_1 -> GELU -> linear_2, the two steps of MiniMax-M3's projector: one over each patch
  (`multi_modal_projector`), one over each merge block of projected patches (`patch_merge_mlp`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from models.layers import RMSNorm
from models.protocol import Capacity, Grid


def block_mlp(dim_in: int, dim: int, eps: float) -> nn.Sequential:
    """Linear -> GELU -> Linear -> LayerNorm, indexed as the checkpoint's `Sequential` (0, 2, 3)."""
    return nn.Sequential(nn.Linear(dim_in, dim), nn.GELU(), nn.Linear(dim, dim), nn.LayerNorm(dim, eps=eps))


class TemporalPairResampler(nn.Module):
    def __init__(self, dim: int, unit: int, out: int, eps: float, out_eps: float) -> None:
        super().__init__()
        self.width = dim * unit
        self.spatial_linear = block_mlp(self.width, self.width, eps)
        self.temporal_linear = block_mlp(2 * self.width, self.width, eps)
        self.mlp = nn.Linear(self.width, out)
        self.after_norm = RMSNorm(out, out_eps)

    def forward(self, x: torch.Tensor, meta: dict[str, torch.Tensor]) -> torch.Tensor:
        """x: [patches, dim] in merge-block order -> [len(pair_first), out]."""
        blocks = self.spatial_linear(x.view(-1, self.width))
        pairs = torch.cat([blocks[meta["pair_first"]], blocks[meta["pair_second"]]], dim=-1)
        return self.after_norm(self.mlp(self.temporal_linear(pairs)))


def temporal_pair_metadata(grids: Sequence[Grid], cap: Capacity, unit: int, rows: int) -> dict[str, np.ndarray]:
    """pair_first / pair_second [rows] int64: the merge blocks each output row joins, items back to back (their
    pairs of temporal patches in order, each pair's blocks in order); frames 2k and 2k+1, or an image's one
    frame twice. Padding rows read block 0."""
    first = np.zeros(rows, dtype=np.int64)
    second = np.zeros(rows, dtype=np.int64)
    block = row = 0
    for t, h, w in grids:
        per_frame = h * w // unit
        frames = block + per_frame * np.arange(t)
        starts = (frames, frames) if t == 1 else (frames[0 : t - 1 : 2], frames[1:t:2])
        for out, start in zip((first, second), starts):
            ids = (start[:, None] + np.arange(per_frame)).reshape(-1)
            out[row : row + len(ids)] = ids
        row += len(starts[0]) * per_frame
        block += t * per_frame
    if row > rows or block > cap.patches // unit:
        raise ValueError(f"{row} output rows of {block} merge blocks exceed the capacity ({rows} rows, {cap})")
    return {"pair_first": first, "pair_second": second}


class GeluMlp(nn.Module):
    """linear_1 -> GELU (exact) -> linear_2, with biases."""

    def __init__(self, dim: int, hidden: int, out: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))
