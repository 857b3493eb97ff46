"""HyperCLOVAX-SEED Vision V2 (HyperCLOVAX-SEED-Think-32B): Qwen2.5-VL's tower (`model.vision_model.*`) and one
Linear after it to the language model's width (`model.vision_projector.*`, `model.projector.*` once loaded by
transformers): the model's image and video features (`get_image_features`) are the projection's output, and so
are this family's embeddings. transformers' config class for it takes a config.json naming `model_type: "vlm"`
and a "qwen2_5_vl" vision config, as its code says the hub's does: so does the loader. Images as Qwen2-VL's
processor, videos as Qwen2-VL's video processor.

vLLM 0.33's processor for it (HCXVisionV2ForCausalLM) reads embedding parts as media and fails, and its model
would run its own projector over `image_embeds` (the tower's output before the projection): the hand-off keeps
the media part with the uuid, as for GLM, and vLLM as an encoder-cache consumer loads these embeddings (its
encoder output is the projection's too)."""

from __future__ import annotations

from typing import Any

import torch

from models.families.qwen2_5_vl import QWEN2_5_VL
from models.family import register
from models.projection import ProjectedTower


def reference_image_features(model: Any, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """transformers' own entry point: its vision model, then the projection (the bench's reference)."""
    return torch.cat(model.model.get_image_features(pixel_values=pixels, image_grid_thw=grid_thw).pooler_output)


HYPERCLOVAX_VISION_V2 = register(QWEN2_5_VL.derive(
    model_type="hyperclovax_vision_v2", title="HyperCLOVAX-SEED Vision V2", config_model_types=("vlm",),
    # the projection beside the vision model: `model.vision_projector.*` as released, `model.projector.*` as
    # transformers names it (and writes it with save_pretrained)
    prefixes=("model.vision_model.", "vision_model.", ("model.vision_projector.", "projector."),
              ("model.projector.", "projector.")),
    vision_extras={"projection_size": lambda config: config.text_config.hidden_size}, tower=ProjectedTower,
    vllm_video_seconds=None,  # its language model has no M-RoPE
    vllm_embedding_parts=False, hf_class="HyperCLOVAXVisionV2ForConditionalGeneration",
    extra={"reference_features": reference_image_features},
))
