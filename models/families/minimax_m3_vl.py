"""MiniMax-M3 (`minimax_m3_vl`): a CLIP-style tower with 3D rotary over clips, and a two-step projector.

The tower: Qwen2.5-VL's bias-free Conv3d patches, a LayerNorm before the blocks (`pre_layrnorm`), pre-norm
blocks (LayerNorm eps 1e-5, separate q/k/v projections with biases, GELU MLP), a partial rotary over
(time, row, column) in equal bands (models.rotary.AxialRotary) and no norm after the blocks. Attention spans
clips of up to four temporal patches (transformers' MiniMaxM3VLVideoProcessor cuts each video's grid so;
`vision_segment_max_frames`), time positions restarting in each (models.geometries.ClipSegmentsGeometry). The
projector beside it: a GELU MLP over each patch to the text width (`multi_modal_projector`), then one over
each 2x2 block of those (`patch_merge_mlp`). Images are sized as Qwen2-VL's, resized with torchvision's
bicubic on uint8 tensors as MiniMaxM3VLImageProcessor does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from models.config import ProcessorConfig
from models.family import Dims, Family, register
from models.geometries import ClipSegmentsGeometry
from models.layers import make_norm
from models.protocol import Capacity, Geometry, Grid, TowerOutput
from models.resamplers import GeluMlp
from models.rotary import AxialRotary, clip_positions
from models.tower import QwenTower, rope_theta

# Temporal patches per attention segment: the video processor's `vision_segment_max_frames`.
SEGMENT_FRAMES = 4


class MiniMaxTower(QwenTower):
    """The shared blocks with MiniMax's norm before them, its 3D rotary over clips and its projector."""

    def __init__(self, family: Family, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        super().__init__(family, vision_config, processor, backend)
        cfg, dims = vision_config, self.dims
        del self.merger  # the projector takes its place
        self.rotary = AxialRotary(dims.hidden // dims.heads, rope_theta(cfg), axes=3)
        self.pre_layrnorm = make_norm(family.norm, dims.hidden, family.norm_eps)
        self.multi_modal_projector = GeluMlp(dims.hidden, cfg.projector_hidden_size, dims.out)
        self.patch_merge_mlp = GeluMlp(dims.out * self.merge_unit, cfg.projector_hidden_size, dims.out)

    def make_geometry(self) -> Geometry:
        return ClipSegmentsGeometry(self.merge, segment_frames=SEGMENT_FRAMES)

    def build_metadata(self, grids: Sequence[Grid], cap: Capacity) -> dict[str, np.ndarray]:
        meta = super().build_metadata(grids, cap)
        frames = [self.geometry.frames(grid) for grid in grids]  # type: ignore[attr-defined]
        meta["pos_ids"] = clip_positions(grids, self.merge, cap.patches, frames)
        return meta

    def forward(self, pixels: torch.Tensor, meta: dict[str, torch.Tensor], cap: Capacity) -> TowerOutput:
        x = self.pre_layrnorm(self.patch_embed(self.normalize(pixels)))
        x, _ = self.run_blocks(x, meta, cap)
        tokens = self.multi_modal_projector(x)
        return TowerOutput(self.patch_merge_mlp(tokens.view(-1, tokens.shape[-1] * self.merge_unit)), [])


def minimax_dims(cfg: Any) -> Dims:
    heads = cfg.num_attention_heads
    return Dims(hidden=cfg.hidden_size, heads=heads, kv_heads=heads, mlp=cfg.intermediate_size,
                depth=cfg.num_hidden_layers, out=cfg.out_hidden_size)


def reference_features(model: Any, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """transformers' features for packed pixels and grids cut into attention segments (the benchmarks' and GPU
    tests' reference): its vision model, then its projector."""
    inner = model.model
    hidden = inner.vision_tower(pixel_values=pixels, grid_thw=grid_thw).last_hidden_state
    return inner.multi_modal_projector(hidden.squeeze(0))


# The released checkpoint's names (transformers' save_pretrained writes them too) for the shared layers'.
MINIMAX_RENAMES = (
    ("embeddings.patch_embedding.", "patch_embed.proj."), ("encoder.layers.", "blocks."),
    (".layer_norm1.", ".norm1."), (".layer_norm2.", ".norm2."), (".self_attn.q_proj.", ".attn.q."),
    (".self_attn.k_proj.", ".attn.k."), (".self_attn.v_proj.", ".attn.v."), (".self_attn.out_proj.", ".attn.proj."),
)

MINIMAX_M3_VL = register(Family(
    "minimax_m3_vl", "MiniMax-M3", dims=minimax_dims, norm_eps=1e-5, separate_qkv=True,
    # the projector's two steps sit beside the vision model
    prefixes=("vision_tower.vision_model.", ("multi_modal_projector.", "multi_modal_projector."),
              ("patch_merge_mlp.", "patch_merge_mlp.")),
    renames=MINIMAX_RENAMES,
    vision_extras={
        "in_channels": lambda config: config.vision_config.num_channels,
        "out_hidden_size": lambda config: config.text_config.hidden_size,
        "projector_hidden_size": lambda config: config.projector_hidden_size,
    },
    # MiniMaxM3VLVideoProcessor's own settings: frames sized alone between these bounds (not its `size`)
    processor_defaults={"image": {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
                                  "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 451584}},
                        "video": {"fps": 1.0, "min_pixels": 4 * 28 * 28, "max_pixels": 768 * 28 * 28,
                                  "min_frames": 4, "max_frames": 768}},
    image_processor="MiniMaxM3VLImageProcessor", hf_class="MiniMaxM3SparseForConditionalGeneration",
    video_sampling="minimax", image_resize="torch", video_resize="torch", tower=MiniMaxTower,
    vllm_embedding_parts=False, extra={"reference_features": reference_features},
))
