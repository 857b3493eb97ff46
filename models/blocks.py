"""Block parts beyond the Qwen-style ones: checkpoint names for shared parts, and the gated depthwise
convolution over each frame's patch grid (LFM3-VL's conv blocks, which sit beside its attention blocks).

The convolution is metadata plus a weighted sum: for every patch the host lists the rows of its k x k
neighbours in the packed batch (`frame_conv_metadata`, a neighbour outside the frame reads one extra row
of zeros), and the device sums the gathered rows over that fixed tap axis, tap by tap. Nothing depends on
the batch but the row numbers, so an item's output is the same in any batch, and the forward has static
shapes and no host reads (models/protocol.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn

from models.layers import Attention, Block, GatedMlp
from models.metadata import GRID_CACHE_SIZE, block_order_positions, frozen
from models.protocol import Capacity, Grid


class Renamed:
    """A module whose checkpoint names some of its parts otherwise than the shared code reads them (a block's
    `norm1` is LFM3-VL's `operator_norm`): `use_names` moves the parts to the checkpoint's names, which state
    dicts and loading see, and the code keeps reading and writing them by its own names."""

    def use_names(self, names: dict[str, str]) -> Any:
        modules = self._modules  # type: ignore[attr-defined]
        for ours, theirs in names.items():
            modules[theirs] = modules.pop(ours)
        self.__dict__["_aliases"] = dict(names)
        return self

    def __getattr__(self, name: str) -> Any:
        aliases = self.__dict__.get("_aliases")
        return super().__getattr__(aliases.get(name, name) if aliases else name)  # type: ignore[misc]

    def __setattr__(self, name: str, value: Any) -> None:
        aliases = self.__dict__.get("_aliases")
        super().__setattr__(aliases.get(name, name) if aliases else name, value)


class NamedBlock(Renamed, Block):
    """models.layers.Block under the checkpoint's names."""


class NamedGatedMlp(Renamed, GatedMlp):
    """models.layers.GatedMlp under the checkpoint's names (`w1`, `w3`, `w2`; `fc1`, `fc3`, `fc2`)."""


class NamedAttention(Renamed, Attention):
    """models.layers.Attention with separate q/k/v projections, under the checkpoint's names (`q_proj`, ...,
    `out_proj`, `q_layernorm`), with or without biases."""

    def fuse(self) -> None:
        """One weight (and bias, where the projections have them) for q, k and v, the checkpoint's
        parameters kept as views into it."""
        parts = (self.q, self.k, self.v)
        weight = torch.cat([p.weight.data for p in parts])
        bias = None if parts[0].bias is None else torch.cat([p.bias.data for p in parts])
        start = 0
        for p in parts:
            end = start + p.weight.shape[0]
            p.weight.data = weight[start:end]
            if bias is not None:
                p.bias.data = bias[start:end]
            start = end
        self.fused = (weight, bias)


class FrameConv(nn.Module):
    """Gated depthwise convolution over each frame's patch grid, in an attention layer's place.

    in_proj gives three gates per patch (input gate b, output gate c, input x); b*x is convolved depthwise
    with a k x k kernel (zero padding at the frame's edges, stride 1, as `spatial_conv`, the checkpoint's
    Conv2d); the result, times c, goes through out_proj. The convolution reads its neighbour rows from
    `frame_conv_metadata` (passed where an attention layer gets its segments) and accumulates in float32.
    """

    def __init__(self, dim: int, kernel: int, bias: bool = False) -> None:
        super().__init__()
        if kernel % 2 != 1:
            raise ValueError(f"the frame convolution needs an odd kernel size (same padding); got {kernel}")
        self.in_proj = nn.Linear(dim, 3 * dim, bias=bias)
        self.spatial_conv = nn.Conv2d(dim, dim, kernel, padding=kernel // 2, groups=dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, taps: torch.Tensor, max_seqlen: int = 0,
        short: bool = False,
    ) -> torch.Tensor:
        """x: [patches, dim]; taps: [patches, k*k] rows of each patch's neighbours (`patches` for none).
        cos, sin, max_seqlen and short are an attention layer's and unused."""
        input_gate, output_gate, conv_input = self.in_proj(x).chunk(3, dim=-1)
        gated = input_gate * conv_input
        padded = torch.cat([gated, gated.new_zeros(1, gated.shape[1])]).float()
        weight = self.spatial_conv.weight.view(gated.shape[1], -1).float()  # [dim, k*k]
        acc = padded[taps[:, 0]] * weight[:, 0]
        for j in range(1, weight.shape[1]):  # a fixed number of taps, each a gather and one fused multiply-add
            acc = torch.addcmul(acc, padded[taps[:, j]], weight[:, j])
        if self.spatial_conv.bias is not None:
            acc = acc + self.spatial_conv.bias.float()
        return self.out_proj(output_gate * acc.to(gated.dtype))


@lru_cache(maxsize=GRID_CACHE_SIZE)
def frame_neighbours(h: int, w: int, merge: int, kernel: int) -> np.ndarray:
    """[h*w, kernel*kernel] int64: for each patch of one frame, in merge-block order, the frame row (also in
    merge-block order) of each neighbour of a kernel x kernel window, taps in the kernel's raster order
    (a Conv2d weight's [k, k] flattened); -1 where the neighbour is outside the frame. Read-only."""
    pos = block_order_positions(h, w, merge)
    row_of = np.empty((h, w), dtype=np.int64)
    row_of[pos[:, 0], pos[:, 1]] = np.arange(h * w)
    offsets = np.arange(kernel) - kernel // 2
    rows = pos[:, 0][:, None, None] + offsets[None, :, None]  # [h*w, k, 1]
    cols = pos[:, 1][:, None, None] + offsets[None, None, :]  # [h*w, 1, k]
    inside = (rows >= 0) & (rows < h) & (cols >= 0) & (cols < w)
    out = np.where(inside, row_of[np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1)], -1)
    return frozen(out.reshape(h * w, kernel * kernel))


def frame_conv_metadata(grids: Sequence[Grid], cap: Capacity, merge: int, kernel: int) -> dict[str, np.ndarray]:
    """conv_taps [patches, kernel*kernel] int64: rows of each patch's neighbours within its own frame in the
    packed batch; `cap.patches` (the zero row the forward appends) for neighbours outside the frame and for
    every tap of the padding rows."""
    taps = np.full((cap.patches, kernel * kernel), cap.patches, dtype=np.int64)
    offset = 0
    for t, h, w in grids:
        frame = frame_neighbours(h, w, merge, kernel)
        starts = offset + np.arange(t, dtype=np.int64)[:, None, None] * (h * w)  # one per frame
        taps[offset : offset + t * h * w] = np.where(frame >= 0, starts + frame, cap.patches).reshape(-1, kernel**2)
        offset += t * h * w
    return {"conv_taps": taps}
