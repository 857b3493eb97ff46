"""Patch embeddings over pixel rows: a Conv2d whose kernel equals its stride, or a Linear, applied to each row
as one matrix product.

A row holds one patch's values in its processor's order (models/config.py `patch_layout`: "chw" or "hwc"),
and a checkpoint's weight reads its inputs in an order of its own: a Conv2d's is (channel, row, col), a
Linear's that of the processor it was trained with ("tchw": temporal first, as Muse's). Where the two differ,
the weight's columns are permuted once after loading (`fuse`), never the pixels.

`PatchProjection` holds either under the checkpoint's `proj` name, with the norm a tower puts after it (the
Qwen-VL Conv3d is models.layers.PatchEmbed). A kernel of 1 makes `Conv2dPatches` a 1x1 convolution over
token rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# The axes of a row in each layout: channel, temporal, patch row, patch column.
LAYOUT_AXES = {"chw": "ctyx", "hwc": "yxct", "tchw": "tcyx"}


def columns_in_row_order(weight: torch.Tensor, weight_layout: str, row_layout: str, sizes: dict[str, int]
                         ) -> torch.Tensor:
    """weight [out, C*T*P*P] whose columns follow `weight_layout`, with its columns reordered to `row_layout`
    (a view when the two agree)."""
    if weight_layout == row_layout:
        return weight
    src, dst = LAYOUT_AXES[weight_layout], LAYOUT_AXES[row_layout]
    shaped = weight.reshape(weight.shape[0], *(sizes[a] for a in src))
    return shaped.permute(0, *(1 + src.index(a) for a in dst)).reshape(weight.shape[0], -1)


class _RowProduct:
    """What both patch embeddings share: the weight as a [out, row width] matrix in the rows' order."""

    keeps_precision = True  # the first product, over raw pixels: --quantization fp8 leaves it as it is

    weight: torch.Tensor
    bias: torch.Tensor | None
    rows: str
    weight_layout: str
    sizes: dict[str, int]
    flat: torch.Tensor | None

    def row_weight(self) -> torch.Tensor:
        if self.flat is not None:
            return self.flat
        return columns_in_row_order(self.weight.reshape(self.weight.shape[0], -1), self.weight_layout, self.rows,
                                    self.sizes)

    def keep_flat(self) -> None:
        """`flat` as a buffer outside the state dict, so that it moves with the module."""
        self.register_buffer("flat", None, persistent=False)  # type: ignore[attr-defined]

    @torch.no_grad()
    def fuse(self) -> None:
        """After loading: keep a copy in the rows' order, with zero columns up to a multiple of 8 (a few MB at
        most); a plain tensor, not a product of the parameter (the tower can be copied, and keeps no autograd
        graph). The padding is for cuBLAS: a bias-free bf16 product with an inner dimension off a multiple of 8
        (ERNIE's 588) took kernels whose rows differed with the row count on the H200 (models/blas.py)."""
        self.flat = None
        w = self.row_weight()
        pad = -w.shape[1] % 8
        if self.weight_layout != self.rows or pad:
            self.flat = F.pad(w, (0, pad)).contiguous()

    def project(self, x: torch.Tensor) -> torch.Tensor:
        w = self.row_weight()
        x = x.to(w.dtype)
        if x.shape[-1] != w.shape[1]:  # the zero columns `fuse` added
            x = F.pad(x, (0, w.shape[1] - x.shape[-1]))
        return F.linear(x, w, self.bias)


class Conv2dPatches(_RowProduct, nn.Conv2d):
    """The checkpoint's Conv2d(channels, dim, kernel = stride = patch) on rows of `rows` layout (one frame:
    a temporal patch size of 1)."""

    def __init__(self, channels: int, dim: int, patch: int, rows: str = "chw", bias: bool = True) -> None:
        nn.Conv2d.__init__(self, channels, dim, kernel_size=patch, stride=patch, bias=bias)
        self.rows, self.weight_layout = rows, "chw"
        self.keep_flat()
        self.sizes = {"c": channels, "t": 1, "y": patch, "x": patch}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)


class LinearPatches(_RowProduct, nn.Linear):
    """The checkpoint's Linear(C*T*P*P, dim) whose inputs follow `weight_layout`, on rows of `rows` layout."""

    def __init__(self, channels: int, temporal: int, patch: int, dim: int, weight_layout: str, rows: str,
                 bias: bool = True) -> None:
        nn.Linear.__init__(self, channels * temporal * patch * patch, dim, bias=bias)
        self.rows, self.weight_layout = rows, weight_layout
        self.keep_flat()
        self.sizes = {"c": channels, "t": temporal, "y": patch, "x": patch}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)


class PatchProjection(nn.Module):
    """A patch embedding under the checkpoint's `proj` name, then `norm` where the tower normalises the patches
    (dots3-note's RMSNorm)."""

    def __init__(self, proj: Conv2dPatches | LinearPatches, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.proj = proj
        self.norm = norm if norm is not None else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))
