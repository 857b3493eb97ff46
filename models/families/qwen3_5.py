"""Qwen3.5 (Qwen3.5-27B) and Qwen3.5-MoE (Qwen3.5-35B-A3B): Qwen3-VL's tower without DeepStack."""

from models.families.qwen3_vl import QWEN3_VL
from models.family import register

QWEN3_5 = register(QWEN3_VL.derive(
    model_type="qwen3_5", title="Qwen3.5", deepstack=None, hf_class="Qwen3_5ForConditionalGeneration",
))
QWEN3_5_MOE = register(QWEN3_5.derive(
    model_type="qwen3_5_moe", title="Qwen3.5-MoE", hf_class="Qwen3_5MoeForConditionalGeneration",
))
