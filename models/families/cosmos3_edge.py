"""Cosmos3-Edge (`cosmos3_edge`): a SigLIP2 tower (models/siglip.py) and a Qwen3.5-style merger.

Linear patches over rows whose values run (row, col, channel), a 16x16 position table resampled to each frame
by F.interpolate's antialiased bilinear (the table's cells a patch reads grow with the downsampling), no
rotary positions, separate q/k/v, a post-LayerNorm; then the projector outside the vision model: LayerNorm
(eps 1e-6) on each patch, each 2x2 merge block side by side, Linear to `projector_hidden_size`, GELU,
Linear to the language model's width. Images are sized as GLM's (one frame per patch), videos sampled as
Qwen3-VL's video processor does, every frame its own attention segment.
"""

from __future__ import annotations

from typing import Any

import torch

from models.family import Family, register
from models.siglip import SiglipTower, siglip_dims


def reference_image_features(model: Any, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """transformers' own entry point (videos take the same path there)."""
    return torch.cat(model.model.get_image_features(pixel_values=pixels, image_grid_thw=grid_thw).pooler_output)


IMAGENET_STANDARD = [0.5, 0.5, 0.5]
# Cosmos3EdgeImageProcessor's defaults, which its video processor shares
PROCESSOR_DEFAULTS = {"patch_size": 16, "temporal_patch_size": 1, "merge_size": 2, "image_mean": IMAGENET_STANDARD,
                      "image_std": IMAGENET_STANDARD}

COSMOS3_EDGE = register(Family(
    "cosmos3_edge", "Cosmos3-Edge", config_path=(), dims=siglip_dims,
    prefixes=(("model.visual.", "visual."), ("model.projector.", "projector.")),
    # transformers renames the release's language-model names as it loads (conversion_mapping.py); its patterns
    # match the vision blocks too, so save_pretrained writes their reverse there: both spellings load.
    renames=((".self_attn.to_q.", ".self_attn.q_proj."), (".self_attn.to_k.", ".self_attn.k_proj."),
             (".self_attn.to_v.", ".self_attn.v_proj."), (".mlp.up_proj.", ".mlp.fc1."),
             (".mlp.down_proj.", ".mlp.fc2.")),
    image_sizing="glm4v", video_sampling="qwen3", video_timestamps=True, image_processor="Cosmos3EdgeImageProcessor",
    patch_layout="hwc",
    processor_defaults={"image": PROCESSOR_DEFAULTS, "video": PROCESSOR_DEFAULTS},
    hf_class="Cosmos3EdgeForConditionalGeneration", tower=SiglipTower,
    extra={"patch_embedding": "linear", "linear_layout": "hwc", "position_side": lambda v: int(v.num_patches**0.5),
           "positions": "antialias", "rotary": False,
           "merger_names": ("norm", "linear_fc1", "linear_fc2"), "merger_eps": 1e-6,
           "merger_hidden": lambda config: config.projector_hidden_size,
           "reference_features": reference_image_features},
))
