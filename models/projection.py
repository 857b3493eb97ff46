"""A projection of the merged tokens to the language model's width, kept beside the vision model in the
checkpoint (HyperCLOVAX-SEED's `vision_projector`): the model's image features, what its language model
consumes, are the projection's output."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.config import ProcessorConfig
from models.family import Family
from models.protocol import Capacity, TowerOutput
from models.tower import QwenTower


class ProjectedTower(QwenTower):
    """The shared tower followed by one Linear (`projector`) from the merger's width to the vision config's
    `projection_size` (the family reads it in the whole model's config: `Family.vision_extras`), applied to
    every output row, DeepStack features included."""

    def __init__(self, family: Family, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        super().__init__(family, vision_config, processor, backend)
        self.projector = nn.Linear(self.dims.out, vision_config.projection_size)

    @property
    def out_hidden_size(self) -> int:
        return self.projector.out_features

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        out = super().forward(pixels, meta, cap)
        return TowerOutput(self.projector(out.embeds), [self.projector(d) for d in out.deepstack])
