"""VideoLLaMA3 (`video_llama_3`): a SigLIP tower (Conv2d patches, LayerNorm blocks with separate q/k/v/out
projections and tanh-GELU MLPs) with 2D rotary positions (Qwen-VL's axial rotary, models/layers.py), a
LayerNorm after the blocks, a merge size per item, and the projector (Linear, GELU, Linear) to the text width.

Images are not merged (merge size 1: one output row per patch, sides any multiple of the patch); videos are
merged 2x2 by bilinear downsampling, which on whole 2x2 blocks is their mean. The processors give each frame's
patch rows in merge-block order for the item's merge size (raster order for images), and the rotary positions
follow that order. The budget unit is a 2x2 block of patches (the tower's video merge), so an image gives four
output rows per budget unit: `ModalityMerge` says so to the packing and the graph pool. Attention within each
frame. The checkpoint keeps the tower under `model.vision_model.*` and the projector under `model.projector.*`;
its vision config knows nothing of the text width, so the tower reads the whole model's config.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from models.config import ProcessorConfig
from models.family import Dims, Family, register
from models.layers import Rotary2D
from models.metadata import rotary_positions
from models.patches import Conv2dPatches
from models.protocol import Capacity, Geometry, Grid, TowerOutput
from models.siglip import SiglipBlock
from models.tower import rope_theta
from models.vit_tower import ViTTower


@dataclass(frozen=True)
class ModalityMerge(Geometry):
    """A merge size per modality: `merge` (the budget unit's side) for videos, `image_merge` for images."""

    image_merge: int = 1

    def merge_of(self, modality: str) -> int:
        return self.image_merge if modality == "image" else self.merge

    def tokens(self, grid: Grid, modality: str = "image") -> int:
        t, h, w = grid
        return t * h * w // self.merge_of(modality) ** 2

    def output_rows(self, cap: Capacity) -> int:
        return cap.patches // self.merge_of(cap.modality) ** 2

    def describe(self) -> str:
        return f"images t*h*w/{self.image_merge**2}, videos t*h*w/{self.merge_unit}"


class VideoLlama3Tower(ViTTower):
    def __init__(self, family: Family, config: Any, processor: ProcessorConfig, backend: str) -> None:
        cfg = config.vision_config
        self.image_merge = processor.merge_size
        # the whole model's config: the projector reads the text width
        super().__init__(family, config, processor, backend, processor.video_merge_size)
        self.check_processor(cfg.patch_size, 1)
        dims = self.dims
        self.rotary = Rotary2D(dims.hidden // dims.heads, rope_theta(cfg))
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = Conv2dPatches(cfg.num_channels, dims.hidden, cfg.patch_size)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipBlock(dims, cfg.hidden_act, cfg.layer_norm_eps, backend)
                                            for _ in range(dims.depth))
        self.post_layernorm = nn.LayerNorm(dims.hidden, eps=cfg.layer_norm_eps)
        self.readout = nn.Sequential(nn.Linear(dims.hidden, dims.out), nn.GELU(), nn.Linear(dims.out, dims.out))

    def make_geometry(self) -> ModalityMerge:
        return ModalityMerge(self.merge, image_merge=self.image_merge)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.encoder.layers)

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        meta = super().build_metadata(grids, cap)
        meta["pos_ids"] = rotary_positions(grids, self.geometry.merge_of(cap.modality), cap.patches)
        return meta

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x = self.embeddings.patch_embedding(self.normalized(pixels, cap))
        cos, sin = self.rotary(meta["pos_ids"])
        x = self.post_layernorm(self.run_blocks(x, meta, cap, cos=cos, sin=sin))
        unit = self.geometry.merge_of(cap.modality) ** 2
        if unit > 1:  # bilinear downsampling by the merge size: each block's mean
            x = x.view(-1, unit, x.shape[-1]).mean(1)
        return TowerOutput(self.readout(x), [])


def videollama3_dims(cfg: Any) -> Dims:
    v = cfg.vision_config
    return Dims(hidden=v.hidden_size, heads=v.num_attention_heads, kv_heads=v.num_attention_heads,
                mlp=v.intermediate_size, depth=v.num_hidden_layers, out=cfg.text_config.hidden_size)


def reference_features(model: Any, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """transformers' own entry point on images (the benchmarks' and GPU tests' reference), which it does not
    merge: every image's rows back to back."""
    merges = torch.ones(len(grid_thw), dtype=torch.long, device=grid_thw.device)
    return torch.cat(list(model.model.get_image_features(pixels, grid_thw, image_merge_sizes=merges).pooler_output))


VIDEO_LLAMA_3 = register(Family(
    "video_llama_3", "VideoLLaMA3", config_path=(),
    prefixes=("model.vision_model.", "model.projector.", "vision_model.", "projector."), dims=videollama3_dims,
    video_sampling="video_llama_3", image_processor="VideoLlama3ImageProcessor",
    processor_defaults={"image": {"patch_size": 14, "temporal_patch_size": 1, "merge_size": 1,
                                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                                  "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}},
                        "video": {"patch_size": 14, "temporal_patch_size": 1, "merge_size": 2, "fps": 1,
                                  "min_frames": 4, "max_frames": 180, "image_mean": [0.5, 0.5, 0.5],
                                  "image_std": [0.5, 0.5, 0.5],
                                  "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}}},
    hf_class="VideoLlama3ForConditionalGeneration", tower=VideoLlama3Tower,
    extra={"reference_features": reference_features},
))
