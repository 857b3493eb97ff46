"""PaddleOCR-VL (`paddleocr_vl`: PaddleOCR-VL, PaddleOCR-VL-1.5): a SigLIP tower (models/siglip.py).

Conv2d patches over rows the processor keeps row-major, a 27x27 position table resampled bilinearly at the
patch centres (align_corners=False), 2D rotary positions in row-major order, separate q/k/v, a post-LayerNorm,
then the projector outside the vision model: LayerNorm (eps 1e-5) on each patch, each 2x2 block of the
row-major patches side by side, Linear, GELU, Linear to the language model's width. Images only; the image
processor is Qwen2-VL's with its own `smart_resize` (sides below 28 px scaled up first) and one frame per patch.
"""

from __future__ import annotations

from typing import Any

import torch

from models.family import Family, register
from models.siglip import SiglipTower, siglip_dims


def reference_image_features(model: Any, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """transformers' own entry point on rows [patches, 3 * 14 * 14]: its processor's 4D patches."""
    patch = model.config.vision_config.patch_size
    out = model.model.get_image_features(pixel_values=pixels.view(pixels.shape[0], -1, patch, patch),
                                         image_grid_thw=grid_thw)
    return torch.cat(out.pooler_output)


PADDLEOCR_VL = register(Family(
    "paddleocr_vl", "PaddleOCR-VL", config_path=(), dims=siglip_dims,
    # transformers' save_pretrained, then the releases' names (`visual.vision_model.*`, the projector as
    # `mlp_AR.*`); the SigLIP pooling head and the unused packing position table of the releases stay unread.
    prefixes=(("model.visual.vision_model.head.", None), ("visual.vision_model.head.", None),
              ("model.visual.vision_model.embeddings.packing_position_embedding.", None),
              ("visual.vision_model.embeddings.packing_position_embedding.", None),
              ("model.visual.vision_model.", "visual."), ("model.projector.", "projector."),
              ("visual.vision_model.", "visual."), ("mlp_AR.", "projector.")),
    image_sizing="paddleocr_vl", video=False, image_processor="PaddleOCRVLImageProcessor",
    patch_order="raster", processor_defaults={"image": {"patch_size": 14, "temporal_patch_size": 1, "merge_size": 2}},
    # vLLM 0.33's PaddleOCR-VL takes pixels only: its hand-off part keeps the media and names the cached output.
    vllm_embedding_parts=False,
    hf_class="PaddleOCRVLForConditionalGeneration", tower=SiglipTower,
    extra={"patch_embedding": "conv2d", "position_side": lambda v: v.image_size // v.patch_size,
           "positions": "half_pixel", "rotary": True,
           "merger_names": ("pre_norm", "linear_1", "linear_2"), "merger_eps": 1e-5,
           "reference_features": reference_image_features},
))
