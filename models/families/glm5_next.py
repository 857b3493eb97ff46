"""GLM-5-Next (GLM-5.3-Flash): GLM-OCR's tower (no position table, biases, per-head q/k norms) whose SwiGLUs,
in the blocks' MLPs and in the merger, clamp the gate from above and the up projection on both sides at the
config's `swiglu_limit` (10); the merger is `projection_intermediate_size` wide.

Its processors bound an item by merged tokens (images 16 to 8000, videos 16 to 240000 over the whole clip),
round the sides up to multiples of 28 and shrink the content into that canvas, zero-padding the rest instead
of stretching it (`budget_resize`, `padded_content` in service/media/image_preprocess.py); videos are sampled
at a fixed rate up to 2048 frames. vLLM 0.33 serves it with GLM-4.1V's processor: no embedding parts.
"""

from __future__ import annotations

from typing import Any

from models.config import ProcessorConfig
from models.families.glm4v import GLM_OCR, GlmMerger, GlmTower
from models.family import Family, register
from models.layers import GatedMlp


class ClampedGlmTower(GlmTower):
    """GLM's tower with every SwiGLU clamped at the config's `swiglu_limit`, and the merger as wide as the
    config's `projection_intermediate_size`."""

    def __init__(self, family: Family, vision_config: Any, processor: ProcessorConfig, backend: str) -> None:
        super().__init__(family, vision_config, processor, backend)
        limit = float(vision_config.swiglu_limit)
        self.merger = GlmMerger(self.dims.out, vision_config.projection_intermediate_size, vision_config.hidden_act,
                                limit=limit)
        for block in self.blocks:
            assert isinstance(block.mlp, GatedMlp)
            block.mlp.limit = limit


GLM5_NEXT = register(GLM_OCR.derive(
    model_type="glm5_next", title="GLM-5-Next", image_sizing="glm5", video_sampling="glm5",
    image_processor="Glm5NextImageProcessor", hf_class="Glm5NextForConditionalGeneration", tower=ClampedGlmTower,
    processor_defaults={
        "image": {"min_image_tokens": 16, "max_image_tokens": 8000},
        "video": {"min_image_tokens": 16, "max_image_tokens": 240000, "fps": 2, "max_frames": 2048},
    },
))
