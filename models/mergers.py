"""Projectors that merge each block of merge x merge patches into one token, for towers whose projector is
not Qwen-VL's `Merger` (models/layers.py): a norm on each patch, the block's patches side by side, then a
two-layer MLP of any width, its parameters named as the checkpoint names them.

Towers that keep their patches row-major (their processor's `patch_order` "raster") gather each block's
patches together first: `raster_merge_index`, built on the CPU, lists for each output position the row
that holds it, so the device does one gather at a fixed capacity.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from models.kernels import linear_act
from models.layers import check_activation, make_norm
from models.metadata import GRID_CACHE_SIZE, block_order_positions, frozen
from models.protocol import Grid


@lru_cache(maxsize=GRID_CACHE_SIZE)
def raster_frame_order(h: int, w: int, merge: int) -> np.ndarray:
    """[h*w] int64: the row-major index of each patch of one frame, listed in merge-block order (read-only)."""
    pos = block_order_positions(h, w, merge)
    return frozen(pos[:, 0].astype(np.int64) * w + pos[:, 1])


def raster_merge_index(grids: Sequence[Grid], merge: int, patches: int) -> np.ndarray:
    """[patches] int64 gather index turning row-major items into merge-block order (each frame of a video on
    its own); rows past the items point at themselves."""
    index = np.arange(patches, dtype=np.int64)
    offset = 0
    for t, h, w in grids:
        frame = raster_frame_order(h, w, merge)
        index[offset : offset + t * h * w] = (offset + np.arange(t)[:, None] * (h * w) + frame).reshape(-1)
        offset += t * h * w
    return index


class MlpMerger(nn.Module):
    """norm(patch) -> a merge block's `unit` patches concatenated -> fc1 -> act -> fc2.

    `names`: the checkpoint's names for (norm, fc1, fc2), e.g. ("norm", "linear_fc1", "linear_fc2") or
    ("pre_norm", "linear_1", "linear_2"). `hidden`: fc1's width (the concatenated width when None).
    """

    def __init__(self, dim: int, unit: int, out: int, names: tuple[str, str, str], hidden: int | None = None,
                 norm: str = "layer", eps: float = 1e-6, act: str = "gelu") -> None:
        super().__init__()
        self.width = dim * unit
        self.hidden = hidden or self.width
        self.names = names
        self.act = check_activation(act)
        setattr(self, names[0], make_norm(norm, dim, eps))
        setattr(self, names[1], nn.Linear(self.width, self.hidden))
        setattr(self, names[2], nn.Linear(self.hidden, out))

    @property
    def products(self) -> list[tuple[int, int]]:
        """The (in, out) sizes of its matrix products on each token (benchmarks count their FLOPs)."""
        return [(self.width, self.hidden), (self.hidden, getattr(self, self.names[2]).out_features)]

    def forward(self, x: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
        """x: [patches, dim]; `order` (optional): the gather index that brings each block's patches together."""
        norm, fc1, fc2 = (getattr(self, n) for n in self.names)
        x = norm(x)
        if order is not None:
            x = x[order]
        return fc2(linear_act(x.reshape(-1, self.width), fc1, self.act))
