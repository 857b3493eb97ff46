"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, -235B-A22B): Qwen3-VL's tower with DeepStack; the MoE is the LLM's."""

from models.families.qwen3_vl import QWEN3_VL
from models.family import register

QWEN3_VL_MOE = register(QWEN3_VL.derive(
    model_type="qwen3_vl_moe", title="Qwen3-VL-MoE", hf_class="Qwen3VLMoeForConditionalGeneration",
))
