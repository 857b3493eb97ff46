"""Cohere Compass (North-Micro-Vision-Instruct): Qwen3-VL's tower with DeepStack. Its image processor
class (CohereCompassImageProcessor) is Qwen2-VL's under another name; its vision model takes images
only (transformers' `input_modalities`, and vLLM accepts no videos for it). vLLM 0.33's parser for it
requires the embeddings in every part: metadata-only parts (`vllm_ref`) are refused there."""

from models.families.qwen3_vl import QWEN3_VL
from models.family import register

COHERE_COMPASS = register(QWEN3_VL.derive(
    model_type="cohere_compass", title="Cohere Compass", image_processor="CohereCompassImageProcessor",
    video=False, video_timestamps=False,
    hf_class="CohereCompassForConditionalGeneration",
))
