"""Qwen2.5-VL vision tower: RMSNorm blocks with a SwiGLU MLP and window attention.

Patches are reordered once after the patch embedding so that each window of
`window_size` pixels is contiguous; all layers but `fullatt_block_indexes` attend within windows,
the rest within whole frames (frames stay contiguous under the reorder). The merged tokens are put
back in the original order at the end. Both permutations are metadata, built on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ProcessorConfig
from models.kernels import ACTIVATIONS, activate
from models.layers import Attention, Block, RMSNorm, check_activation
from models.metadata import GRID_CACHE_SIZE, frozen, padded_cumsum
from models.protocol import Capacity, Grid, TowerOutput
from models.qwen2_vl import Merger
from models.tower import QwenTower


class GatedMlp(nn.Module):
    """SwiGLU. After loading, gate and up projections share one weight so a single GEMM computes
    both, and the intermediate width is zero-padded to a multiple of 64 (the released 3420 is not
    a multiple of 8, which pushes cuBLAS onto slow kernels); padded units are exactly zero. The
    checkpoint's parameter names stay as views into the fused tensors."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.hidden = hidden
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = check_activation(act)
        self.fused: tuple[torch.Tensor, torch.Tensor] | None = None

    def fuse(self) -> None:
        h, padded = self.hidden, -(-self.hidden // 64) * 64
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        weight = gate.weight.new_zeros(2 * padded, gate.weight.shape[1])
        bias = gate.bias.new_zeros(2 * padded)
        down_weight = down.weight.new_zeros(down.weight.shape[0], padded)
        weight[:h], weight[padded : padded + h] = gate.weight.data, up.weight.data
        bias[:h], bias[padded : padded + h] = gate.bias.data, up.bias.data
        down_weight[:, :h] = down.weight.data
        gate.weight.data, up.weight.data = weight[:h], weight[padded : padded + h]
        gate.bias.data, up.bias.data = bias[:h], bias[padded : padded + h]
        down.weight.data = down_weight[:, :h]
        self.fused = (weight, bias, down_weight, padded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is None:
            return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))
        weight, bias, down_weight, padded = self.fused
        hidden = activate(torch.nn.functional.linear(x, weight, bias), self.act, gated_width=padded)
        return torch.nn.functional.linear(hidden, down_weight, self.down_proj.bias)


@lru_cache(maxsize=GRID_CACHE_SIZE)
def window_layout(h: int, w: int, merge: int, ws: int) -> tuple[np.ndarray, np.ndarray]:
    """One frame's merge-group order putting each window of ws x ws groups together (from 0), and the
    window lengths in patches (read-only). Windows never cross frames."""
    gh, gw = h // merge, w // merge
    nh, nw = -(-gh // ws), -(-gw // ws)
    grid = np.full((nh * ws, nw * ws), -1, dtype=np.int64)
    grid[:gh, :gw] = np.arange(gh * gw).reshape(gh, gw)
    tiles = grid.reshape(nh, ws, nw, ws).transpose(0, 2, 1, 3).reshape(nh * nw, ws * ws)
    counts = (tiles >= 0).sum(1)
    flat = tiles.reshape(-1)
    return frozen(flat[flat >= 0]), frozen(counts[counts > 0] * merge * merge)


class Qwen2_5VisionTower(QwenTower):
    family = "qwen2_5_vl"

    def __init__(self, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        dim = vision_config.hidden_size
        super().__init__(vision_config, processor, backend, dim)
        self.blocks = nn.ModuleList(
            Block(
                RMSNorm(dim),
                RMSNorm(dim),
                Attention(dim, self.heads, backend),
                GatedMlp(dim, vision_config.intermediate_size, vision_config.hidden_act),
            )
            for _ in range(vision_config.depth)
        )
        self.merger = Merger(dim, vision_config.out_hidden_size, self.merge_unit, RMSNorm(dim))
        self.full_attention = frozenset(vision_config.fullatt_block_indexes)
        # Window edge in merged tokens (112 px / 14 px / 2 = 4 for the released configs).
        self.window = vision_config.window_size // self.merge // vision_config.patch_size

    @property
    def out_hidden_size(self) -> int:
        return self.config.out_hidden_size

    def reset_buffers(self) -> None:
        super().reset_buffers()
        for blk in self.blocks:
            blk.mlp.fuse()

    # ---- CPU half -------------------------------------------------------------------------
    def _windows(self, grids: Sequence[Grid]) -> tuple[np.ndarray, np.ndarray]:
        """Merge-group permutation putting each window together, and the window lengths in patches."""
        order, lengths, offset = [], [], 0
        for t, h, w in grids:
            frame_order, frame_lengths = window_layout(h, w, self.merge, self.window)
            groups = len(frame_order)  # merge groups per frame; frames follow one another
            order.append((frame_order + offset + groups * np.arange(t)[:, None]).reshape(-1))
            lengths.append(np.tile(frame_lengths, t))
            offset += t * groups
        if not order:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(order), np.concatenate(lengths)

    def required_capacity(self, grids: Sequence[Grid]) -> Capacity:
        base = super().required_capacity(grids)
        _, lengths = self._windows(grids)
        return Capacity(
            patches=base.patches,
            segments=base.segments,
            windows=len(lengths),
            max_seqlen=base.max_seqlen,
            max_window_seqlen=int(lengths.max()) if len(lengths) else 0,
        )

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        meta = super().build_metadata(grids, cap)
        order, lengths = self._windows(grids)
        groups = cap.patches // self.merge_unit
        window_index = np.arange(groups, dtype=np.int64)  # padding groups stay where they are
        window_index[: len(order)] = order
        reverse_index = np.empty_like(window_index)
        reverse_index[window_index] = np.arange(groups)
        pos = meta["pos_ids"].reshape(groups, self.merge_unit, 2)[window_index].reshape(-1, 2)
        meta.update(
            pos_ids=np.ascontiguousarray(pos),
            window_index=window_index,
            reverse_index=reverse_index,
            cu_window_seqlens=padded_cumsum(lengths, cap.windows),
        )
        return meta

    # ---- device half ----------------------------------------------------------------------
    def layer_segments(self, layer: int, meta: dict[str, torch.Tensor], cap: Capacity) -> tuple[torch.Tensor, int]:
        if layer in self.full_attention:
            return meta["cu_seqlens"], cap.max_seqlen
        return meta["cu_window_seqlens"], cap.max_window_seqlen

    def _encode(self, x: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        n, unit = x.shape[0], self.merge_unit
        x = x.view(n // unit, unit, -1)[meta["window_index"]].view(n, -1)
        x, _ = self.run_blocks(x, meta, cap)
        return TowerOutput(self.merger(x)[meta["reverse_index"]], [])
