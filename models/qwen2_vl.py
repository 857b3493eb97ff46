"""Qwen2-VL vision tower: LayerNorm blocks with a QuickGELU MLP, one merger."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.config import ProcessorConfig
from models.layers import Attention, Block, Mlp
from models.protocol import Capacity, TowerOutput
from models.tower import QwenTower


class Merger(nn.Module):
    """Norm each patch, concatenate each merge block's patches, two-layer GELU MLP."""

    def __init__(self, dim: int, out_dim: int, unit: int, norm: nn.Module) -> None:
        super().__init__()
        self.ln_q = norm
        self.mlp = nn.Sequential(nn.Linear(dim * unit, dim * unit), nn.GELU(), nn.Linear(dim * unit, out_dim))
        self.width = dim * unit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTower(QwenTower):
    family = "qwen2_vl"

    def __init__(self, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        dim = vision_config.embed_dim
        super().__init__(vision_config, processor, backend, dim)
        hidden = int(dim * vision_config.mlp_ratio)
        self.blocks = nn.ModuleList(
            Block(
                nn.LayerNorm(dim, eps=1e-6),
                nn.LayerNorm(dim, eps=1e-6),
                Attention(dim, self.heads, backend),
                Mlp(dim, hidden, vision_config.hidden_act),
            )
            for _ in range(vision_config.depth)
        )
        self.merger = Merger(dim, vision_config.hidden_size, self.merge_unit, nn.LayerNorm(dim, eps=1e-6))

    @property
    def out_hidden_size(self) -> int:
        return self.config.hidden_size

    def _encode(self, x: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x, _ = self.run_blocks(x, meta, cap)
        return TowerOutput(self.merger(x), [])
