"""Patch embeddings other than the Qwen-VL Conv3d (models.layers.PatchEmbed).

`LinearPatchEmbed`: a Linear layer over each flattened patch row, as the checkpoint stores it (`proj`,
[hidden, patch_dim]); the row's layout is the processor's (ERNIE-4.5-VL: channel, then the patch's rows
and columns of one frame).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearPatchEmbed(nn.Module):
    def __init__(self, patch_dim: int, embed_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(patch_dim, embed_dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w, self.proj.bias)
