"""Qwen3-VL vision tower: LayerNorm blocks with a tanh-GELU MLP, a learned position embedding
resampled bilinearly to each grid, and DeepStack mergers tapping intermediate layers.

The resampling is metadata: four table indices and four weights per patch, built on the CPU
(align_corners=True, in merge-block order), so the device does one gather and a weighted sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ProcessorConfig
from models.layers import Attention, Block, Mlp
from models.metadata import GRID_CACHE_SIZE, block_order_positions, frozen
from models.protocol import Capacity, Grid, TowerOutput
from models.tower import QwenTower


class Merger(nn.Module):
    """`postshuffle`: normalise the concatenated merge block (DeepStack) rather than each patch."""

    def __init__(self, dim: int, out_dim: int, unit: int, postshuffle: bool) -> None:
        super().__init__()
        self.width = dim * unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


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


class Qwen3VisionTower(QwenTower):
    family = "qwen3_vl"

    def __init__(self, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        dim = vision_config.hidden_size
        super().__init__(vision_config, processor, backend, dim)
        self.pos_embed = nn.Embedding(vision_config.num_position_embeddings, dim)
        self.side = int(vision_config.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(
            Block(
                nn.LayerNorm(dim, eps=1e-6),
                nn.LayerNorm(dim, eps=1e-6),
                Attention(dim, self.heads, backend),
                Mlp(dim, vision_config.intermediate_size, vision_config.hidden_act, ("linear_fc1", "linear_fc2")),
            )
            for _ in range(vision_config.depth)
        )
        out = vision_config.out_hidden_size
        self.merger = Merger(dim, out, self.merge_unit, postshuffle=False)
        self.deepstack_layers = list(vision_config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(
            Merger(dim, out, self.merge_unit, postshuffle=True) for _ in self.deepstack_layers
        )
        self.num_deepstack = len(self.deepstack_layers)

    @property
    def out_hidden_size(self) -> int:
        return self.config.out_hidden_size

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        meta = super().build_metadata(grids, cap)
        idx = np.zeros((cap.patches, 4), dtype=np.int64)
        wts = np.zeros((cap.patches, 4), dtype=np.float32)
        offset = 0
        for t, h, w in grids:
            frame_idx, frame_w = frame_taps(h, w, self.merge, self.side)
            idx[offset : offset + t * h * w].reshape(t, h * w, 4)[:] = frame_idx
            wts[offset : offset + t * h * w].reshape(t, h * w, 4)[:] = frame_w
            offset += t * h * w
        meta.update(interp_idx=idx, interp_w=wts)
        return meta

    def _encode(self, x: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        table = self.pos_embed.weight
        pos = (table[meta["interp_idx"]] * meta["interp_w"][..., None]).sum(1)
        x, tapped = self.run_blocks(x, meta, cap, taps=self.deepstack_layers, delta=pos.to(x.dtype))
        deepstack = [merger(h) for merger, h in zip(self.deepstack_merger_list, tapped)]
        return TowerOutput(self.merger(x), deepstack)
